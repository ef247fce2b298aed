"""Coding agents pointed at an mlxhost server (`mlxhost launch`). Each agent is one small module that says
which environment, config files and arguments make its CLI talk to a served model; AGENTS is the registry."""

from mlxhost.agents import claude, codex, opencode, qwen
from mlxhost.agents.base import Agent, AgentSetup, Target

AGENTS: dict[str, Agent] = {a.name: a for a in (claude.AGENT, codex.AGENT, opencode.AGENT, qwen.AGENT)}

__all__ = ["AGENTS", "Agent", "AgentSetup", "Target"]

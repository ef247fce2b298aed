"""Claude Code (`@anthropic-ai/claude-code`): environment variables only, read at start (checked on 2.1.197 and 2.1.332)."""

from __future__ import annotations

import pathlib

from mlxhost.agents.base import Agent, AgentSetup, Target


def configure(target: Target, folder: pathlib.Path) -> AgentSetup:
    model = target.model
    env = {
        "ANTHROPIC_BASE_URL": target.url,
        # Sent as `Authorization: Bearer`; unlike ANTHROPIC_API_KEY it needs no approval prompt, and the empty
        # ANTHROPIC_API_KEY keeps a real Anthropic key in the shell from going to this server.
        "ANTHROPIC_AUTH_TOKEN": target.api_key,
        "ANTHROPIC_API_KEY": "",
        "ANTHROPIC_MODEL": model,
        # The models behind the opus / sonnet / haiku choices, sub-agents, and the older name of the haiku one.
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        # The context window for model names that do not start with "claude-" (200k otherwise), so it compacts
        # before the server's limit, and the max_tokens of every request.
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(target.context_tokens),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(target.max_output_tokens),
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # update checks, surveys, release notes
    }
    return AgentSetup(env=env)


# Its requests say `User-Agent: claude-cli/2.1.332 (external, cli)`.
AGENT = Agent(name="claude", command="claude", npm_package="@anthropic-ai/claude-code", configure=configure,
              user_agent="claude-cli/")

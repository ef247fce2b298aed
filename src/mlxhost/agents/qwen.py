"""Qwen Code (`@qwen-code/qwen-code`): OpenAI-compatible auth from the environment, and a system settings file
for what has no variable: usage statistics off, the context window (checked on 0.15.10 and 0.24.4)."""

from __future__ import annotations

import pathlib

from mlxhost.agents.base import Agent, AgentSetup, Target, write_json


def settings(target: Target) -> dict:
    return {
        "security": {"auth": {"selectedType": "openai"}},
        "model": {"name": target.model, "generationConfig": {"contextWindowSize": target.context_tokens}},
        "privacy": {"usageStatisticsEnabled": False},  # on by default
        "telemetry": {"enabled": False},
    }


def configure(target: Target, folder: pathlib.Path) -> AgentSetup:
    path = write_json(folder / "settings.json", settings(target))
    env = {
        "OPENAI_BASE_URL": target.openai_base_url,
        "OPENAI_API_KEY": target.api_key,
        "OPENAI_MODEL": target.model,
        "QWEN_CODE_MAX_OUTPUT_TOKENS": str(target.max_output_tokens),
        "QWEN_DEFAULT_AUTH_TYPE": "openai",
        "QWEN_TELEMETRY_ENABLED": "false",
        # System settings win over the user's, so the ones above apply whatever ~/.qwen says.
        "QWEN_CODE_SYSTEM_SETTINGS_PATH": str(path),
    }
    return AgentSetup(env=env, args=("--auth-type", "openai"), files=(path,))


AGENT = Agent(name="qwen", command="qwen", npm_package="@qwen-code/qwen-code", configure=configure)

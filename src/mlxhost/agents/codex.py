"""Codex CLI (`@openai/codex`): a config.toml in a CODEX_HOME of its own, so the user's ~/.codex stays as it
is (checked on 0.171.0, whose custom providers speak only the Responses API)."""

from __future__ import annotations

import json
import pathlib

from mlxhost.agents.base import Agent, AgentSetup, Target

KEY_VARIABLE = "MLXHOST_AGENT_API_KEY"  # not MLXHOST_API_KEY: a server the agent starts must not inherit it


def config_toml(target: Target) -> str:
    def q(text: str) -> str:  # a TOML basic string: JSON's escapes are valid TOML
        return json.dumps(text)

    return "\n".join([
        "# Written by `mlxhost launch codex` at every launch.",
        f"model = {q(target.model)}",
        'model_provider = "mlxhost"',
        # Codex 0.171 has no setting for max output tokens: the server's --default-max-tokens applies.
        f"model_context_window = {target.context_tokens}",
        f"model_auto_compact_token_limit = {int(target.context_tokens * 0.9)}",
        "check_for_update_on_startup = false",
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[model_providers.mlxhost]",
        'name = "mlxhost"',
        f"base_url = {q(target.openai_base_url)}",
        'wire_api = "responses"',
        f"env_key = {q(KEY_VARIABLE)}",
        "",
    ])


def configure(target: Target, folder: pathlib.Path) -> AgentSetup:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.toml"
    path.write_text(config_toml(target), encoding="utf-8")
    return AgentSetup(env={"CODEX_HOME": str(folder), KEY_VARIABLE: target.api_key}, files=(path,))


AGENT = Agent(name="codex", command="codex", npm_package="@openai/codex", configure=configure)

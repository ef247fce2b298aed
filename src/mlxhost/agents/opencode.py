"""opencode (`opencode-ai`): an OpenAI-compatible provider in OPENCODE_CONFIG_CONTENT, which is merged over
the user's own config files (checked on 1.18.33)."""

from __future__ import annotations

import json
import pathlib

from mlxhost.agents.base import Agent, AgentSetup, Target

PROVIDER = "mlxhost"


def config(target: Target) -> dict:
    model = {"name": target.model, "limit": {"context": target.context_tokens, "output": target.max_output_tokens}}
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {PROVIDER: {
            "npm": "@ai-sdk/openai-compatible",  # bundled with opencode: nothing is downloaded
            "name": "mlxhost",
            "options": {"baseURL": target.openai_base_url, "apiKey": target.api_key},
            "models": {target.model: model},
        }},
        "model": f"{PROVIDER}/{target.model}",
        "small_model": f"{PROVIDER}/{target.model}",  # session titles
        "share": "disabled",
        "autoupdate": False,
    }


def configure(target: Target, folder: pathlib.Path) -> AgentSetup:
    env = {
        "OPENCODE_CONFIG_CONTENT": json.dumps(config(target)),
        "OPENCODE_DISABLE_MODELS_FETCH": "1",  # no models.dev catalogue download
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_SHARE": "1",
    }
    return AgentSetup(env=env)


AGENT = Agent(name="opencode", command="opencode", npm_package="opencode-ai", configure=configure)

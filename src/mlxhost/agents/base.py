"""What every agent module gets (the served model) and gives back (environment and arguments)."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Target:
    """The served model an agent talks to."""

    url: str  # http://127.0.0.1:8000, no /v1
    model: str  # the served name
    api_key: str
    context_tokens: int  # the server's max_model_len for this model
    max_output_tokens: int  # what the agent may ask for in one answer

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"


@dataclass(frozen=True)
class AgentSetup:
    env: dict[str, str]  # added to the caller's environment
    args: tuple[str, ...] = ()  # before the user's own agent arguments
    files: tuple[pathlib.Path, ...] = field(default=())  # config files written


@dataclass(frozen=True)
class Agent:
    name: str  # `mlxhost launch NAME`
    command: str  # the executable
    npm_package: str
    # configure(target, folder): the setup; files the agent needs are written into folder (created if missing).
    configure: Callable[[Target, pathlib.Path], AgentSetup]
    # How its requests' User-Agent starts (followed by its version): the server notes its fixed prompt prefix
    # under it, which `launch` saves and pre-warms later conversations with (agents/prewarm.py). None: not done.
    user_agent: str | None = None

    @property
    def install_command(self) -> str:
        return f"npm install -g {self.npm_package}"


MAX_OUTPUT_TOKENS = 32_000  # as long as agents usually let an answer be


def default_max_output_tokens(context_tokens: int) -> int:
    """A quarter of the context, at most MAX_OUTPUT_TOKENS: room for long prompts (an agent's own is 10-55k
    tokens)."""
    return max(1, min(MAX_OUTPUT_TOKENS, context_tokens // 4))


def write_json(path: pathlib.Path, obj: dict) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    return path

"""Ollama's request bodies (`/api/chat`, `/api/generate`, `/api/embed`, ...), as its clients send them.

Lenient like Ollama's own server: unknown fields are accepted and logged at debug (a newer client's
fields). What a field does here is decided in translate.py; this module only reads the shapes.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ToolCallFunction(_Body):
    name: str
    arguments: Union[dict, str] = Field(default_factory=dict)


class ToolCall(_Body):
    function: ToolCallFunction


class Message(_Body):
    role: str
    content: Optional[str] = ""
    images: Optional[list[str]] = None  # base64, no data: prefix
    thinking: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_name: Optional[str] = None  # a tool message: which tool's result


class _Generating(_Body):
    model: str = Field(min_length=1)
    stream: bool = True  # Ollama streams unless told not to
    format: Optional[Union[str, dict]] = None  # "json" or a JSON schema
    options: Optional[dict[str, Any]] = None
    keep_alive: Optional[Union[float, str]] = None
    think: Optional[Union[bool, str]] = None  # true / false, or "low" / "medium" / "high"
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)


class ChatRequest(_Generating):
    messages: list[Message] = Field(default_factory=list)
    tools: Optional[list[dict]] = None


class GenerateRequest(_Generating):
    prompt: Optional[str] = None
    suffix: Optional[str] = None
    system: Optional[str] = None
    template: Optional[str] = None
    context: Optional[list[int]] = None  # token ids of the conversation so far (an earlier reply's `context`)
    raw: bool = False
    images: Optional[list[str]] = None


class EmbedRequest(_Body):
    model: str = Field(min_length=1)
    input: Union[str, list[str]]
    truncate: bool = True  # Ollama's default: an input past the context is cut, not refused
    dimensions: Optional[int] = Field(default=None, ge=1)
    options: Optional[dict[str, Any]] = None
    keep_alive: Optional[Union[float, str]] = None


class EmbeddingsRequest(_Body):
    """The older `/api/embeddings`: one prompt, one vector."""

    model: str = Field(min_length=1)
    prompt: str = ""
    options: Optional[dict[str, Any]] = None
    keep_alive: Optional[Union[float, str]] = None


class NamedRequest(_Body):
    """`/api/show`, `/api/pull`, `/api/delete`: a model by `model` (or the older `name`)."""

    model: Optional[str] = None
    name: Optional[str] = None
    stream: bool = True
    insecure: Optional[bool] = None
    verbose: Optional[bool] = None

    @property
    def target(self) -> str:
        return self.model or self.name or ""


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: Union[float, str, None]) -> Optional[float]:
    """Ollama's keep_alive as seconds: a number is seconds, a string a Go duration ("5m", "1h30m",
    "-1"); negative means forever (inf). None when not given; ValueError for what is neither."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
            parts = _DURATION_PART.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"keep_alive {value!r} is not a duration such as \"5m\", \"30s\" or -1") from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    if math.isnan(seconds):
        raise ValueError("keep_alive is not a number")
    return math.inf if seconds < 0 else seconds

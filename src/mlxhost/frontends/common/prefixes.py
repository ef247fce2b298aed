"""Agents' fixed prompt prefixes, as the server saw them: what `mlxhost launch` pre-warms a new conversation with.

An agent CLI opens every conversation with the same system prompt and tool list for its version, and tells its
version in the `User-Agent` header (`claude-cli/2.1.332 (external, cli)`). Per User-Agent, model and cache group
this keeps, in memory, the largest such prefix seen: the internal request (OpenAI chat fields, whatever dialect it
came in) cut before its first user message, so no conversation content is kept. `GET /v1/cache/prefixes` lists
them and `POST /v1/cache/prefill` computes one again (admin/prefill.py). Imports no MLX.
"""

from __future__ import annotations

from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass

from mlxhost.serving.schemas import ChatCompletionRequest

# The User-Agent of the request being handled ('' when it sent none); set by `ClientAgent`.
client_agent: ContextVar[str] = ContextVar("client_agent", default="")

MAX_NUM_PREFIXES = 32  # distinct (agent, model, group) kept; the least recently seen goes first
MAX_USER_AGENT_CHARS = 200


class ClientAgent:
    """ASGI middleware: the request's User-Agent into `client_agent`, for the gateway's `note`."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            agent = next((v for k, v in scope.get("headers", ()) if k == b"user-agent"), b"")
            client_agent.set(agent.decode("latin-1")[:MAX_USER_AGENT_CHARS])
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class Prefix:
    user_agent: str
    model: str
    body: dict  # OpenAI chat fields: the system messages before the first user message, and the tools
    num_chars: int  # of the system text and tool definitions: which of two prefixes is the larger

    def describe(self) -> dict:
        return {"user_agent": self.user_agent, "model": self.model, "num_chars": self.num_chars,
                "num_tools": len(self.body.get("tools") or ()), "body": self.body}


def _size(body: ChatCompletionRequest) -> tuple[int, int] | None:
    """(number of leading non-user messages, their text plus the tools' descriptions in characters); None when
    the prompt has no fixed part worth keeping (no system message, no tools) or no user message to cut at."""
    fixed = 0
    for m in body.messages:
        if m.role == "user":
            break
        if m.role not in ("system", "developer"):
            return None  # an assistant turn before any user one: not a conversation's start
        fixed += 1
    else:
        return None
    if not fixed and not body.tools:
        return None
    chars = sum(len(m.text()) for m in body.messages[:fixed])
    chars += sum(len(t.function.name) + len(t.function.description or "") for t in body.tools or ())
    return fixed, chars


class PrefixCaptures:
    """The largest fixed prefix seen per (User-Agent, model, cache group); a bounded, in-memory table."""

    def __init__(self, max_num_prefixes: int = MAX_NUM_PREFIXES) -> None:
        self.max_num_prefixes = max_num_prefixes
        self._prefixes: OrderedDict[tuple[str, str, str], Prefix] = OrderedDict()

    def note(self, user_agent: str, model: str, body: ChatCompletionRequest, group: str = "") -> None:
        """Called for every chat request that reaches an engine: cheap unless its prefix is a new largest."""
        if not user_agent:
            return
        size = _size(body)
        if size is None:
            return
        key = (user_agent, model, group)
        known = self._prefixes.get(key)
        if known is not None:
            self._prefixes.move_to_end(key)
            if known.num_chars >= size[1]:
                return
        fields = body.model_dump(exclude_none=True, exclude_unset=True, by_alias=True)
        fields["messages"] = fields["messages"][: size[0]]
        for name in ("stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "tool_choice"):
            fields.pop(name, None)
        if body.listed_tools != list(body.tools or ()):  # only the listed ones are rendered in the prompt
            fields["tools"] = [t.model_dump(exclude_none=True, by_alias=True) for t in body.listed_tools]
        fields["model"] = model
        self._prefixes[key] = Prefix(user_agent, model, fields, size[1])
        while len(self._prefixes) > self.max_num_prefixes:
            self._prefixes.popitem(last=False)

    def list(self, group: str = "") -> list[dict]:
        """The prefixes of one cache group: an API key never sees another group's prompts."""
        return [p.describe() for (_, _, g), p in self._prefixes.items() if g == group]

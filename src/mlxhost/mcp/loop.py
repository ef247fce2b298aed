"""The tool-call loop, written once for every dialect: ask the model (one round, through the dialect's
`ask`), run each call it makes to an MCP tool, give it the results, and ask again, until it answers
without MCP calls, a call needs the client's approval, or the request's limit of rounds or time is
reached (then a last round with tool_choice "none" makes it answer).

The loop yields an `McpCallRecord` as each call finishes (a streaming dialect shows it at once) and
ends with a `LoopResult`.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from mlxhost.mcp.client import McpCallError, McpManager, McpServer, McpTool
from mlxhost.mcp.config import McpConfig
from mlxhost.mcp.remote import RemoteRefused, check_remote_url

DECLINED = "the user declined this tool call"


@dataclass(frozen=True)
class OfferedTool:
    tool: McpTool
    server: McpServer
    require_approval: bool

    @property
    def label(self) -> str:
        return self.server.label

    def function(self) -> dict:
        return {"type": "function", "function": {"name": self.tool.name, "description": self.tool.description,
                                                 "parameters": self.tool.input_schema}}


@dataclass(frozen=True)
class ServerChoice:
    """One server a request wants: a configured label, or (with --mcp-allow-remote) a URL of its own."""

    label: str
    url: str | None = None
    headers: dict[str, str] | None = None
    allowed_tools: tuple[str, ...] | None = None
    require_approval: Any = "never"  # "always", "never", or {"always"/"never": {"tool_names": [...]}}

    def needs_approval(self, tool: str) -> bool:
        rule = self.require_approval
        if isinstance(rule, str):
            return rule == "always"
        if isinstance(rule, dict):
            if tool in ((rule.get("never") or {}).get("tool_names") or ()):
                return False
            if tool in ((rule.get("always") or {}).get("tool_names") or ()):
                return True
            return "never" not in rule  # only named exceptions to "never": the rest need approval
        return False


class ToolsetError(ValueError):
    """The request named a server it may not use, or one that is not there (a 400)."""


class Toolset:
    """The MCP tools one request offers the model, by the name the model calls them; connections to
    URLs the request named are open while it runs (`async with`)."""

    def __init__(self, manager: McpManager, choices: list[ServerChoice]) -> None:
        self.manager, self.choices = manager, choices
        self.tools: dict[str, OfferedTool] = {}
        self.servers: list[McpServer] = []
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Toolset:
        import asyncio  # lazy: asyncio only when used

        try:
            for choice in self.choices:
                if choice.url is not None:
                    try:
                        await asyncio.to_thread(check_remote_url, choice.url, self.manager.config.allow_remote,
                                                self.manager.resolve)
                    except RemoteRefused as exc:
                        raise ToolsetError(str(exc)) from None
                    try:
                        server = await self._stack.enter_async_context(
                            self.manager.open_remote(choice.label, choice.url, choice.headers))
                    except McpCallError as exc:
                        raise ToolsetError(str(exc)) from None
                else:
                    server = self.manager.server(choice.label)
                    if server is None:
                        known = ", ".join(self.manager.servers) or "none"
                        raise ToolsetError(f"no MCP server {choice.label!r} is configured on this server (configured: "
                                           f"{known})")
                    await server.wait_ready(min(5.0, self.manager.config.connect_timeout_s))
                self.servers.append(server)
                needs_config_approval = server.config.require_approval == "always"
                for tool in server.tools:
                    if choice.allowed_tools is not None and tool.name not in choice.allowed_tools:
                        continue
                    # Two servers with one tool name: the first keeps it (a call could not say which it meant).
                    self.tools.setdefault(tool.name, OfferedTool(
                        tool, server, needs_config_approval or choice.needs_approval(tool.name)))
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stack.aclose()

    def functions(self) -> list[dict]:
        return [t.function() for t in self.tools.values()]

    def listed(self, server: McpServer) -> list[McpTool]:
        return [t.tool for t in self.tools.values() if t.server is server]


@dataclass
class McpCallRecord:
    """One call as the client is told of it."""

    id: str  # the model's call id
    server: str
    name: str
    arguments: str
    output: str | None = None
    error: str | None = None
    approval_request_id: str | None = None

    def as_dict(self) -> dict:
        return {"id": self.id, "server": self.server, "name": self.name, "arguments": self.arguments,
                "output": self.output, "error": self.error}

    def tool_message(self) -> dict:
        return {"role": "tool", "tool_call_id": self.id,
                "content": self.output if self.error is None else f"Error: {self.error}"}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class RoundReply:
    """One model round, as the dialect's `ask` read it."""

    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    finish_reason: str | None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    raw: Any = None  # the dialect's own record of the round (what its renderer needs)


@dataclass
class PendingApproval:
    id: str  # the approval request's id
    call: ToolCall
    server: str


@dataclass
class LoopResult:
    reply: RoundReply | None  # the last round (the answer, or the round that asked for approval)
    calls: list[McpCallRecord] = field(default_factory=list)
    approvals: list[PendingApproval] = field(default_factory=list)
    num_rounds: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def finish_reason(self) -> str | None:
        return self.reply.finish_reason if self.reply is not None else None


Ask = Callable[[list[dict], Any], Awaitable[RoundReply]]  # (messages, tool_choice) -> the round


def assistant_message(reply: RoundReply, calls: list[ToolCall]) -> dict:
    message: dict = {"role": "assistant", "content": reply.content,
                     "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments":
                                                                                  c.arguments or "{}"}}
                                    for c in calls]}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    return message


async def execute(toolset: Toolset, call: ToolCall, approval_request_id: str | None = None) -> McpCallRecord:
    """Runs one call; every failure is the record's `error`, never an exception."""
    offered = toolset.tools.get(call.name)
    record = McpCallRecord(call.id, offered.label if offered else "", call.name, call.arguments or "{}",
                           approval_request_id=approval_request_id)
    if offered is None:
        record.error = f"no MCP tool {call.name!r} is offered in this request"
        return record
    try:
        arguments = json.loads(call.arguments) if call.arguments and call.arguments.strip() else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        record.error = "the tool call's arguments are not a JSON object"
        return record
    try:
        output = await offered.server.call(offered.tool.name, arguments)
    except McpCallError as exc:
        record.error = str(exc)
        return record
    if output.is_error:
        record.error = output.text or "the tool reported an error"
    else:
        record.output = output.text
    return record


def new_approval_id() -> str:
    return f"mcpr_{uuid.uuid4().hex}"


async def run_tool_loop(messages: list[dict], toolset: Toolset, ask: Ask, limits: McpConfig,
                        tool_choice: Any = "auto") -> AsyncIterator[McpCallRecord | LoopResult]:
    """Extends `messages` with each round's calls and results; yields each call's record as it ends,
    then the LoopResult. `tool_choice` holds for the first round only: later rounds are "auto", or a
    model forced to call would never answer."""
    deadline = time.monotonic() + limits.max_loop_s
    result = LoopResult(None)
    choice = tool_choice
    while True:
        last_round = result.num_rounds + 1 >= limits.max_num_rounds or time.monotonic() > deadline
        reply = await ask(messages, "none" if last_round and result.num_rounds else choice)
        result.reply, result.num_rounds = reply, result.num_rounds + 1
        result.num_prompt_tokens += reply.num_prompt_tokens
        result.num_output_tokens += reply.num_output_tokens
        result.num_cached_tokens += reply.num_cached_tokens
        mcp_calls = [c for c in reply.tool_calls if c.name in toolset.tools]
        if not mcp_calls or reply.finish_reason == "length":
            break
        approvals = [c for c in mcp_calls if toolset.tools[c.name].require_approval]
        now = [c for c in mcp_calls if not toolset.tools[c.name].require_approval]
        records = []
        for call in now:
            record = await execute(toolset, call)
            records.append(record)
            result.calls.append(record)
            yield record
        if approvals:
            result.approvals = [PendingApproval(new_approval_id(), c, toolset.tools[c.name].label) for c in approvals]
            break
        if len(mcp_calls) < len(reply.tool_calls):  # the client's own tools were called too: its turn
            break
        messages.append(assistant_message(reply, mcp_calls))
        messages.extend(r.tool_message() for r in records)
        choice = "auto"
        if last_round:
            break
    yield result

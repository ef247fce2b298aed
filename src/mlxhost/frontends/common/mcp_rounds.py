"""MCP tools for any dialect: the toolset a request asked for and the model rounds of the one tool-call
loop (mlxhost.mcp.loop), each round opened through the Gateway like any other request. A dialect maps
its body onto chat fields and its servers onto `ServerChoice`s, runs `run_tool_loop` with `gateway_ask`,
and renders the answer and the calls in its own shape; streamed (`stream_loop`), through the one stream loop
(common/stream.py) with its own frames. Imports no MLX."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from mlxhost.engine.request import RequestOutput
from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Gateway, Opened, Whole, chat_request
from mlxhost.frontends.common.keys import current_grant
from mlxhost.frontends.common.metrics import RequestTimer
from mlxhost.frontends.common.sse import event_stream
from mlxhost.frontends.common.stream import Frames, stream
from mlxhost.mcp.loop import (
    Ask,
    LoopResult,
    RoundReply,
    ServerChoice,
    ToolCall,
    Toolset,
    ToolsetError,
    run_tool_loop,
)
from mlxhost.serving.chat_output import collect


class ClientGone(Exception):
    """The client left during a round: the loop stops (its slot is already free)."""


@dataclass
class Round:
    """A round as the dialects render it (`RoundReply.raw`): its text joined, its request, and, streamed, its
    outputs as they came (replayed to the client if the round is the answer)."""

    whole: Whole
    opened: Opened
    outputs: list[RequestOutput] | None = None


def gateway_ask(gateway: Gateway, raw: Request, fields: dict, functions: list[dict], streamed: bool = False) -> Ask:
    """One round of the loop: `fields` (the chat request without messages and tool_choice) with the
    round's messages, the client's own `functions` and the MCP tools, collected whole. `streamed`: the
    stream notices a client that leaves (it cancels the round), and the round's outputs are kept."""

    async def ask(messages: list[dict], tool_choice: Any) -> RoundReply:
        round_fields = {**fields, "messages": messages, "tool_choice": tool_choice}
        if functions:
            round_fields["tools"] = functions
        opened = await gateway.open(chat_request(round_fields))
        kept: list[RequestOutput] | None = None
        if streamed:
            kept, timer = [], gateway.timer()
            whole = await gateway.join(_kept(opened.outputs, kept), timer)
            timer.done(whole.last)
        else:
            whole = await gateway.collect(opened.outputs, gateway.timer(), raw)
        if whole is None:
            raise ClientGone()
        parsed = collect(opened.prepared.output, whole.text)
        last = whole.last
        return RoundReply(parsed.content, parsed.reasoning,
                          [ToolCall(c.id, c.name, c.arguments) for c in parsed.tool_calls], last.finish_reason,
                          last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens,
                          raw=Round(whole, opened, kept))

    return ask


async def _kept(outputs: AsyncIterator[RequestOutput], kept: list[RequestOutput]) -> AsyncIterator[RequestOutput]:
    async for out in outputs:
        kept.append(out)
        yield out


def manager(gateway: Gateway, param: str):
    """The MCP manager, or the 400 of a server started without MCP."""
    if gateway.mcp is None:
        raise APIError(400, "this server has no MCP servers: start it with --mcp-config FILE", param,
                       "mcp_not_configured")
    return gateway.mcp


def allowed_servers(raw: Request) -> tuple[str, ...] | None:
    """The labels the request's API key may use; None: any. A batch line has no gate of its own: its creator's
    grant (`current_grant`, set by the batch dispatcher) speaks for it."""
    grant = current_grant.get()
    policy = grant.policy if grant is not None else getattr(raw.state, "api_key", None)
    return policy.mcp_servers if policy is not None else None


def check_key(raw: Request, choices: list[ServerChoice], param: str) -> None:
    """An API key limited to some MCP servers (its `mcp_servers`, common/keys.py) uses only those."""
    allowed = allowed_servers(raw)
    refused = [c.label for c in choices if allowed is not None and (c.url is not None or c.label not in allowed)]
    if refused:
        raise APIError(403, f"this API key may not use the MCP server(s) {', '.join(map(repr, refused))}", param,
                       "mcp_server_not_allowed")


@contextlib.asynccontextmanager
async def opened_toolset(gateway: Gateway, raw: Request, choices: list[ServerChoice], param: str):
    """The request's toolset, its remote connections open while the block runs; a refusal is a 400 (403
    for a server the request's API key may not use)."""
    check_key(raw, choices, param)
    try:
        toolset = Toolset(manager(gateway, param), choices)
        await toolset.__aenter__()
    except ToolsetError as exc:
        raise APIError(400, str(exc), param, "mcp_server_refused") from None
    try:
        yield toolset
    finally:
        await toolset.__aexit__(None, None, None)


def labels_as_choices(labels: list, param: str) -> list[ServerChoice]:
    """`mcp_servers` of a chat or Messages body: configured labels (strings, or objects with a `name`),
    or Anthropic's `{"type": "url", "url", "name", "authorization_token"}` for a URL of the request's own."""
    choices = []
    for i, entry in enumerate(labels):
        if isinstance(entry, str):
            choices.append(ServerChoice(entry))
        elif isinstance(entry, dict) and isinstance(entry.get("name"), str):
            token = entry.get("authorization_token")
            allowed = (entry.get("tool_configuration") or {}).get("allowed_tools")
            choices.append(ServerChoice(entry["name"], entry.get("url"),
                                        {"Authorization": f"Bearer {token}"} if token else None,
                                        tuple(allowed) if allowed is not None else None))
        else:
            raise APIError(400, "an MCP server is a configured label or an object with `name` (and `url`)",
                           f"{param}.{i}")
    return choices


def unapproved(result) -> list[dict]:
    """Calls the loop stopped at because their server wants each approved: only the Responses API asks
    the client; here they are reported as not run."""
    return [{"id": a.call.id, "server": a.server, "name": a.call.name, "arguments": a.call.arguments,
             "output": None, "error": "this tool needs approval for each call: use the Responses API's mcp tool"}
            for a in result.approvals]


def loop_fields(body, exclude: set[str]) -> dict:
    """A validated body's fields for the loop's rounds, without those each round sets itself."""
    return body.model_dump(exclude_none=True, exclude={"messages", "tools", "tool_choice", "stream", "n",
                                                       "mcp_servers", *exclude})


async def whole_loop(gateway: Gateway, raw: Request, messages: list[dict], tools: Toolset, ask: Ask,
                     tool_choice: Any) -> LoopResult | None:
    """The loop run to its end for a whole reply; None if the client left first: the round or the call under
    way is cancelled then, not only the next round."""

    async def run() -> LoopResult:
        async for step in run_tool_loop(messages, tools, ask, gateway.mcp.config, tool_choice):
            result = step
        return result

    try:
        return await gateway.unless_gone(run(), raw)
    except ClientGone:
        return None


def calls_of(result: LoopResult) -> list[dict]:
    """The extension field `mcp_calls` of a chat or Messages reply: the calls run, then those not run."""
    return [c.as_dict() for c in result.calls] + unapproved(result)


class LoopFrames:
    """A dialect's stream frames over the loop: `before`'s (its start, its keep-alives while rounds and calls
    run, a failure) until the loop ends; then `announce(calls)` and the answer round's frames (`answer(round)`),
    through which that round's outputs are replayed."""

    def __init__(self, before: Frames, answer: Callable[[Round], Frames], announce: Callable[[list[dict]], str]):
        self.frames, self._answer, self._announce = before, answer, announce
        self._pending = ""

    def answered(self, result: LoopResult) -> None:
        self.frames = self._answer(result.reply.raw)
        self._pending = self._announce(calls_of(result))

    def start(self) -> str:
        return self.frames.start()

    def waiting(self) -> str:
        return self.frames.waiting()

    def output(self, out: RequestOutput) -> str | None:
        text, self._pending = self._pending + (self.frames.output(out) or ""), ""
        return text

    def error(self, error: APIError, out: RequestOutput | None) -> str:
        return self.frames.error(error, out)

    def end(self, last: RequestOutput | None) -> str:
        return self.frames.end(last)


class _RoundsTimer(RequestTimer):
    """The replay's timer: only its heartbeat interval counts; each round's own timer fed the metrics."""

    def on_output(self, out: RequestOutput) -> None:
        pass

    def done(self, out: RequestOutput | None) -> None:
        pass


def stream_loop(gateway: Gateway, toolset: contextlib.AsyncExitStack, messages: list[dict], tools: Toolset,
                ask: Ask, tool_choice: Any, frames: LoopFrames) -> StreamingResponse:
    """The loop streamed through the one stream loop: keep-alives while rounds and calls run, then the calls
    and the answer round's outputs (its usage the sum of every round's). A client that leaves cancels the round
    or the call under way; the toolset (`toolset`, an exit stack holding it) closes when the stream ends."""

    async def outputs() -> AsyncIterator[RequestOutput]:
        try:
            async for step in run_tool_loop(messages, tools, ask, gateway.mcp.config, tool_choice):
                result = step
            frames.answered(result)
            replay = result.reply.raw.outputs
            for out in replay[:-1]:
                yield out
            yield replace(replay[-1], num_prompt_tokens=result.num_prompt_tokens,
                          num_output_tokens=result.num_output_tokens, num_cached_tokens=result.num_cached_tokens)
        finally:
            await toolset.aclose()

    timer = gateway.timer()
    return event_stream(stream(outputs(), frames, _RoundsTimer(timer.metrics, timer.heartbeat_s)))

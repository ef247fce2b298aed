"""Messages with `mcp_servers` naming this server's configured MCP servers: their tools are offered to
the model and run here in the one tool-call loop (mlxhost.mcp.loop) until it answers; the reply is a plain
message with the calls made in the extension field `mcp_calls` (docs/mcp.md). Streamed, pings keep the
client's idle timer alive while rounds and calls run, an `mcp_calls` event (an extension the SDKs pass
through) comes next, then the answer round's events. Imports no MLX."""

from __future__ import annotations

import contextlib
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from mlxhost.frontends.anthropic.protocol import AnyChoice, MessagesRequest, ToolChoice
from mlxhost.frontends.anthropic.render import MessageBuilder, message_usage
from mlxhost.frontends.anthropic.translate import to_chat_request
from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Gateway
from mlxhost.frontends.common.mcp_rounds import (
    LoopFrames,
    Round,
    calls_of,
    gateway_ask,
    labels_as_choices,
    loop_fields,
    opened_toolset,
    stream_loop,
    whole_loop,
)
from mlxhost.frontends.common.sse import client_gone, sse_event


def runs_mcp(gateway: Gateway, body: MessagesRequest) -> bool:
    """A label (string or `name`) of a configured server, or any server when remote URLs are allowed;
    without either, Anthropic's remote servers stay skipped as before."""
    mcp = gateway.mcp
    if not body.mcp_servers:
        return False
    if any(isinstance(s, str) for s in body.mcp_servers):
        return True
    return mcp is not None and (mcp.config.allow_remote or any(s.get("name") in mcp.servers for s in body.mcp_servers))


def _choice(body: MessagesRequest):
    choice = body.tool_choice
    if isinstance(choice, AnyChoice):
        return "required"
    if isinstance(choice, ToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return "none" if getattr(choice, "type", None) == "none" else "auto"


async def messages_with_mcp(gateway: Gateway, body: MessagesRequest, raw: Request):
    # An entry naming a configured server is that server, whatever URL it carries: not the request's own.
    configured = gateway.mcp.servers if gateway.mcp is not None else {}
    entries = [s["name"] if isinstance(s, dict) and s.get("name") in configured else s for s in body.mcp_servers]
    chat = to_chat_request(body.model_copy(update={"mcp_servers": None, "tool_choice": None}))
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    functions = [t.model_dump(exclude_none=True) for t in chat.tools or ()]
    choices = labels_as_choices(entries, "mcp_servers")
    if body.stream:
        stack = contextlib.AsyncExitStack()
        tools = await stack.enter_async_context(opened_toolset(gateway, raw, choices, "mcp_servers"))
        ask = gateway_ask(gateway, raw, loop_fields(chat, set()), functions + tools.functions(), streamed=True)
        return stream_loop(gateway, stack, messages, tools, ask, _choice(body), _frames(body))
    async with opened_toolset(gateway, raw, choices, "mcp_servers") as tools:
        ask = gateway_ask(gateway, raw, loop_fields(chat, set()), functions + tools.functions())
        result = await whole_loop(gateway, raw, messages, tools, ask, _choice(body))
    if result is None:
        return client_gone()
    answer = result.reply.raw
    message = MessageBuilder(body.model, answer.opened, tuple(body.stop_sequences or ())).message(answer.whole)
    message["usage"] = message_usage(result.num_prompt_tokens, result.num_output_tokens, result.num_cached_tokens)
    message["mcp_calls"] = calls_of(result)
    return JSONResponse(message)


class _Waiting:
    """The stream's frames before the answer round is known: message_start (its prompt not counted yet: the
    last message_delta has every round's usage), pings, or the failure."""

    def __init__(self, model: str) -> None:
        self.id, self.model = "msg_" + uuid.uuid4().hex[:24], model

    def start(self) -> str:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": message_usage(0, 0, 0)}
        return sse_event("message_start", {"type": "message_start", "message": message}) + MessageBuilder.ping()

    def waiting(self) -> str:
        return MessageBuilder.ping()

    def output(self, out) -> str:  # never called: outputs come once the answer's frames took over
        return ""

    def error(self, error: APIError, out) -> str:
        return MessageBuilder.error(error, out)

    def end(self, last) -> str:
        return ""


def _frames(body: MessagesRequest) -> LoopFrames:
    waiting = _Waiting(body.model)

    def answer(round: Round) -> MessageBuilder:
        builder = MessageBuilder(body.model, round.opened, tuple(body.stop_sequences or ()))
        builder.id = waiting.id
        return builder

    def announce(calls: list[dict]) -> str:
        return sse_event("mcp_calls", {"type": "mcp_calls", "mcp_calls": calls})

    return LoopFrames(waiting, answer, announce)

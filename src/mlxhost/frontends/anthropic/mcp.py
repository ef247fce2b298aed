"""Messages with `mcp_servers` naming this server's configured MCP servers: their tools are offered to
the model and run here in the one tool-call loop (mlxhost.mcp.loop) until it answers; the reply is a plain
message with the calls made in the extension field `mcp_calls` (docs/mcp.md). Imports no MLX."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from mlxhost.frontends.anthropic.protocol import AnyChoice, MessagesRequest, ToolChoice
from mlxhost.frontends.anthropic.render import MessageBuilder, message_usage
from mlxhost.frontends.anthropic.translate import to_chat_request
from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Gateway
from mlxhost.frontends.common.mcp_rounds import (
    ClientGone,
    gateway_ask,
    labels_as_choices,
    loop_fields,
    opened_toolset,
    unapproved,
)
from mlxhost.frontends.common.sse import client_gone
from mlxhost.mcp.loop import run_tool_loop


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
    if body.stream:
        raise APIError(400, "mcp_servers answers once the tools have run: send stream: false", "stream")
    # An entry naming a configured server is that server, whatever URL it carries: not the request's own.
    configured = gateway.mcp.servers if gateway.mcp is not None else {}
    entries = [s["name"] if isinstance(s, dict) and s.get("name") in configured else s for s in body.mcp_servers]
    chat = to_chat_request(body.model_copy(update={"mcp_servers": None, "tool_choice": None}))
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    functions = [t.model_dump(exclude_none=True) for t in chat.tools or ()]
    async with opened_toolset(gateway, raw, labels_as_choices(entries, "mcp_servers"), "mcp_servers") as tools:
        ask = gateway_ask(gateway, raw, loop_fields(chat, set()), functions + tools.functions())
        try:
            async for event in run_tool_loop(messages, tools, ask, gateway.mcp.config, _choice(body)):
                result = event
        except ClientGone:
            return client_gone()
    whole, opened = result.reply.raw
    message = MessageBuilder(body.model, opened, tuple(body.stop_sequences or ())).message(whole)
    message["usage"] = message_usage(result.num_prompt_tokens, result.num_output_tokens, result.num_cached_tokens)
    message["mcp_calls"] = [c.as_dict() for c in result.calls] + unapproved(result)
    return JSONResponse(message)

"""Chat completions with `mcp_servers`: configured MCP tools offered to the model and run by this server
in the one tool-call loop (mlxhost.mcp.loop) until the model answers; the reply is a plain chat completion
with the calls made in the extension field `mcp_calls` (docs/mcp.md). Imports no MLX."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

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
from mlxhost.frontends.openai.render import CompletionBuilder
from mlxhost.mcp.loop import run_tool_loop
from mlxhost.serving.schemas import ChatCompletionRequest


async def chat_with_mcp(gateway: Gateway, body: ChatCompletionRequest, raw: Request):
    if body.stream:
        raise APIError(400, "mcp_servers answers once the tools have run: send stream: false", "stream")
    if body.n > 1:
        raise APIError(400, "mcp_servers takes n = 1", "n")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    functions = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    choice = body.tool_choice.model_dump(exclude_none=True) if hasattr(body.tool_choice, "model_dump") \
        else body.tool_choice or "auto"
    async with opened_toolset(gateway, raw, labels_as_choices(body.mcp_servers, "mcp_servers"), "mcp_servers") as tools:
        ask = gateway_ask(gateway, raw, loop_fields(body, set()), functions + tools.functions())
        try:
            async for event in run_tool_loop(messages, tools, ask, gateway.mcp.config, choice):
                result = event
        except ClientGone:
            return client_gone()
    whole, opened = result.reply.raw
    builder = CompletionBuilder(opened.prepared.request.request_id, body.model, True, opened.model.tokenizer,
                                opened.prepared.output)
    reply = builder.full(whole.text, result.finish_reason, result.num_prompt_tokens, result.num_output_tokens, None,
                         result.num_cached_tokens)
    reply["mcp_calls"] = [c.as_dict() for c in result.calls] + unapproved(result)
    return JSONResponse(reply)

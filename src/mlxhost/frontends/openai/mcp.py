"""Chat completions with `mcp_servers`: configured MCP tools offered to the model and run by this server
in the one tool-call loop (mlxhost.mcp.loop) until the model answers; the reply is a plain chat completion
with the calls made in the extension field `mcp_calls` (docs/mcp.md). Streamed, empty chunks keep the
client's idle timer alive while rounds and calls run, a chunk carrying `mcp_calls` comes next, then the
answer round's deltas. Imports no MLX."""

from __future__ import annotations

import contextlib
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

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
from mlxhost.frontends.common.sse import client_gone, sse
from mlxhost.frontends.openai.render import CompletionBuilder, CompletionFrames
from mlxhost.serving.schemas import ChatCompletionRequest


async def chat_with_mcp(gateway: Gateway, body: ChatCompletionRequest, raw: Request):
    if body.n > 1:
        raise APIError(400, "mcp_servers takes n = 1", "n")
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    functions = [t.model_dump(exclude_none=True) for t in body.tools or ()]
    choice = body.tool_choice.model_dump(exclude_none=True) if hasattr(body.tool_choice, "model_dump") \
        else body.tool_choice or "auto"
    choices = labels_as_choices(body.mcp_servers, "mcp_servers")
    if body.stream:
        stack = contextlib.AsyncExitStack()
        tools = await stack.enter_async_context(opened_toolset(gateway, raw, choices, "mcp_servers"))
        ask = gateway_ask(gateway, raw, loop_fields(body, set()), functions + tools.functions(), streamed=True)
        return stream_loop(gateway, stack, messages, tools, ask, choice, _frames(body))
    async with opened_toolset(gateway, raw, choices, "mcp_servers") as tools:
        ask = gateway_ask(gateway, raw, loop_fields(body, set()), functions + tools.functions())
        result = await whole_loop(gateway, raw, messages, tools, ask, choice)
    if result is None:
        return client_gone()
    answer = result.reply.raw
    builder = CompletionBuilder(answer.opened.prepared.request.request_id, body.model, True,
                                answer.opened.model.tokenizer, answer.opened.prepared.output)
    reply = builder.full(answer.whole.text, result.finish_reason, result.num_prompt_tokens, result.num_output_tokens,
                         None, result.num_cached_tokens)
    reply["mcp_calls"] = calls_of(result)
    return JSONResponse(reply)


def _frames(body: ChatCompletionRequest) -> LoopFrames:
    # One id for the whole stream: the rounds' requests each have their own.
    waiting = CompletionBuilder(f"chatcmpl-{uuid.uuid4().hex}", body.model, True, None)

    def answer(round: Round) -> CompletionFrames:
        builder = CompletionBuilder(waiting.id, body.model, True, round.opened.model.tokenizer,
                                    round.opened.prepared.output)
        builder.created = waiting.created
        return CompletionFrames([builder], body.include_usage)

    def announce(calls: list[dict]) -> str:
        # A chunk with an empty delta, as a keep-alive is: clients that do not know the field skip it.
        return sse({"id": waiting.id, "object": "chat.completion.chunk", "created": waiting.created,
                    "model": body.model, "choices": [{"index": 0, "delta": {}, "finish_reason": None,
                                                      "logprobs": None}], "mcp_calls": calls})

    return LoopFrames(CompletionFrames([waiting], body.include_usage), answer, announce)

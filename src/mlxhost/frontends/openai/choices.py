"""n > 1: choice 0 runs first; once it has a token, its prompt's blocks are cached and the other choices
are queued, so the prompt is prefilled once. Outputs merge into one response (or one stream whose
chunks carry their choice's index). Imports no MLX."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from mlxhost.engine.request import RequestOutput
from mlxhost.frontends.common.errors import failed_request_body
from mlxhost.frontends.common.gateway import Gateway, Opened
from mlxhost.frontends.common.metrics import RequestTimer
from mlxhost.frontends.common.sse import SSE_DONE, client_gone, event_stream, sse
from mlxhost.frontends.openai.render import CompletionBuilder, completion_usage, echo_text
from mlxhost.serving.schemas import SamplingFields


async def complete_choices(gateway: Gateway, body: SamplingFields, raw: Request, chat: bool, opened: Opened):
    first = aiter(opened.outputs)
    head = await anext(first)
    streams = [_prepend(head, first), *await gateway.open_copies(body, opened.prepared, body.n - 1)]
    rid = opened.prepared.request.request_id
    echo = echo_text(body, opened.model.tokenizer)
    builders = [CompletionBuilder(rid, body.model, chat, opened.model.tokenizer, opened.prepared.output, index=i,
                                  echo=echo, echo_logprobs=head.prompt_logprobs) for i in range(body.n)]
    timer = gateway.timer()
    if body.stream:
        return event_stream(_stream_choices(builders, streams, body.include_usage, timer))
    wholes = await asyncio.gather(*(gateway.collect(s, gateway.timer(), raw) for s in streams))
    if any(w is None for w in wholes):
        return client_gone()
    responses = [b.full(w.text, w.last.finish_reason, w.last.num_prompt_tokens, w.last.num_output_tokens,
                        w.logprobs or None, w.last.num_cached_tokens, w.prompt_logprobs) for b, w in zip(builders, wholes)]
    merged = responses[0]
    merged["choices"] = [r["choices"][0] for r in responses]
    merged["usage"] = _choices_usage([w.last for w in wholes])
    return JSONResponse(merged)


async def _prepend(head: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield head
    if not head.finished:
        async for out in rest:
            yield out


def _choices_usage(lasts: list[RequestOutput]) -> dict:
    # The prompt counts once (it was prefilled once); cached_tokens: the most any choice got for free.
    return completion_usage(lasts[0].num_prompt_tokens, sum(o.num_output_tokens for o in lasts),
                            max(o.num_cached_tokens for o in lasts))


async def _stream_choices(builders: list[CompletionBuilder], streams: list, include_usage: bool, timer: RequestTimer):
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for b in builders:
            yield b.first_chunk()
        lasts: dict[int, RequestOutput] = {}
        num_open = len(streams)
        while num_open:
            try:
                i, out = await asyncio.wait_for(queue.get(), timer.heartbeat_s)
            except asyncio.TimeoutError:  # prefilling: an empty chunk keeps clients' idle timers from firing
                yield builders[0].keep_alive()
                continue
            if out is None:
                num_open -= 1
                continue
            if out.error:
                yield sse(failed_request_body(out.error))
                break
            timer.on_output(out)
            lasts[i] = out
            chunk = builders[i].chunk(out)
            if chunk:
                yield chunk
        timer.done(lasts.get(0))
        if include_usage and len(lasts) == len(streams):
            yield builders[0].usage_chunk_of(_choices_usage([lasts[i] for i in range(len(streams))]))
        yield SSE_DONE
    finally:
        for t in tasks:  # a client that left: the pumps stop and their requests are aborted
            t.cancel()

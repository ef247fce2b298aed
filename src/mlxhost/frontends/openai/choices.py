"""n > 1: choice 0 runs first; once it has a token, its prompt's blocks are cached and the other choices
are queued, so the prompt is prefilled once. Outputs merge into one response, or one stream (the one loop,
heartbeats included while choice 0 waits for its first token) whose chunks carry their choice's index.
Imports no MLX."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from mlxhost.engine.request import RequestOutput
from mlxhost.frontends.common.errors import output_error
from mlxhost.frontends.common.gateway import Gateway, Opened, Whole
from mlxhost.frontends.common.sse import client_gone, event_stream
from mlxhost.frontends.common.stream import stream
from mlxhost.frontends.openai.render import CompletionBuilder, CompletionFrames, choices_usage, echo_text
from mlxhost.serving.schemas import SamplingFields


async def complete_choices(gateway: Gateway, body: SamplingFields, raw: Request, chat: bool, opened: Opened):
    rid = opened.prepared.request.request_id
    echo = echo_text(body, opened.model.tokenizer)
    builders = [CompletionBuilder(rid, body.model, chat, opened.model.tokenizer, opened.prepared.output, index=i,
                                  echo=echo) for i in range(body.n)]
    if body.stream:
        frames = CompletionFrames(builders, body.include_usage)
        return event_stream(stream(_all_choices(gateway, body, opened), frames, gateway.timer()))
    wholes = await gateway.unless_gone(_whole_choices(gateway, body, opened, builders), raw)
    if wholes is None:
        return client_gone()
    responses = [b.full(w.text, w.last.finish_reason, w.last.num_prompt_tokens, w.last.num_output_tokens,
                        w.logprobs or None, w.last.num_cached_tokens, w.prompt_logprobs) for b, w in zip(builders, wholes)]
    merged = responses[0]
    merged["choices"] = [r["choices"][0] for r in responses]
    merged["usage"] = choices_usage([w.last for w in wholes])
    return JSONResponse(merged)


async def _whole_choices(gateway: Gateway, body: SamplingFields, opened: Opened,
                         builders: list[CompletionBuilder]) -> list[Whole]:
    first = aiter(opened.outputs)
    head = await anext(first)
    if head.error:
        raise output_error(head)
    streams = [_prepend(head, first), *await gateway.open_copies(body, opened.prepared, body.n - 1)]
    for b in builders[1:]:
        b.echo_logprobs = head.prompt_logprobs
    timers = [gateway.timer() for _ in streams]
    tasks = [asyncio.ensure_future(gateway.join(s, timer)) for s, timer in zip(streams, timers)]
    try:
        wholes = await asyncio.gather(*tasks)
    finally:  # one choice failed (or the client left): the others stop too, their requests aborted
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for whole, timer in zip(wholes, timers):
        timer.done(whole.last)
    return wholes


async def _prepend(head: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield head
    async for out in _after(head, rest):
        yield out


async def _after(head: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    if not head.finished:
        async for out in rest:
            yield out


async def _all_choices(gateway: Gateway, body: SamplingFields, opened: Opened) -> AsyncIterator[RequestOutput]:
    """Choice 0's first output, then every choice's outputs as they come (the others queued only then)."""
    first = aiter(opened.outputs)
    head = await anext(first, None)
    if head is None:
        return
    yield head
    if head.error:
        return
    streams = [_after(head, first), *await gateway.open_copies(body, opened.prepared, body.n - 1)]
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(s) -> None:
        try:
            async for out in s:
                await queue.put(out)
        except Exception as exc:  # noqa: BLE001 - raised where the stream reads it
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        num_open = len(streams)
        while num_open:
            out = await queue.get()
            if out is None:
                num_open -= 1
            elif isinstance(out, Exception):
                raise out
            else:
                yield out
    finally:
        for t in tasks:  # a client that left: the pumps stop and their requests are aborted
            t.cancel()

"""The one way into an engine for every API dialect: lease → prepare → admission → generate.

Each front door (OpenAI chat/completions in app.py, Anthropic Messages in anthropic.py, Responses in
responses_api.py) translates its body into an OpenAI `ChatCompletionRequest`/`CompletionRequest`, opens
it here, and shapes the engine's `RequestOutput`s into its own events. Imports no MLX.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from pydantic import ValidationError

from mlxserve.api.errors import APIError
from mlxserve.api.metrics import Metrics
from mlxserve.api.prompt_bound import PrepPool
from mlxserve.api.schemas import ChatCompletionRequest, SamplingFields
from mlxserve.api.serving import Prepared, ServedModel, prepare
from mlxserve.engine.request import RequestOutput
from mlxserve.engine.scheduler import QueueFullError
from mlxserve.structured.grammar import GrammarFailure

RETRY_AFTER_S = "1"
# A stream with nothing to send for this long (a long prompt prefilling, a queue) sends its dialect's
# heartbeat frame: agents give up on a silent stream (Claude Code after 300 s of a 54k-token prefill).
HEARTBEAT_S = 5.0


class RequestTimer:
    """TTFT and inter-token latency of one request, fed into the Prometheus histograms; and how often
    its stream sends a heartbeat while nothing else comes (`heartbeats`)."""

    def __init__(self, metrics: Metrics, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.metrics = metrics
        self.heartbeat_s = heartbeat_s
        self.start = time.perf_counter()
        self.last: float | None = None

    def on_output(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def done(self, out: RequestOutput | None) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)
        if out is not None:
            self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
            self.metrics.completion_tokens.inc(out.num_output_tokens)


async def heartbeats(outputs: AsyncIterator[RequestOutput], every_s: float) -> AsyncIterator[RequestOutput | None]:
    """`outputs`, with a None between them whenever `every_s` seconds pass without one: the caller sends its
    dialect's heartbeat frame then. Leaving early (a client gone mid-prefill cancels the response) stops
    the wait for the next output, which aborts the request as leaving `outputs` itself does."""
    it = aiter(outputs)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                out = task.result()
            except StopAsyncIteration:
                return
            yield out
    finally:
        if pending is not None:
            pending.cancel()  # the stream's own cleanup (the abort) runs as the cancellation lands
        elif hasattr(it, "aclose"):
            with contextlib.suppress(Exception):
                await it.aclose()


@dataclass
class Opened:
    model: ServedModel
    prepared: Prepared
    outputs: AsyncIterator[RequestOutput] | None  # None when only prepared (token counting)


@dataclass
class Whole:
    """A non-streamed request's outputs, joined."""

    text: str
    token_ids: list[int]
    logprobs: list[Any]
    last: RequestOutput


def chat_request(fields: dict) -> ChatCompletionRequest:
    """A dialect's body translated into OpenAI chat fields, checked by the OpenAI schema: whatever it
    still rejects is the client's 400 (the dialects' own schemas catch most of it first)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ()) if "[" not in str(p)) or None
        message = err.get("msg", "invalid request")
        raise APIError(400, f"{param}: {message}" if param else message, param) from None


class EngineDoor:
    def __init__(self, models: Any, metrics: Metrics, prep: PrepPool | None = None,
                 heartbeat_s: float | None = None) -> None:
        self.models, self.metrics = models, metrics
        self.heartbeat_s = heartbeat_s  # None: HEARTBEAT_S
        # Tokenizing, chat templates and media run here, off the event loop: one request's 5 MB prompt
        # must not stall /health and every running stream while it is processed.
        self.prep = prep or PrepPool()

    def timer(self) -> RequestTimer:
        return RequestTimer(self.metrics, self.heartbeat_s if self.heartbeat_s is not None else HEARTBEAT_S)

    async def open(self, body: SamplingFields, generate: bool = True) -> Opened:
        """Prepares `body` for its model and, with `generate`, queues it on that model's engine.
        The lease loads the model on first use and keeps it loaded until generate() has queued the
        request; from then on the request's stream keeps it busy (never unloaded) until it ends."""
        async with self.models.lease(body.model) as (model, engine):
            if model.embedding_only:
                raise APIError(400, f"`{model.name}` is an embedding model: it serves /v1/embeddings only", "model")
            if model.audio is not None:
                raise APIError(400, f"`{model.name}` is an audio model: it serves /v1/audio/* only", "model")
            prepared = await self.prep.run(prepare, model, body)
            if not generate:
                return Opened(model, prepared, None)
            request = prepared.request
            need, cap = request.num_prompt_tokens + request.sampling.max_tokens, engine.kv_capacity_tokens
            if cap is not None and need > cap:
                raise APIError(429, f"this request needs KV for {request.num_prompt_tokens} prompt + "
                               f"{request.sampling.max_tokens} completion tokens = {need}; the memory budget holds "
                               f"{cap} tokens: lower max_tokens or the prompt", "max_tokens", "kv_budget_exceeded",
                               headers={"Retry-After": RETRY_AFTER_S})
            try:
                outputs = engine.generate(request)
            except QueueFullError as exc:
                # Too many requests for the slots and the memory budget right now: come back shortly.
                raise APIError(429, str(exc), code="server_busy", headers={"Retry-After": RETRY_AFTER_S}) from exc
        return Opened(model, prepared, outputs)

    async def open_copies(self, body: SamplingFields, prepared: Prepared, count: int) -> list[AsyncIterator[RequestOutput]]:
        """Queues choices 1..count of an n > 1 request. Called once choice 0 produced its first token:
        its prompt's blocks are in the prefix cache by then, so the copies prefill only what is left."""
        async with self.models.lease(body.model) as (_, engine):
            try:
                return [engine.generate(prepared.copy(i)) for i in range(1, count + 1)]
            except QueueFullError as exc:  # copies already queued abort when their streams are dropped
                raise APIError(429, str(exc), code="server_busy", headers={"Retry-After": RETRY_AFTER_S}) from exc

    async def collect(self, outputs: AsyncIterator[RequestOutput], timer: RequestTimer, raw: Request) -> Whole | None:
        """All of a request's outputs; None if the client left first (its slot is freed at once)."""

        async def gather() -> Whole:
            parts, ids, lps, last = [], [], [], None
            async for out in outputs:
                if out.error:
                    if out.finish_reason:  # ended by the server (shutdown, a lost rank): a 503, as when streamed
                        raise APIError(503, out.error, code="server_shutting_down")
                    if isinstance(out.error, GrammarFailure):  # the request's own tools or format: no retry helps
                        raise APIError(400, out.error, code="grammar_failed")
                    raise RuntimeError(out.error)
                timer.on_output(out)
                parts.append(out.text)
                ids.extend(out.new_token_ids)
                if out.logprobs:
                    lps.extend(out.logprobs)
                last = out
            return Whole("".join(parts), ids, lps, last)

        # Nothing is streamed, so watch the connection ourselves: a client that gives up must not keep
        # its slot busy until max_tokens.
        task = asyncio.ensure_future(gather())
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                break
            if await raw.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
        whole = task.result()
        timer.done(whole.last)
        return whole

"""The one way into an engine for every API dialect: lease → prepare → admission → generate, and back.

Each dialect (openai/, anthropic/, responses/, ollama/, rerank/) translates its body into the one internal
request, an OpenAI `ChatCompletionRequest`/`CompletionRequest` (serving/schemas.py), opens it here, and
ends its handler with `Gateway.reply`: its own frames streamed, or the whole reply rendered once collected.
Embedding work goes through here too (`Gateway.embed`). Imports no MLX.
"""

from __future__ import annotations

import asyncio
import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from mlxhost.engine.request import RequestOutput
from mlxhost.engine.scheduler import QueueFullError
from mlxhost.frontends.common.errors import APIError, output_error
from mlxhost.frontends.common.keys import current_grant
from mlxhost.frontends.common.metrics import Metrics, RequestTimer
from mlxhost.frontends.common.prefixes import PrefixCaptures, client_agent
from mlxhost.frontends.common.sse import EVENT_STREAM, client_gone, event_stream
from mlxhost.frontends.common.stream import Frames, stream as stream_frames
from mlxhost.serving.embedding import embed_token_lists
from mlxhost.serving.model import ServedModel
from mlxhost.serving.prepare import Prepared, prepare
from mlxhost.serving.prompt_bound import PrepPool
from mlxhost.serving.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

T = TypeVar("T")
RETRY_AFTER_S = "1"
# A stream with nothing to send for this long (a long prompt prefilling, a queue) sends its dialect's
# heartbeat frame: agents give up on a silent stream (Claude Code after 300 s of a 54k-token prefill).
HEARTBEAT_S = 5.0
# The scheduling class (engine Request.priority; lower runs first) of requests opened in this context; None: the
# request's own. The Batch API's runner sets it around each line, which then translates exactly as a live request.
priority_class: ContextVar[int | None] = ContextVar("priority_class", default=None)


@dataclass
class Opened:
    model: ServedModel
    prepared: Prepared
    outputs: AsyncIterator[RequestOutput] | None  # None when only prepared (token counting)
    # The request's prefill progress as the engine last published it (engine/status.py request_progress);
    # None before it did. What a stream's heartbeat may tell.
    progress: Callable[[], dict | None] = lambda: None


@dataclass
class Whole:
    """A non-streamed request's outputs, joined."""

    text: str
    token_ids: list[int]
    logprobs: list[Any]
    last: RequestOutput
    prompt_logprobs: list[Any] | None = None  # an echoed prompt's (SamplingParams.prompt_logprobs)


def chat_request(fields: dict) -> ChatCompletionRequest:
    """A dialect's body translated into OpenAI chat fields, checked by the OpenAI schema: whatever it
    still rejects is the client's 400 (the dialects' own schemas catch most of it first)."""
    return _internal(ChatCompletionRequest, fields)


def completion_request(fields: dict) -> CompletionRequest:
    """As `chat_request`, for a prompt without a chat template (a text completion)."""
    return _internal(CompletionRequest, fields)


def _internal(kind: type, fields: dict):
    try:
        return kind.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ()) if "[" not in str(p)) or None
        message = err.get("msg", "invalid request")
        raise APIError(400, f"{param}: {message}" if param else message, param) from None


class Held:
    """A served model held loaded (`Gateway.hold`): its descriptor, and its engine reached only through
    `run_job` (one step of a job on the engine thread) and `embed`."""

    def __init__(self, gateway: "Gateway", model: ServedModel, engine: Any) -> None:
        self.model, self._gateway, self._engine = model, gateway, engine

    async def run_job(self, step: Callable[[Any], Any]) -> Any:
        """`step(core)` on the engine thread, between its decode steps."""
        return await self._engine.call(step)

    async def prepare(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` (tokenizing, templates) off the event loop, in the gateway's preparation pool."""
        return await self._gateway.prep.run(fn, *args)

    async def embed(self, token_lists: list[list[int]], dimensions: int | None = None, is_gone: Callable | None = None,
                    max_batch_tokens: int | None = None):
        """Unit-norm vectors (numpy, [N, D]) of `token_lists`; None when `is_gone()` says the client left
        between chunks."""
        return await embed_token_lists(self.model, self._engine, token_lists, dimensions, is_gone, max_batch_tokens)


class Gateway:
    """The dialects' one client of the served models' engines (vLLM's EngineClient in spirit): requests
    opened, outputs collected or streamed, embeddings computed; the models leased through `models`."""

    def __init__(self, models: Any, metrics: Metrics, prep: PrepPool | None = None,
                 heartbeat_s: float | None = None, mcp: Any = None) -> None:
        self.models, self.metrics = models, metrics
        self.mcp = mcp  # the MCP servers' manager (mlxhost.mcp.client.McpManager); None without --mcp-config
        # Builds each request's trace spans from its outputs (tracing.py); None: tracing off, nothing is wrapped.
        self.tracer: Any = None
        self.heartbeat_s = heartbeat_s  # None: HEARTBEAT_S
        # Tokenizing, chat templates and media run here, off the event loop: one request's 5 MB prompt
        # must not stall /health and every running stream while it is processed.
        self.prep = prep or PrepPool()
        self.prefixes = PrefixCaptures()  # agents' fixed prompt prefixes, for `mlxhost launch` to pre-warm

    def timer(self) -> RequestTimer:
        return RequestTimer(self.metrics, self.heartbeat_s if self.heartbeat_s is not None else HEARTBEAT_S)

    async def open(self, body: SamplingFields, generate: bool = True, prefill_only: bool = False) -> Opened:
        """Prepares `body` for its model and, with `generate`, queues it on that model's engine; with
        `prefill_only` the engine computes and caches its prompt and generates nothing (POST /v1/cache/prefill).
        The lease loads the model on first use and keeps it loaded until generate() has queued the
        request; from then on the request's stream keeps it busy (never unloaded) until it ends."""
        return await self._open(body.model, body, None, generate, prefill_only)

    async def open_built(self, name: str, build: Callable[[ServedModel], SamplingFields]) -> Opened:
        """As `open`, for a body written for the served model (Ollama's generate needs its tokenizer):
        `build(model)` runs off the event loop under the same lease, and may refuse the model."""
        return await self._open(name, None, build, True, False)

    async def _open(self, name: str, body: SamplingFields | None, build: Callable[[ServedModel], SamplingFields] | None,
                    generate: bool, prefill_only: bool) -> Opened:
        grant = current_grant.get()  # the API key's policy (keys.py), checked before a model is loaded for it
        if grant is not None:
            grant.check_model(name, self.models.resolve)
        async with self.models.lease(name) as (model, engine):
            if build is not None:
                body = await self.prep.run(build, model)
            if model.embedding_only:
                raise APIError(400, f"`{model.name}` is an embedding model: it serves /v1/embeddings only", "model")
            if model.audio is not None:
                raise APIError(400, f"`{model.name}` is an audio model: it serves /v1/audio/* only", "model")
            prepared = await self.prep.run(prepare, model, body)
            if not generate:
                return Opened(model, prepared, None)
            request = prepared.request
            if prefill_only:  # max_tokens 0: the engine ends it once its prompt is prefilled and stored
                request.sampling = replace(request.sampling, max_tokens=0, constraint=None, prompt_logprobs=None)
            elif isinstance(body, ChatCompletionRequest):
                self.prefixes.note(client_agent.get(), model.name, body, grant.cache_group if grant else "")
            if grant is not None:
                request.priority, request.cache_group = grant.request_priority(body.priority), grant.cache_group
                if grant.shared is not None:  # a shared system prompt's blocks hash without the group
                    request.num_shared_prefix_tokens = await self.prep.run(
                        grant.shared.num_shared_tokens, model.name, model.tokenizer, request.prompt_token_ids)
            if (priority := priority_class.get()) is not None:  # batch work: its class, never better than its key's
                request.priority = max(priority, grant.request_priority(None)) if grant is not None else priority
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
            if grant is not None:
                outputs = grant.count_tokens(outputs, self.metrics)
            if self.tracer is not None:
                outputs = self.tracer.watch(model, prepared, outputs)
        rid = request.request_id
        return Opened(model, prepared, outputs, lambda: engine.request_progress(rid))

    async def open_copies(self, body: SamplingFields, prepared: Prepared, count: int) -> list[AsyncIterator[RequestOutput]]:
        """Queues choices 1..count of an n > 1 request. Called once choice 0 produced its first token:
        its prompt's blocks are in the prefix cache by then, so the copies prefill only what is left."""
        async with self.models.lease(body.model) as (_, engine):
            try:
                copies = [prepared.copy(i) for i in range(1, count + 1)]
                for copy in copies:
                    copy.priority = prepared.request.priority
                streams = [engine.generate(copy) for copy in copies]
                grant = current_grant.get()
                return streams if grant is None else [grant.count_tokens(s, self.metrics) for s in streams]
            except QueueFullError as exc:  # copies already queued abort when their streams are dropped
                raise APIError(429, str(exc), code="server_busy", headers={"Retry-After": RETRY_AFTER_S}) from exc

    async def collect(self, outputs: AsyncIterator[RequestOutput], timer: RequestTimer, raw: Request) -> Whole | None:
        """All of a request's outputs; None if the client left first (its slot is freed at once)."""
        whole = await self.unless_gone(self.join(outputs, timer), raw)
        if whole is not None:
            timer.done(whole.last)
        return whole

    @staticmethod
    async def join(outputs: AsyncIterator[RequestOutput], timer: RequestTimer) -> Whole:
        """A request's outputs joined; an output's error raised as a stream's error frame is typed
        (errors.output_error)."""
        parts, ids, lps, last, prompt_lps = [], [], [], None, None
        async for out in outputs:
            if out.error:
                raise output_error(out)
            timer.on_output(out)
            parts.append(out.text)
            ids.extend(out.new_token_ids)
            if out.logprobs:
                lps.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                prompt_lps = out.prompt_logprobs
            last = out
        return Whole("".join(parts), ids, lps, last, prompt_lps)

    @staticmethod
    async def unless_gone(work: Awaitable[T], raw: Request) -> T | None:
        """`work`'s result; None if the client left first (`work` is cancelled, which aborts its requests).
        Nothing is streamed, so the connection is watched here: a client that gives up must not keep its
        slot busy until max_tokens."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None

    @contextlib.asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[Held]:
        """Model `name` held loaded while the block runs, for work that is not a generated request (embeddings,
        scoring, audio jobs): the API key's model list is checked first, as for `open`."""
        grant = current_grant.get()
        if grant is not None:
            grant.check_model(name, self.models.resolve)
        async with self.models.lease(name) as (model, engine):
            yield Held(self, model, engine)

    async def count(self, body: SamplingFields) -> Prepared:
        """`body` prepared for its model (template, tools, media) and never generated from: its prompt's tokens."""
        return (await self.open(body, generate=False)).prepared

    async def reply(self, outputs: AsyncIterator[RequestOutput], raw: Request, stream: bool, frames: Frames,
                    render: Callable[[Whole], dict], media_type: str = EVENT_STREAM) -> Response:
        """The end of every dialect's handler: the outputs streamed through the one loop (`stream.stream`) as the
        dialect's `frames`, or collected and `render(whole)` answered as JSON; a client that left before the end
        of a whole reply gets its 499."""
        timer = self.timer()
        # Traced (tracing.py): the request opened last in this handler; its reply's parsing is a span.
        trace = self.tracer.current() if self.tracer is not None else None
        if trace is not None:
            trace.hold()
        if stream:
            body = stream_frames(outputs, frames, timer)
            return event_stream(trace.frames(body) if trace is not None else body, media_type)
        whole = await self.collect(outputs, timer, raw)
        if whole is None:
            return client_gone()
        if trace is None:
            return JSONResponse(render(whole))
        with trace.parsing():
            rendered = render(whole)
        return JSONResponse(rendered)

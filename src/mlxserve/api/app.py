"""The FastAPI app: OpenAI routes over the served models' async engines. Imports no MLX."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mlxserve.api.anthropic import add_anthropic_routes
from mlxserve.api.audio import add_audio_routes
from mlxserve.api.door import RETRY_AFTER_S as _RETRY_AFTER_S
from mlxserve.api.door import EngineDoor, RequestTimer, heartbeats
from mlxserve.api.embeddings import add_embeddings_route
from mlxserve.api.errors import APIError, error_body, error_response, failed_request_body, install_error_handlers
from mlxserve.api.metrics import Metrics
from mlxserve.api.lora import LoadModelBody, add_lora_errors
from mlxserve.api.ollama import add_ollama_routes
from mlxserve.api.rerank import add_rerank_routes
from mlxserve.api.docs import install_docs
from mlxserve.api.openapi import install_openapi
from mlxserve.api.prompt_bound import PrepPool
from mlxserve.api.responses import SSE_DONE, ResponseBuilder, sse, usage
from mlxserve.api.responses_api import add_responses_routes
from mlxserve.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from mlxserve.engine.loop import EngineStats
from mlxserve.engine.request import RequestOutput
from mlxserve.models.extras import MissingExtraError
from mlxserve.server.manager import ModelManager, ModelUnavailableError, UnknownModelError

log = logging.getLogger(__name__)


class _CountRequests:
    """Counts /v1/ requests by status. A plain ASGI middleware on purpose: Starlette's
    `@app.middleware("http")` wraps `receive` so that `Request.is_disconnected()` never sees the client
    leave (a timed-out non-streaming request kept its slot to the end), and it skipped unhandled 500s."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        status = 500  # unless a response starts: an exception escaped to the server error handler

        async def send_with_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            # The route's template (/v1/responses/{response_id}), not the path: one label per route, not per
            # id; paths no route matched share one label, or each 404 probe would add a series for good.
            path = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(path, str(status)).inc()


class _HeadAsGet:
    """HEAD is answered as GET on every GET route (the server sends the headers, not the body), and
    `HEAD /` is a 200 even with the web page off: Claude Code sends it before every run."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            if scope["path"] == "/":
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
            scope = {**scope, "method": "GET"}
        await self.app(scope, receive, send)


def create_app(models: ModelManager) -> FastAPI:
    """The routes over `models`: requests go to the model their `model` field names."""
    metrics = Metrics(lambda: _sum_stats(models.loaded_engines()))
    prep = PrepPool()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        models.start(asyncio.get_running_loop())
        # Everything loaded so far (model code, tokenizer, FastAPI) lives as long as the server: move it
        # out of the collector's sight, or each full collection walks it all and stalls the streams.
        gc.collect()
        gc.freeze()
        on_ready = getattr(app.state, "on_ready", None)  # the start-up banner (cli.py, banner.py)
        if on_ready is not None:
            await on_ready()
        try:
            yield
        finally:
            prep.close()
            models.close()

    # /docs serves Swagger UI's files itself (api/docs.py): FastAPI's default page loads them from a CDN.
    app = FastAPI(title="mlxserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_docs(app)
    install_error_handlers(app)
    install_openapi(app)
    # What a graceful shutdown (process.py) needs, without importing the server: end the streams still
    # running at the deadline, and stop the engines (flushing the SSD tier) when the lifespan is skipped.
    app.state.end_streams = lambda reason: sum(e.end_all(reason) for e in models.loaded_engines())
    app.state.close_models = models.close

    @app.exception_handler(UnknownModelError)
    async def _unknown_model(_: Request, exc: UnknownModelError):
        return error_response(APIError(404, str(exc), "model", "model_not_found"))

    add_lora_errors(app)

    @app.exception_handler(ModelUnavailableError)
    async def _unavailable(_: Request, exc: ModelUnavailableError):
        if isinstance(exc.__cause__, MissingExtraError):  # not a passing state: retrying will not help
            return error_response(APIError(400, str(exc.__cause__), "model", "model_not_supported"))
        return error_response(APIError(503, str(exc), "model", "model_unavailable",
                                       headers={"Retry-After": _RETRY_AFTER_S}))

    app.add_middleware(_CountRequests, metrics=metrics)
    app.add_middleware(_HeadAsGet)
    add_embeddings_route(app, models)
    add_audio_routes(app, models)  # speech to text, text to speech (api/audio/)
    # Other dialects translate into the same requests and go through the same door.
    door = EngineDoor(models, metrics, prep)
    add_anthropic_routes(app, door)
    add_responses_routes(app, door)
    add_ollama_routes(app, door)
    add_rerank_routes(app, door)

    async def per_model(requested: str | None, fn) -> dict[str, object]:
        """`fn(core)` on each named (or every) model's engine; None for a model not loaded."""
        out = {}
        for name in [models.resolve(requested)] if requested is not None else models.names:
            with models.hold(name) as engine:  # keeps it loaded until the call returns
                out[name] = await engine.call(fn) if engine is not None else None
        return out

    def one_or_all(requested: str | None, results: dict) -> dict:
        # One model (named, or the only one): its own answer, as a single-model server gives it.
        if requested is not None or len(results) == 1:
            (name, result), = results.items()
            return result if result is not None else not_loaded(name)
        return {"models": {name: r if r is not None else not_loaded(name) for name, r in results.items()}}

    def not_loaded(name: str) -> dict:
        return {"model": name, "status": models.state(name).value}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/status")
    async def status(model: str | None = None):
        return one_or_all(model, await per_model(model, lambda core: core.status()))

    @app.get("/v1/cache/stats")
    async def cache_stats(model: str | None = None):
        return one_or_all(model, await per_model(model, lambda core: core.cache_stats()))

    @app.delete("/v1/cache")
    async def clear_cache(model: str | None = None):
        cleared = {name: n or 0 for name, n in (await per_model(model, lambda core: core.clear_cache())).items()}
        if model is not None or len(cleared) == 1:
            return {"cleared_blocks": sum(cleared.values())}
        return {"cleared_blocks": sum(cleared.values()), "models": cleared}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": models.cards()}

    def card(name: str) -> dict:
        return models.card(name)  # a model's or a LoRA adapter's entry; unknown: UnknownModelError -> 404

    @app.post("/v1/models/{name:path}/load")
    async def load_model(name: str, body: LoadModelBody | None = None):
        # With lora_path: NAME is a LoRA adapter at that path, served on `base` (lora/registry.py).
        await models.load(name, *((body.lora_path, body.base) if body is not None else ()))
        return card(name)

    @app.post("/v1/models/{name:path}/unload")
    async def unload_model(name: str):
        if not await models.unload(name):
            raise APIError(409, f"model `{name}` is serving requests; unload it when they end", "model", "model_busy")
        return card(name)

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        # The openai client's models.retrieve; ids may hold a slash (hub ids), hence :path.
        return card(model_id)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        return await _complete(body, raw, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await _complete(body, raw, chat=False)

    async def _complete(body: SamplingFields, raw: Request, chat: bool):
        opened = await door.open(body)
        if body.n > 1:
            return await _complete_choices(body, raw, chat, opened)
        builder = ResponseBuilder(opened.prepared.request.request_id, body.model, chat, opened.model.tokenizer,
                                  opened.prepared.output)
        timer = door.timer()
        if body.stream:
            return StreamingResponse(
                _stream(builder, opened.outputs, body.include_usage, timer), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        whole = await door.collect(opened.outputs, timer, raw)
        if whole is None:
            return Response(status_code=499)
        last = whole.last
        return JSONResponse(builder.full(whole.text, last.finish_reason, last.num_prompt_tokens, last.num_output_tokens,
                                         whole.logprobs or None, last.num_cached_tokens))

    async def _complete_choices(body: SamplingFields, raw: Request, chat: bool, opened):
        """n > 1: choice 0 runs first; once it has a token, its prompt's blocks are cached and the other
        choices are queued, so the prompt is prefilled once. Outputs merge into one response."""
        first = aiter(opened.outputs)
        head = await anext(first)
        streams = [_prepend(head, first), *await door.open_copies(body, opened.prepared, body.n - 1)]
        rid = opened.prepared.request.request_id
        builders = [ResponseBuilder(rid, body.model, chat, opened.model.tokenizer, opened.prepared.output, index=i)
                    for i in range(body.n)]
        timer = door.timer()
        if body.stream:
            return StreamingResponse(_stream_choices(builders, streams, body.include_usage, timer),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        wholes = await asyncio.gather(*(door.collect(s, door.timer(), raw) for s in streams))
        if any(w is None for w in wholes):
            return Response(status_code=499)
        responses = [b.full(w.text, w.last.finish_reason, w.last.num_prompt_tokens, w.last.num_output_tokens,
                            w.logprobs or None, w.last.num_cached_tokens) for b, w in zip(builders, wholes)]
        merged = responses[0]
        merged["choices"] = [r["choices"][0] for r in responses]
        merged["usage"] = _choices_usage([w.last for w in wholes])
        return JSONResponse(merged)

    return app


async def _prepend(head: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield head
    if not head.finished:
        async for out in rest:
            yield out


def _choices_usage(lasts: list[RequestOutput]) -> dict:
    # The prompt counts once (it was prefilled once); cached_tokens: the most any choice got for free.
    return usage(lasts[0].num_prompt_tokens, sum(o.num_output_tokens for o in lasts),
                 max(o.num_cached_tokens for o in lasts))


async def _stream_choices(builders: list[ResponseBuilder], streams: list, include_usage: bool, timer: RequestTimer):
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
            first = b.first_chunk()
            if first:
                yield first
        lasts: dict[int, RequestOutput] = {}
        num_open = len(streams)
        while num_open:
            i, out = await queue.get()
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


def _sum_stats(engines) -> EngineStats:
    """The engines' counters added up: /metrics shows the server, whichever models are loaded."""
    stats = [e.stats for e in engines]
    totals = {f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(EngineStats)}
    # Bytes per token and the speculation threshold are settings of a model, not amounts: the largest.
    totals["kv_bytes_per_token"] = max((s.kv_bytes_per_token for s in stats), default=0)
    totals["spec_max_batch"] = max((s.spec_max_batch for s in stats), default=0)
    return EngineStats(**totals)


async def _stream(builder: ResponseBuilder, outputs: AsyncIterator[RequestOutput], include_usage: bool,
                  timer: RequestTimer):
    first = builder.first_chunk()
    if first:
        yield first
    last = None
    async for out in heartbeats(outputs, timer.heartbeat_s):
        if out is None:  # prefilling: an SSE comment, which clients skip, keeps idle timers from firing
            yield ": ping\n\n"
            continue
        if out.error:
            if out.finish_reason:  # ended by the server (shutdown): the choice's end, then why
                chunk = builder.chunk(out)
                if chunk:
                    yield chunk
            yield sse(error_body(503, out.error, code="server_shutting_down") if out.finish_reason
                      else failed_request_body(out.error))
            break
        timer.on_output(out)
        last = out
        chunk = builder.chunk(out)
        if chunk:
            yield chunk
    timer.done(last)
    if include_usage and last is not None:
        yield builder.usage_chunk(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
    yield SSE_DONE

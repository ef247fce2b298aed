"""The FastAPI app: every dialect's routes over the served models' engines, each reaching them through the
one `Gateway` (common/gateway.py). Imports no MLX."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI

from mlxhost.frontends.admin.docs import install_docs
from mlxhost.frontends.admin.models import add_load_routes, add_model_errors
from mlxhost.frontends.admin.openapi import install_openapi
from mlxhost.frontends.admin.prefill import add_prefill_routes
from mlxhost.frontends.admin.routes import add_admin_routes
from mlxhost.frontends.anthropic.routes import add_anthropic_routes
from mlxhost.frontends.anthropic.translate import prefill_request as messages_prefill
from mlxhost.frontends.audio import add_audio_routes
from mlxhost.frontends.common.errors import install_error_handlers
from mlxhost.frontends.common.gateway import Gateway, chat_request, completion_request
from mlxhost.frontends.common.metrics import CountRequests, Metrics
from mlxhost.frontends.common.prefixes import ClientAgent
from mlxhost.frontends.embeddings.routes import add_embeddings_route
from mlxhost.frontends.mcp.routes import add_mcp_routes
from mlxhost.frontends.ollama import add_ollama_routes
from mlxhost.frontends.openai.routes import add_model_list_route, add_openai_routes
from mlxhost.frontends.rerank import add_rerank_routes
from mlxhost.frontends.responses.routes import add_responses_routes
from mlxhost.frontends.responses.translate import prefill_request as responses_prefill
from mlxhost.serving.prompt_bound import PrepPool

if TYPE_CHECKING:  # a type only: frontends/ sits below server/
    from mlxhost.server.manager import ModelManager

log = logging.getLogger(__name__)


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


def create_app(models: ModelManager, mcp=None) -> FastAPI:
    """The routes over `models`: requests go to the model their `model` field names. `mcp`: the MCP
    servers' manager (mlxhost.mcp.client.McpManager), started and stopped with the app; None: no MCP."""
    metrics = Metrics(models.loaded_engines)
    prep = PrepPool()
    # What the lifespan closes before the engines (the MCP sessions, the Batch API adds its runner first). Each
    # is popped before it runs, so it closes once: after a second signal the server closes them (server/process.py).
    closers: list[Callable[[], Awaitable[None]]] = [mcp.close] if mcp is not None else []

    async def close_services() -> None:
        while closers:
            close = closers.pop(0)
            try:
                # Bounded by the shutdown deadline as it stands while the close runs: a second signal brings it
                # forward, and a close the lifespan started (uvicorn does not interrupt it) is given up then.
                if not await _by_deadline(close(), lambda: getattr(app.state, "stop_deadline", None)):
                    log.warning("a service (MCP sessions, Batch API) was still closing at the shutdown deadline: "
                                "given up")
            except Exception:  # one service's failure must not keep the others (or the engines) from closing
                log.exception("closing a service at shutdown failed")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        models.start(asyncio.get_running_loop())
        # Everything loaded so far (model code, tokenizer, FastAPI) lives as long as the server: move it
        # out of the collector's sight, or each full collection walks it all and stalls the streams.
        gc.collect()
        gc.freeze()
        if mcp is not None:
            await mcp.start()
        on_ready = getattr(app.state, "on_ready", None)  # the start-up banner (server/cli.py, server/banner.py)
        if on_ready is not None:
            await on_ready()
        try:
            yield
        finally:
            try:
                await close_services()
            finally:  # the engines stop (flushing the SSD tier) whatever the services did
                prep.close()
                models.close(lambda: app.state.stop_deadline)

    # /docs serves Swagger UI's files itself (admin/docs.py): FastAPI's default page loads them from a CDN.
    app = FastAPI(title="mlxhost", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_docs(app)
    install_error_handlers(app)
    install_openapi(app)
    # What a graceful shutdown (server/process.py) needs, without importing the server: end the streams
    # still running at the deadline (their request ids), close the services and stop the engines (flushing the
    # SSD tier) when the lifespan is skipped, and the deadline (time.monotonic()) past which a step still running
    # is not waited for.
    app.state.end_streams = lambda reason: [rid for e in models.loaded_engines() for rid in e.end_all(reason)]
    app.state.close_models = models.close
    app.state.closers, app.state.close_services = closers, close_services
    app.state.stop_deadline = None
    add_model_errors(app)

    app.state.metrics = metrics  # the key gate counts by key name (common/security.py)
    app.add_middleware(CountRequests, metrics=metrics)
    app.add_middleware(_HeadAsGet)
    app.add_middleware(ClientAgent)  # the gateway notes agents' prompt prefixes by User-Agent (common/prefixes.py)
    # Every dialect translates into the same requests and goes through the same gateway.
    gateway = Gateway(models, metrics, prep, mcp=mcp)
    app.state.gateway = gateway  # for what the server adds on top (tracing)
    add_embeddings_route(app, gateway)
    add_audio_routes(app, gateway)  # speech to text, text to speech (frontends/audio/)
    add_anthropic_routes(app, gateway)
    add_responses_routes(app, gateway)
    add_ollama_routes(app, gateway)
    add_rerank_routes(app, gateway)
    add_mcp_routes(app, gateway)
    add_admin_routes(app, models, metrics)
    # Each dialect's own translation: a prefill is the prompt its route would run (admin/prefill.py).
    add_prefill_routes(app, gateway, {"chat": chat_request, "completions": completion_request,
                                      "messages": messages_prefill, "responses": responses_prefill})
    # Registered in this order on purpose: a 405's `Allow` names the first route whose path matches, and
    # /openapi.json lists the paths as they were added.
    add_model_list_route(app, models)
    add_load_routes(app, models)
    add_openai_routes(app, gateway)
    return app


_DEADLINE_POLL_S = 0.05


async def _by_deadline(work: Awaitable[None], deadline: Callable[[], float | None]) -> bool:
    """Awaits `work` until it ends (True) or `deadline()` (time.monotonic(), None: none), re-read while waiting,
    has passed (False: it is cancelled)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DEADLINE_POLL_S)
            if done:
                task.result()  # its exception, if any, for the caller
                return True
            until = deadline()
            if until is not None and time.monotonic() >= until:
                break
    except asyncio.CancelledError:  # our caller was cancelled: the work goes with it
        task.cancel()
        raise
    task.cancel()
    # Given up: whatever it raises while unwinding is not an error of the shutdown's.
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    await asyncio.wait({task}, timeout=_DEADLINE_POLL_S)  # a moment to unwind, not a wait for it
    return False

"""OpenTelemetry traces of each request (`--otlp-traces-endpoint`; the optional `otel` extra), with the GenAI
semantic conventions' attributes: one span per HTTP request (its parent the client's W3C `traceparent`), one
`chat MODEL` / `text_completion MODEL` span under it and its stages: queue, prefix-cache lookup, prefill, decode,
output parsing.

Spans are built on the HTTP side once a request ends, from its outputs and the engine request's timestamps; the
engine thread never touches them, and the SDK's batch processor exports on its own thread. Off (the default),
nothing here is imported and the gateway wraps nothing."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import context as otel_context, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from mlxhost import __version__
from mlxhost.engine.request import RequestOutput

# Requests that get a server span: the API's POSTs (inference), not probes, pages or metrics scrapes.
_TRACED_METHODS = frozenset({"POST"})
_PROPAGATOR = TraceContextTextMapPropagator()


def make_exporter(endpoint: str):
    """OTLP over gRPC for grpc://HOST:PORT, over HTTP (protobuf) for http(s)://...; a bare http(s)://HOST:PORT
    gets the collector's standard /v1/traces path, as vLLM's flag does."""
    url = urlsplit(endpoint)
    if url.scheme == "grpc":
        # lazy: the one exporter asked for (gRPC's brings grpcio)
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=url.netloc, insecure=True)
    if url.scheme not in ("http", "https"):
        raise ValueError(f"--otlp-traces-endpoint must be http(s)://... or grpc://..., got {endpoint!r}")
    # lazy: the one exporter asked for (gRPC's brings grpcio)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=endpoint if url.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces")


def make_tracer_provider(exporter) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": "mlxhost", "service.version": __version__}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def make_memory_tracing() -> tuple[RequestTracer, TracerProvider, InMemorySpanExporter]:
    """Tracing as the server does it, into memory (benchmarks, tests): its cost with no collector to reach."""
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(exporter)
    return RequestTracer(provider.get_tracer("mlxhost")), provider, exporter


def install_tracing(app, endpoint: str | None = None, provider: TracerProvider | None = None) -> TracerProvider:
    """Traces every request of `app` (built by frontends/app.py) into `provider`, else a provider exporting to
    `endpoint`; its spans are flushed when the app stops."""
    provider = provider or make_tracer_provider(make_exporter(endpoint))
    tracer = provider.get_tracer("mlxhost")
    app.state.gateway.tracer = RequestTracer(tracer)
    app.add_middleware(ServerSpans, tracer=tracer)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            try:
                yield state
            finally:
                provider.shutdown()  # exports what is still queued

    app.router.lifespan_context = lifespan
    return provider


class ServerSpans:
    """A SERVER span per API request, continuing the client's trace from its `traceparent` header, current while
    the request runs (the gateway's spans hang under it). Plain ASGI, like the other middlewares (metrics.py)."""

    def __init__(self, app, tracer) -> None:
        self.app, self.tracer = app, tracer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in _TRACED_METHODS:
            return await self.app(scope, receive, send)
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]
                   if k in (b"traceparent", b"tracestate")}
        parent = _PROPAGATOR.extract(carrier)
        status = 500

        async def send_with_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        span = self.tracer.start_span(f"{scope['method']} {scope['path']}", context=parent, kind=SpanKind.SERVER,
                                      attributes={"http.request.method": scope["method"], "url.path": scope["path"]})
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            await self.app(scope, receive, send_with_status)
        finally:
            otel_context.detach(token)
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()


class RequestTracer:
    """What the gateway calls for each request it opens (`Gateway.tracer`)."""

    def __init__(self, tracer) -> None:
        self.tracer = tracer
        # The request a handler opened last (open and reply run in the handler's task, so they share it).
        self._current: ContextVar[TracedOutputs | None] = ContextVar("traced_request", default=None)

    @contextlib.contextmanager
    def server_span(self, name: str):
        """A SERVER span current while the block runs, as `ServerSpans` opens one per HTTP request."""
        with self.tracer.start_as_current_span(name, kind=SpanKind.SERVER):
            yield

    def watch(self, model: Any, prepared: Any, outputs: AsyncIterator[RequestOutput]) -> TracedOutputs:
        traced = TracedOutputs(self.tracer, model.name, prepared, outputs)
        self._current.set(traced)
        return traced

    def current(self) -> TracedOutputs | None:
        return self._current.get()


def _epoch_ns(monotonic_s: float, offset_ns: int) -> int:
    return int(monotonic_s * 1e9) + offset_ns


class TracedOutputs:
    """A request's outputs passed through unchanged, noting when the first and last came; its spans are written
    when it ends: after the reply is rendered (`Gateway.reply` holds it and times the parsing), else when the
    outputs end."""

    def __init__(self, tracer, model_name: str, prepared: Any, outputs: AsyncIterator[RequestOutput]) -> None:
        self.tracer, self.model_name, self.prepared, self.outputs = tracer, model_name, prepared, outputs
        self.parent = otel_context.get_current()
        # monotonic -> epoch: engine timestamps are time.monotonic(); spans take epoch nanoseconds.
        self.offset_ns = time.time_ns() - int(time.monotonic() * 1e9)
        self.first_s: float | None = None
        self.last_s: float | None = None
        self.last: RequestOutput | None = None
        self.error: str | None = None
        self.held = False
        self.ended = False
        self.parse_span: tuple[float, float] | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            out = await self.outputs.__anext__()
        except StopAsyncIteration:
            if not self.held:
                self.end()
            raise
        now = time.monotonic()
        if self.first_s is None and out.new_token_ids:
            self.first_s = now
        self.last_s, self.last = now, out
        if out.error:
            self.error = str(out.error)
        return out

    async def aclose(self) -> None:
        """The consumer stops early (a client gone): the engine's stream is closed too, which aborts the request."""
        close = getattr(self.outputs, "aclose", None)
        if close is not None:
            await close()
        self.end()

    def hold(self) -> None:
        """The spans wait for `end()`: the caller renders the reply and times its parsing first."""
        self.held = True

    @contextlib.contextmanager
    def parsing(self):
        started = time.monotonic()
        try:
            yield
        finally:
            self.parse_span = (started, time.monotonic())
            self.end()

    async def frames(self, frames: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream's frames; the parsing span runs from the last output to the stream's end (the parsers' flush)."""
        try:
            async for frame in frames:
                yield frame
        finally:
            if self.last_s is not None:
                self.parse_span = (self.last_s, time.monotonic())
            self.end()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        self._write_spans(time.monotonic())

    def _write_spans(self, end_s: float) -> None:
        request, last = self.prepared.request, self.last
        sp, ns = request.sampling, lambda s: _epoch_ns(s, self.offset_ns)
        operation = "chat" if request.request_id.startswith("chatcmpl") else "text_completion"
        attributes = {
            "gen_ai.operation.name": operation, "gen_ai.system": "mlxhost", "gen_ai.provider.name": "mlxhost",
            "gen_ai.request.model": self.model_name, "gen_ai.response.model": self.model_name,
            "gen_ai.response.id": request.request_id, "gen_ai.request.max_tokens": sp.max_tokens,
            "gen_ai.request.temperature": sp.temperature, "gen_ai.request.top_p": sp.top_p,
            "gen_ai.usage.input_tokens": request.num_prompt_tokens,
            "gen_ai.usage.output_tokens": last.num_output_tokens if last is not None else 0,
            "mlxhost.request.priority": request.priority,
        }
        if sp.top_k:
            attributes["gen_ai.request.top_k"] = sp.top_k
        if sp.seed is not None:
            attributes["gen_ai.request.seed"] = sp.seed
        if sp.stop:
            attributes["gen_ai.request.stop_sequences"] = list(sp.stop)
        if last is not None and last.finish_reason:
            attributes["gen_ai.response.finish_reasons"] = [last.finish_reason]
        cached = last.num_cached_tokens if last is not None else 0
        attributes["gen_ai.usage.cache_read.input_tokens"] = cached
        top = self.tracer.start_span(f"{operation} {self.model_name}", context=self.parent, kind=SpanKind.INTERNAL,
                                     start_time=ns(request.arrival_time), attributes=attributes)
        if self.error is not None:
            top.set_status(Status(StatusCode.ERROR, self.error))
            top.set_attribute("error.type", "engine_error")
        inside = trace.set_span_in_context(top, self.parent)

        def child(name: str, start: float, end: float, **attrs) -> None:
            span = self.tracer.start_span(name, context=inside, start_time=ns(start), attributes=attrs)
            span.end(end_time=ns(max(start, end)))

        scheduled = request.scheduled_time
        if scheduled is not None:
            child("queue", request.arrival_time, scheduled, **{"mlxhost.request.priority": request.priority})
            child("prefix_cache.lookup", scheduled, scheduled, **{
                "mlxhost.prefix_cache.queried_tokens": request.num_prompt_tokens,
                "mlxhost.prefix_cache.hit_tokens": cached, "gen_ai.usage.cache_read.input_tokens": cached})
            if self.first_s is not None:
                child("prefill", scheduled, self.first_s, **{
                    "mlxhost.prefill.computed_tokens": request.num_prompt_tokens - cached})
        if self.first_s is not None:
            child("decode", self.first_s, self.last_s, **{
                "gen_ai.usage.output_tokens": last.num_output_tokens})
        output = self.prepared.output
        if self.parse_span is not None and not output.is_plain:
            child("tool_parsing" if output.tool_format else "reasoning_parsing", *self.parse_span,
                  **{"mlxhost.tool_format": output.tool_format or "", "mlxhost.tools": len(output.tools or ())})
        top.end(end_time=ns(end_s))

"""Prometheus metrics, in a registry owned by the app (no process-wide globals): the engines' counters
read at scrape time, each request's latencies (`RequestTimer`), and /v1/ requests counted by status."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mlxhost.engine.contract import NOT_SUMMED
from mlxhost.engine.loop import EngineStats
from mlxhost.engine.request import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)


class _EngineGauges:
    """Reads the engines' counters at scrape time instead of pushing them on every step."""

    def __init__(self, engines: Callable[[], Any]) -> None:
        self._engines = engines

    def collect(self):
        engines = list(self._engines() or ())
        stats = sum_stats(engines)
        running, waiting = stats.num_running, stats.num_waiting
        c = CounterMetricFamily("mlxhost_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache")
        c.add_metric([], stats.prefix_queried_tokens)
        yield c
        c = CounterMetricFamily("mlxhost_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache")
        c.add_metric([], stats.prefix_hit_tokens)
        yield c
        g = GaugeMetricFamily("mlxhost_prefix_cache_blocks", "Blocks held by the prefix cache in memory")
        g.add_metric([], stats.prefix_cached_blocks)
        yield g
        c = CounterMetricFamily("mlxhost_spec_draft_tokens", "Speculative decoding: draft tokens verified")
        c.add_metric([], stats.spec_drafted_tokens)
        yield c
        c = CounterMetricFamily("mlxhost_spec_accepted_tokens", "Speculative decoding: draft tokens accepted")
        c.add_metric([], stats.spec_accepted_tokens)
        yield c
        g = GaugeMetricFamily("mlxhost_spec_acceptance_rate", "Speculative decoding: accepted / drafted tokens")
        g.add_metric([], stats.spec_accepted_tokens / stats.spec_drafted_tokens if stats.spec_drafted_tokens else 0.0)
        yield g
        g = GaugeMetricFamily("mlxhost_spec_max_batch",
                              "Speculative decoding: most decoding requests a step speculates for (0: off)")
        g.add_metric([], stats.spec_max_batch)
        yield g
        # Per proposer kind, for servers whose models speculate differently (one kind per model).
        kinds: dict[str, list[int]] = {}
        for s in (e.stats for e in engines):
            if s.spec_kind:
                k = kinds.setdefault(s.spec_kind, [0, 0])
                k[0] += s.spec_drafted_tokens
                k[1] += s.spec_accepted_tokens
        g = GaugeMetricFamily("mlxhost_spec_kind_acceptance_rate",
                              "Speculative decoding: accepted / drafted tokens per proposer kind", labels=["kind"])
        c2 = CounterMetricFamily("mlxhost_spec_kind_draft_tokens",
                                 "Speculative decoding: draft tokens verified per proposer kind", labels=["kind"])
        for kind, (drafted, accepted) in sorted(kinds.items()):
            g.add_metric([kind], accepted / drafted if drafted else 0.0)
            c2.add_metric([kind], drafted)
        yield g
        yield c2
        c = CounterMetricFamily("mlxhost_spec_big_batch_steps",
                                "Speculative decoding: decode steps without it, the batch over the maximum")
        c.add_metric([], stats.spec_big_batch_steps)
        yield c
        g = GaugeMetricFamily("mlxhost_num_requests_running", "Requests in the decode batch or prefilling")
        g.add_metric([], running)
        yield g
        g = GaugeMetricFamily("mlxhost_num_requests_waiting", "Requests queued for a slot")
        g.add_metric([], waiting)
        yield g
        g = GaugeMetricFamily("mlxhost_kv_capacity_tokens", "KV tokens running requests may hold at once")
        # Each core's capacity as of its last step, idle wake-up or call: desktop mode moves it only in those.
        g.add_metric([], sum(e.kv_capacity_tokens or 0 for e in engines))
        yield g
        g = GaugeMetricFamily("mlxhost_kv_bytes_per_token",
                              "KV cache bytes per token (smaller with --kv-bits; the largest of the loaded models)")
        g.add_metric([], stats.kv_bytes_per_token)
        yield g


class Metrics:
    def __init__(self, engines: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mlxhost_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("mlxhost_prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter("mlxhost_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("mlxhost_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mlxhost_inter_token_latency_seconds", "Time between output tokens", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("mlxhost_request_latency_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r)
        # By API key name (--api-keys), never by the key itself.
        self.key_requests = Counter("mlxhost_key_requests", "HTTP requests by API key name and status", ["key", "status"],
                                    registry=r)
        self.key_tokens = Counter("mlxhost_key_tokens", "Prompt + completion tokens by API key name", ["key"], registry=r)
        self.key_refusals = Counter("mlxhost_key_rate_limited", "Requests refused by a key's limits, by key name and limit",
                                    ["key", "limit"], registry=r)
        r.register(_EngineGauges(engines))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def sum_stats(engines) -> EngineStats:
    """The engines' counters added up: /metrics shows the server, whichever models are loaded."""
    stats = [e.stats for e in engines]
    totals = {f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(EngineStats)
              if f.name not in NOT_SUMMED}
    # Bytes per token and the speculation threshold are settings of a model, not amounts: the largest.
    totals["kv_bytes_per_token"] = max((s.kv_bytes_per_token for s in stats), default=0)
    totals["spec_max_batch"] = max((s.spec_max_batch for s in stats), default=0)
    return EngineStats(**totals)


class RequestTimer:
    """TTFT and inter-token latency of one request, fed into the Prometheus histograms; and how often
    its stream sends a heartbeat while nothing else comes (`sse.heartbeats`)."""

    def __init__(self, metrics: Metrics, heartbeat_s: float) -> None:
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


class CountRequests:
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

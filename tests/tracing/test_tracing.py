"""OpenTelemetry spans through the SDK's OTLP/HTTP exporter to an in-test receiver on 127.0.0.1: the real app over
a fake model (every HTTP layer as served) and the real server over the tiny model (queue, prefix-cache lookup,
prefill, decode and tool parsing from a real engine); the client's `traceparent` is the trace's parent; off by
default nothing is wrapped."""

from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient

from mlxhost.config import EngineConfig, ServerConfig
from mlxhost.frontends.app import create_app
from mlxhost.server.app import build_app
from mlxhost.tracing import install_tracing, make_exporter, make_tracer_provider
from tests.e2e.conftest import start_app
from tests.frontends.fake_models import NAME, FakeModels
from tests.tracing.otlp_receiver import OtlpReceiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class Models(FakeModels):
    def close(self, *_) -> None:  # the app's lifespan passes the shutdown deadline
        pass


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


def by_name(spans: list[dict]) -> dict[str, dict]:
    return {s["name"]: s for s in spans}


def test_spans_of_a_request_carry_the_genai_attributes_and_the_clients_trace(receiver):
    app = create_app(Models())
    install_tracing(app, provider=make_tracer_provider(make_exporter(receiver.endpoint)))
    with TestClient(app) as http:
        r = http.post("/v1/chat/completions", headers={"traceparent": TRACEPARENT},
                      json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                            "temperature": 0, "seed": 3})
        assert r.status_code == 200
    # The lifespan's end flushed the exporter.
    spans = by_name(receiver.wait_for(lambda s: {"POST /v1/chat/completions", f"chat {NAME}"} <= {x["name"] for x in s}))
    server, gen = spans["POST /v1/chat/completions"], spans[f"chat {NAME}"]
    assert server["trace_id"] == TRACE_ID and server["parent_id"] == "00f067aa0ba902b7"
    assert server["attributes"]["http.response.status_code"] == 200
    assert gen["trace_id"] == TRACE_ID and gen["parent_id"] == server["span_id"]
    a = gen["attributes"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == NAME
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.seed"] == 3
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.response.finish_reasons"] == ["stop"] and a["gen_ai.response.id"] == r.json()["id"]
    assert gen["resource"]["service.name"] == "mlxhost"
    assert spans["decode"]["parent_id"] == gen["span_id"]


def test_off_by_default_nothing_is_wrapped():
    models = Models()
    app = create_app(models)
    assert app.state.gateway.tracer is None
    assert ServerConfig().otlp_traces_endpoint is None


def test_the_exporter_follows_the_url():
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    assert isinstance(make_exporter("grpc://127.0.0.1:4317"), Grpc)
    http = make_exporter("http://127.0.0.1:4318")
    assert isinstance(http, Http) and http._endpoint == "http://127.0.0.1:4318/v1/traces"
    with pytest.raises(ValueError):
        make_exporter("ftp://127.0.0.1")


@pytest.mark.e2e
def test_a_served_models_stages_are_spans(qwen3_model_dir, receiver):
    config = ServerConfig(model=str(qwen3_model_dir), served_model_name="tiny", otlp_traces_endpoint=receiver.endpoint,
                          engine=EngineConfig(max_num_seqs=4, block_size=16))
    live = start_app(build_app(config))
    try:
        prompt = "a shared prefix long enough to fill whole blocks " * 8
        body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
        for _ in range(2):
            assert httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert httpx.post(live.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}).status_code == 200
    finally:
        live.stop()  # flushes the exporter
    spans = receiver.wait_for(lambda s: sum(x["name"] == "chat tiny" for x in s) == 2)
    chats = sorted((s for s in spans if s["name"] == "chat tiny"), key=lambda s: s["start"])
    for chat in chats:
        children = by_name([s for s in spans if s["parent_id"] == chat["span_id"]])
        assert {"queue", "prefix_cache.lookup", "prefill", "decode", "tool_parsing"} <= set(children), children
        assert children["queue"]["end"] <= children["prefill"]["start"] + 1
        assert children["prefill"]["end"] <= children["decode"]["start"] + 1
        assert children["tool_parsing"]["attributes"]["mlxhost.tools"] == 1
    first, second = (by_name([s for s in spans if s["parent_id"] == c["span_id"]])["prefix_cache.lookup"]
                     for c in chats)
    assert first["attributes"]["mlxhost.prefix_cache.hit_tokens"] == 0
    assert second["attributes"]["mlxhost.prefix_cache.hit_tokens"] > 0  # the same prompt again
    assert chats[1]["attributes"]["gen_ai.usage.cache_read.input_tokens"] > 0
    assert any(s["name"] == "text_completion tiny" for s in spans)  # a stream too

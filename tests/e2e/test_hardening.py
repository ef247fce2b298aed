"""Hardening on a live server (tiny model, 127.0.0.1): big bodies never stall running streams, the
Host and content-type gate, strict schemas, clipped echoes, the OpenAPI document, 405s with `Allow`,
and metric series that 404 probes cannot grow."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from mlxhost.config import EngineConfig, SecurityConfig, ServerConfig
from mlxhost.server.app import build_app
from tests.e2e.conftest import SERVED_NAME, response_head_to_headers_only, start_app

STALL_BOUND_S = 15.0  # a hang bound for a running stream's inter-token gap, not a timing check


@pytest.fixture(scope="module")
def live(qwen3_model_dir):
    # A 16 MiB body limit: 20 MB is over it, 5 MB under.
    config = ServerConfig(model=str(qwen3_model_dir), served_model_name=SERVED_NAME,
                          engine=EngineConfig(max_num_seqs=16, prefill_step_size=64),
                          security=SecurityConfig(max_request_body_bytes=16 << 20))
    server = start_app(build_app(config))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=120) as c:
        yield c


def chat(model: str, text: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def test_20mb_body_is_413_before_it_is_read(live):
    # Headers only: the answer must come without the server waiting for the 20 MB.
    head = response_head_to_headers_only(
        live.url, "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
                  f"\r\nContent-Length: {20 * 10**6}\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")


def _stream_times(url: str, model: str, times: list[float], started: threading.Event, errors: list[str]) -> None:
    """Reads one long stream, noting when each chunk with text arrived."""
    body = chat(model, "Tell me a story.", max_tokens=400, ignore_eos=True, stream=True)
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
                    started.set()
    except Exception as exc:  # reported by the test, not lost in the thread
        errors.append(repr(exc))
    finally:
        started.set()


def test_5mb_bodies_get_400_while_8_streams_keep_flowing(live, http):
    times: list[list[float]] = [[] for _ in range(8)]
    started = [threading.Event() for _ in range(8)]
    errors: list[str] = []
    threads = [threading.Thread(target=_stream_times, args=(live.url, live.model_name, times[i], started[i], errors))
               for i in range(8)]
    for t in threads:
        t.start()
    assert all(e.wait(120) for e in started)  # every stream is producing tokens
    big = "word " * (10**6)  # 5 MB of text, under the 64 MiB body limit
    statuses, in_flight = [], []  # (sent, answered) of each big request
    for _ in range(3):
        sent = time.perf_counter()
        resp = http.post("/v1/chat/completions", json=chat(live.model_name, big, max_tokens=4))
        in_flight.append((sent, time.perf_counter()))
        statuses.append((resp.status_code, resp.json()["error"]["code"]))
        assert len(resp.text) < 3000  # the 5 MB prompt is not echoed back
        sent = time.perf_counter()
        resp = http.post("/v1/completions", json={"model": live.model_name, "prompt": big, "max_tokens": 4})
        in_flight.append((sent, time.perf_counter()))
        statuses.append((resp.status_code, resp.json()["error"]["code"]))
    health = http.get("/health")
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert health.status_code == 200
    assert set(statuses) == {(400, "context_length_exceeded")}
    # Every stream got text while a big body was being read, tokenized and refused: they never wait on it.
    during = [sum(any(a < t < b for a, b in in_flight) for t in ts) for ts in times]
    assert all(during), (during, [len(ts) for ts in times])
    gaps = [max(b - a for a, b in zip(ts, ts[1:])) for ts in times]
    assert max(gaps) < STALL_BOUND_S, gaps


def test_foreign_host_is_refused(live, http):
    resp = http.get("/v1/models", headers={"Host": "evil.example.com"})
    assert resp.status_code == 421 and resp.json()["error"]["code"] == "invalid_host"
    assert http.get("/v1/models", headers={"Host": "localhost:8000"}).status_code == 200


def test_post_without_json_content_type_is_415(live, http):
    body = json.dumps(chat(live.model_name, "hi", max_tokens=1)).encode()
    for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
        resp = http.post("/v1/chat/completions", content=body, headers=headers)
        assert resp.status_code == 415, headers
        assert resp.json()["error"]["code"] == "unsupported_media_type"
    ok = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


@pytest.mark.parametrize("body,param", [
    ({"prompt": [[False]]}, "prompt"),
    ({"prompt": "hi", "logprobs": False}, "logprobs"),
    ({"prompt": "hi", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "hi", "stream": 1}, "stream"),
])
def test_no_type_coercion(live, http, body, param):
    resp = http.post("/v1/completions", json={"model": live.model_name, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith(param)


def test_chat_top_logprobs_false_is_400_and_numbers_still_work(live, http):
    resp = http.post("/v1/chat/completions", json=chat(live.model_name, "hi", logprobs=True, top_logprobs=False))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs"
    # JSON integers still fill float fields; floats stay floats.
    ok = http.post("/v1/chat/completions", json=chat(live.model_name, "hi", max_tokens=2, temperature=1, top_p=1.0))
    assert ok.status_code == 200


def test_a_huge_model_name_is_not_echoed_whole(live, http):
    resp = http.post("/v1/chat/completions", json=chat("m" * (10 * 10**6), "hi", max_tokens=1))
    assert resp.status_code == 404
    assert len(resp.content) < 2000 and "characters)" in resp.json()["error"]["message"]


def test_openapi_documents_400_not_422(live, http):
    doc = http.get("/openapi.json").json()
    ops = [op for item in doc["paths"].values() for op in item.values()]
    assert not any("422" in op["responses"] for op in ops)
    chat_op = doc["paths"]["/v1/chat/completions"]["post"]
    assert {"400", "413", "415"} <= set(chat_op["responses"])
    assert "text/event-stream" in chat_op["responses"]["200"]["content"]


def test_405_says_allow(live, http):
    resp = http.put("/v1/chat/completions", json={})
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    resp = http.post("/v1/models", json={})
    assert resp.status_code == 405 and "GET" in resp.headers["allow"]


def test_404_paths_add_no_metric_series(live, http):
    before = {k for k in live.metrics() if k.startswith("mlxhost_requests_total")}
    for i in range(1000):
        assert http.get(f"/v1/no-such-thing-{i}").status_code == 404
    after = {k for k in live.metrics() if k.startswith("mlxhost_requests_total")}
    assert len(after - before) <= 1  # at most the one "unmatched" series
    assert all("no-such-thing" not in k for k in after)

"""A shared server against real clients: API keys (both header styles, both dialects' 401), open and
closed paths, CORS preflight, the request-body limit and the max_tokens cap."""

from __future__ import annotations

import httpx
import openai
import pytest

from mlxhost.config import EngineConfig, SecurityConfig, ServerConfig
from mlxhost.server.app import build_app
from tests.e2e.conftest import response_head_to_headers_only

SERVED_NAME = "tiny"  # the name tests/e2e/conftest.py serves under
KEY = "sk-test-0123456789"
ORIGIN = "http://localhost:3000"
LIMIT = 10 * 10**6
CAP = 16
BIG = 20 * 10**6


def secured_app(model_dir, **security):
    config = ServerConfig(model=str(model_dir), served_model_name=SERVED_NAME,
                          engine=EngineConfig(max_num_seqs=4), security=SecurityConfig(**security))
    return build_app(config)


@pytest.fixture(scope="module")
def live(qwen3_model_dir, serve_module_app):
    return serve_module_app(secured_app(qwen3_model_dir, api_keys=(KEY,), allowed_origins=(ORIGIN,),
                                        max_request_body_bytes=LIMIT, max_tokens_cap=CAP))


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=120) as c:
        yield c


def openai_client(live, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=120)


COMPLETION = {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 4}


def test_missing_and_wrong_key_are_401(live, http):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"x-api-key": "nope"}):
        resp = http.post("/v1/completions", json=COMPLETION, headers=headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"
    with openai_client(live, "nope") as client, pytest.raises(openai.AuthenticationError) as info:
        client.completions.create(**COMPLETION)
    assert info.value.code == "invalid_api_key"


def test_right_key_in_both_header_styles(live, http):
    with openai_client(live, KEY) as client:  # the SDK sends `Authorization: Bearer KEY`
        assert client.completions.create(**COMPLETION).usage.completion_tokens == 4
        assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    resp = http.post("/v1/completions", json=COMPLETION, headers={"x-api-key": KEY})
    assert resp.status_code == 200, resp.text


def test_anthropic_path_answers_in_anthropic_shape(http):
    resp = http.post("/v1/messages", json={"model": SERVED_NAME, "max_tokens": 4, "messages": []})
    assert resp.status_code == 401
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"


def test_health_open_metrics_and_root_closed(http):
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/metrics").status_code == 401
    page = http.get("/")  # the web page's files hold no data: they load, and its API calls send the key
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert http.get("/v1/models").status_code == 401
    assert http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_metrics_public(qwen3_model_dir, serve_module_app):
    server = serve_module_app(secured_app(qwen3_model_dir, api_keys=(KEY,), metrics_public=True))
    assert "mlxhost_num_requests_running" in httpx.get(server.url + "/metrics", timeout=30).text
    assert httpx.get(server.base_url + "/models", timeout=30).status_code == 401


def test_cors_preflight(http):
    def preflight(origin):
        return http.options("/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    ok = preflight(ORIGIN)  # no key: a browser never sends one with a preflight
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    blocked = preflight("http://evil.example")
    assert blocked.status_code == 400 and "access-control-allow-origin" not in blocked.headers


def test_body_over_the_limit_from_content_length_is_413_before_the_body(live):
    # Headers only: the answer must come without the server waiting for 20 MB.
    head = response_head_to_headers_only(
        live.url, f"POST /v1/chat/completions HTTP/1.1\r\nHost: {{host}}\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {BIG}\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")


def test_body_over_the_limit_is_413_with_content_length_and_chunked(http):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    resp = http.post("/v1/chat/completions", content=b" " * BIG, headers=headers)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: Transfer-Encoding chunked
        for _ in range(BIG // 10**6):
            yield b" " * 10**6

    resp = http.post("/v1/chat/completions", content=chunks(), headers=headers)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_max_tokens_cap(live):
    with openai_client(live, KEY) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**{**COMPLETION, "max_tokens": CAP + 1})
        assert info.value.param == "max_tokens"
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}],
                                           max_completion_tokens=CAP + 1)
        assert info.value.param == "max_tokens"
        assert client.completions.create(**{**COMPLETION, "max_tokens": CAP}).usage.completion_tokens <= CAP
        # No max_tokens: the default (2048) is capped too, not refused.
        out = client.completions.create(model=SERVED_NAME, prompt="Once", extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == CAP

"""frontends/common/security.py without a model: API keys in both header styles, the error shape by dialect, open
paths, CORS, the body limit (Content-Length up front and counted while streaming), the start-up warning,
and the flags that configure them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from mlxhost.config import SecurityConfig
from mlxhost.frontends.anthropic.errors import install_anthropic_errors
from mlxhost.frontends.common.errors import (
    APIError,
    ErrorShape,
    error_shapes,
    install_error_handlers,
    register_error_shape,
)
from mlxhost.frontends.common.security import BodyLimitMiddleware, install_security
from mlxhost.server.cli import make_parser
from mlxhost.server.serve_command import _security_config

KEYS = ("sk-first", "sk-second")


def make_app(security: SecurityConfig, host: str = "127.0.0.1") -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    install_anthropic_errors(app)  # as the real app's Anthropic routes do

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return {"metrics": True}

    @app.get("/")
    async def root():
        return {"ui": True}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": []}

    @app.post("/v1/echo")
    async def echo(raw: Request):
        return {"bytes": len(await raw.body())}

    if security.allowed_hosts is None:  # TestClient sends `Host: testserver`
        security = dataclasses.replace(security, allowed_hosts=("testserver",))
    install_security(app, security, host)
    return app


@pytest.fixture
def keyed():
    return TestClient(make_app(SecurityConfig(api_keys=KEYS)))


def assert_openai_401(resp):
    assert resp.status_code == 401
    err = resp.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] in ("invalid_request_error", "authentication_error")
    assert set(err) == {"message", "type", "param", "code"}
    assert "sk-" not in err["message"]  # a key is never echoed back


# -- keys ----------------------------------------------------------------------------------------


def test_missing_and_wrong_key_are_401_in_openai_shape(keyed):
    assert_openai_401(keyed.get("/v1/models"))
    assert_openai_401(keyed.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"}))
    assert_openai_401(keyed.get("/v1/models", headers={"x-api-key": "sk-firs"}))  # a prefix is not the key
    assert_openai_401(keyed.get("/v1/models", headers={"Authorization": "Basic sk-first"}))
    assert "Missing" in keyed.get("/v1/models").json()["error"]["message"]
    assert keyed.get("/v1/models").headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("headers", [
    {"Authorization": "Bearer sk-first"},
    {"Authorization": "bearer sk-second"},  # the scheme is case-insensitive; any configured key works
    {"x-api-key": "sk-first"},
    {"x-api-key": "sk-second", "Authorization": "Bearer not-a-key"},  # one right header is enough
])
def test_right_key_in_either_header_passes(keyed, headers):
    resp = keyed.get("/v1/models", headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"object": "list", "data": []}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_anthropic_paths_get_anthropic_401(keyed, path):
    # The route need not exist: the key check answers first, in the shape Anthropic clients parse.
    resp = keyed.post(path, json={})
    assert resp.status_code == 401
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert body["error"]["message"]
    assert keyed.post(path, json={}, headers={"x-api-key": "sk-first"}).status_code == 404  # past the gate


def test_open_and_closed_paths(keyed):
    assert keyed.get("/health").json() == {"status": "ok"}
    assert_openai_401(keyed.get("/metrics"))
    assert_openai_401(keyed.get("/"))
    assert_openai_401(keyed.get("/docs"))
    public = TestClient(make_app(SecurityConfig(api_keys=KEYS, metrics_public=True)))
    assert public.get("/metrics").status_code == 200
    assert_openai_401(public.get("/v1/models"))


def test_no_keys_means_no_check():
    client = TestClient(make_app(SecurityConfig()))
    assert client.get("/v1/models").status_code == 200
    assert client.get("/").status_code == 200


# -- CORS ----------------------------------------------------------------------------------------


def preflight(client, origin: str):
    return client.options("/v1/models", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})


def test_cors_preflight_passes_without_a_key_for_allowed_origins_only():
    client = TestClient(make_app(SecurityConfig(api_keys=KEYS, allowed_origins=("http://localhost:3000",))))
    ok = preflight(client, "http://localhost:3000")
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "x-stainless-os" in ok.headers["access-control-allow-headers"].lower()
    blocked = preflight(client, "http://evil.example")
    assert blocked.status_code == 400
    assert "access-control-allow-origin" not in blocked.headers
    # A 401 still carries CORS headers, so the page can show why.
    resp = client.get("/v1/models", headers={"Origin": "http://localhost:3000"})
    assert resp.status_code == 401 and resp.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_cors_off_by_default():
    client = TestClient(make_app(SecurityConfig()))
    resp = client.get("/v1/models", headers={"Origin": "http://localhost:3000"})
    assert "access-control-allow-origin" not in resp.headers
    assert preflight(client, "http://localhost:3000").status_code == 405  # no route answers OPTIONS


# -- body limit ----------------------------------------------------------------------------------


async def call_asgi(app, path: str, headers: list, chunks: list[bytes]):
    """Drives `app` with a body in `chunks`; returns (status, JSON body, body messages read)."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    reads, sent = [], []

    async def receive():
        reads.append(1)
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/json"), *headers]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b"",
             "http_version": "1.1", "scheme": "http", "server": ("test", 80), "client": ("test", 1),
             "root_path": ""}
    await app(scope, receive, send)
    import json

    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, sent  # exactly one response, never the app's and ours
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return starts[0]["status"], json.loads(body), len(reads)


def test_content_length_over_the_limit_is_413_before_reading():
    app = BodyLimitMiddleware(make_app(SecurityConfig()), max_bytes=1000)
    status, body, reads = asyncio.run(call_asgi(app, "/v1/echo", [(b"content-length", b"20000000")], [b"x"]))
    assert status == 413 and reads == 0
    assert body["error"]["code"] == "request_too_large" and body["error"]["type"] == "invalid_request_error"


def test_chunked_body_is_counted_while_streaming():
    app = BodyLimitMiddleware(make_app(SecurityConfig()), max_bytes=1000)
    chunks = [b"x" * 400] * 10
    status, body, reads = asyncio.run(call_asgi(app, "/v1/echo", [(b"transfer-encoding", b"chunked")], chunks))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert reads == 3  # stopped at the chunk that crossed the limit
    status, body, _ = asyncio.run(call_asgi(app, "/v1/echo", [], [b"x" * 500, b"x" * 500]))
    assert status == 200 and body == {"bytes": 1000}  # exactly the limit is fine


def test_a_content_length_that_lies_is_caught_too():
    app = BodyLimitMiddleware(make_app(SecurityConfig()), max_bytes=1000)
    status, _, _ = asyncio.run(call_asgi(app, "/v1/echo", [(b"content-length", b"10")], [b"x" * 600] * 2))
    assert status == 413


def test_anthropic_path_gets_anthropic_413():
    inner = make_app(SecurityConfig())
    app = BodyLimitMiddleware(inner, max_bytes=10, shapes=error_shapes(inner))
    status, body, _ = asyncio.run(call_asgi(app, "/v1/messages", [(b"content-length", b"11")], [b"x" * 11]))
    assert status == 413 and body["type"] == "error" and body["error"]["type"] == "request_too_large"


def test_installed_limit_through_test_client():
    client = TestClient(make_app(SecurityConfig(max_request_body_bytes=1000)))
    json_type = {"content-type": "application/json"}
    assert client.post("/v1/echo", content=b"x" * 1000, headers=json_type).json() == {"bytes": 1000}
    resp = client.post("/v1/echo", content=b"x" * 1001, headers=json_type)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


# -- start-up warning, config and flags --------------------------------------------------------------


@pytest.mark.parametrize("host,warns", [("0.0.0.0", True), ("::", True), ("my-box.local", True),
                                        ("127.0.0.1", False), ("::1", False), ("localhost", False)])
def test_warning_for_a_public_host_without_key(caplog, host, warns):
    with caplog.at_level(logging.WARNING, logger="mlxhost.frontends.common.security"):
        make_app(SecurityConfig(), host=host)
        make_app(SecurityConfig(api_keys=KEYS), host=host)  # a key: never a warning
    assert len([r for r in caplog.records if "without an API key" in r.message]) == (1 if warns else 0)


def test_config_validation_and_repr():
    with pytest.raises(ValueError):
        SecurityConfig(api_keys=("",))
    with pytest.raises(ValueError):
        SecurityConfig(max_request_body_bytes=0)
    with pytest.raises(ValueError):
        SecurityConfig(max_tokens_cap=0)
    assert "sk-first" not in repr(SecurityConfig(api_keys=KEYS))  # keys stay out of logged configs


def parse(*flags):
    return make_parser().parse_args(["serve", *flags])


def test_flags(monkeypatch):
    monkeypatch.delenv("MLXHOST_API_KEY", raising=False)
    cfg = _security_config(parse("--api-key", "a", "--api-key", "b", "--metrics-public", "--allowed-origins",
                                 "http://x:1, http://y:2", "--max-request-body-bytes", "10MB",
                                 "--max-tokens-cap", "256"))
    assert cfg == SecurityConfig(api_keys=("a", "b"), metrics_public=True, allowed_origins=("http://x:1", "http://y:2"),
                                 max_request_body_bytes=10_000_000, max_tokens_cap=256)
    assert _security_config(parse()) == SecurityConfig()
    assert SecurityConfig().max_request_body_bytes == 64 << 20


def test_env_keys_and_flags_win(monkeypatch):
    monkeypatch.setenv("MLXHOST_API_KEY", "k1, k2,")
    assert _security_config(parse()).api_keys == ("k1", "k2")
    assert _security_config(parse("--api-key", "k3")).api_keys == ("k3",)


def test_a_registered_error_shape_answers_on_its_paths_only():
    """A dialect registers its error shape once: the app's handlers and the gate then answer in it on its
    paths (same status and headers), and in OpenAI's shape everywhere else."""
    app = make_app(SecurityConfig(api_keys=KEYS))

    @app.post("/x/busy")
    async def busy():
        raise APIError(429, "later", "model", "server_busy", headers={"Retry-After": "1"})

    app.post("/v1/busy")(busy)
    register_error_shape(app, ErrorShape("x", lambda path: path.startswith("/x/"),
                                         lambda status, message, param, code: {"oops": [status, message, param, code]}))
    client, key = TestClient(app), {"x-api-key": "sk-first"}
    resp = client.post("/x/busy", json={}, headers=key)
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert resp.json() == {"oops": [429, "later", "model", "server_busy"]}
    assert client.post("/v1/busy", json={}, headers=key).json()["error"]["code"] == "server_busy"
    gate = client.post("/x/busy", json={})
    assert gate.status_code == 401 and gate.json()["oops"][0] == 401 and gate.json()["oops"][3] == "invalid_api_key"
    assert_openai_401(client.post("/v1/busy", json={}))

"""A request that fails looks the same in every dialect, streamed or whole, n = 1 or n > 1: shutdown is a 503,
a grammar's dead end a 400, an engine fault a 500, each in the dialect's own error shape (its type or code the
same both ways), and a client that leaves gets its requests aborted. The real app over the fake engine."""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_models import FAILURES, NAME, FakeModels
from fastapi.testclient import TestClient

from mlxhost.frontends.app import create_app

USER = [{"role": "user", "content": "hi"}]
# dialect -> (path, body(stream, n), error shape)
DIALECTS = {
    "openai chat": ("/v1/chat/completions", lambda s, n: {"model": NAME, "messages": USER, "stream": s, "n": n},
                    "openai"),
    "openai completions": ("/v1/completions", lambda s, n: {"model": NAME, "prompt": "hi", "max_tokens": 8,
                                                            "stream": s, "n": n}, "openai"),
    "anthropic": ("/v1/messages", lambda s, n: {"model": NAME, "max_tokens": 16, "messages": USER, "stream": s},
                  "anthropic"),
    "responses": ("/v1/responses", lambda s, n: {"model": NAME, "input": "hi", "store": False, "stream": s},
                  "responses"),
    "ollama chat": ("/api/chat", lambda s, n: {"model": NAME, "messages": USER, "stream": s}, "ollama"),
    "ollama generate": ("/api/generate", lambda s, n: {"model": NAME, "prompt": "hi", "stream": s}, "ollama"),
}
CASES = [(d, 1) for d in DIALECTS] + [("openai chat", 2), ("openai completions", 2)]
# failure -> (status of a whole reply, the error's type or code in each shape)
EXPECTED = {
    "shutdown": (503, {"openai": "server_shutting_down", "anthropic": "overloaded_error",
                       "ollama": FAILURES["shutdown"]["error"]}),
    "grammar": (400, {"openai": "grammar_failed", "anthropic": "invalid_request_error",
                      "ollama": FAILURES["grammar"]["error"]}),
    "crash": (500, {"openai": "server_error", "anthropic": "api_error", "ollama": FAILURES["crash"]["error"]}),
}


def whole_kind(shape: str, body: dict) -> str:
    if shape == "anthropic":
        assert body["type"] == "error"
        return body["error"]["type"]
    if shape == "ollama":
        return body["error"]
    return body["error"]["code"] or body["error"]["type"]  # OpenAI's shape (Responses' whole errors too)


def stream_kind(shape: str, text: str) -> str:
    """The type or code of the stream's one error frame; the frame is the stream's last event."""
    if shape == "ollama":
        lines = [json.loads(line) for line in text.splitlines() if line]
        errors = [obj for obj in lines if "error" in obj]
        assert len(errors) == 1 and lines[-1] is errors[0] and not any(obj.get("done") for obj in lines)
        return errors[0]["error"]
    events = [e for e in text.split("\n\n") if e]
    datas = [e.split("data: ", 1)[1] for e in events]
    if shape == "openai":
        errors = [json.loads(d)["error"] for d in datas if d.startswith('{"error"')]
        assert len(errors) == 1 and datas[-1] == "[DONE]"
        return errors[0]["code"] or errors[0]["type"]
    name = "error" if shape == "anthropic" else "response.failed"
    failed = [json.loads(d) for e, d in zip(events, datas) if e.startswith(f"event: {name}\n")]
    assert len(failed) == 1 and events[-1].startswith(f"event: {name}\n")
    if shape == "anthropic":
        return failed[0]["error"]["type"]
    return failed[0]["response"]["error"]["code"]


@pytest.mark.parametrize("dialect,n", CASES, ids=[f"{d} n={n}" for d, n in CASES])
@pytest.mark.parametrize("failure", ["shutdown", "grammar", "crash", "client gone"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_failure_looks_the_same_in_every_dialect(dialect, n, failure, stream):
    path, body, shape = DIALECTS[dialect]
    models = FakeModels()
    app = create_app(models)
    if failure == "client gone":
        models.engine.failure = "hang"
        status, _ = asyncio.run(leave_early(app, models, path, body(stream, n), stream))
        # Whole: the 499 of a client that left; streamed: the stream had started. Either way every request
        # that reached the engine was aborted (its output stream closed).
        assert status == (200 if stream else 499)
        assert models.engine.requests and sorted(models.engine.closed) == sorted(
            r.request_id for r in models.engine.requests)
        return
    models.engine.failure = failure
    want_status, kinds = EXPECTED[failure]
    r = TestClient(app, raise_server_exceptions=False).post(path, json=body(stream, n))
    if stream:
        assert r.status_code == 200
        assert stream_kind(shape, r.text) == kinds["openai" if shape == "responses" else shape]
    else:
        assert r.status_code == want_status
        assert whole_kind(shape, r.json()) == kinds["openai" if shape == "responses" else shape]


@pytest.mark.parametrize("dialect", ["openai chat", "openai completions"])
def test_n_choices_heartbeat_before_the_first_token(dialect):
    """n > 1 streams through the same loop: while choice 0 waits for its first token the client gets keep-alive
    chunks; the other choices are queued only once it has one."""
    path, body, _ = DIALECTS[dialect]
    models = FakeModels()
    app = create_app(models)
    app.state.gateway.heartbeat_s = 0.01
    models.engine.failure = "hang"
    chunks: list[str] = []

    def on_body(text: str) -> None:
        chunks.append(text)
        if len(chunks) == 3:  # the first chunks, then two heartbeats: choice 0's first token may come
            assert len(models.engine.requests) == 1
            models.engine.release.set()

    status, text = asyncio.run(asyncio.wait_for(drive(app, path, body(True, 3), on_body), 60))  # a safety net
    assert status == 200 and len(models.engine.requests) == 3 and text.endswith("data: [DONE]\n\n")
    beats = [json.loads(c.split("data: ", 1)[1]) for c in chunks[1:3]]
    assert all(b["choices"][0]["index"] == 0 and b["choices"][0].get("delta", {}) in ({}, "") for b in beats)
    got = [json.loads(e.split("data: ", 1)[1]) for e in "".join(chunks[3:]).split("\n\n") if e.startswith("data: {")]
    assert {c["choices"][0]["index"] for c in got if c["choices"]} == {0, 1, 2}


def scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
            "client": ("127.0.0.1", 1), "server": ("test", 80)}


async def drive(app, path: str, body: dict, on_body=None, gone: asyncio.Event | None = None) -> tuple[int, str]:
    """One request through the app's ASGI interface on this loop; the client leaves once `gone` is set."""
    sent, status, parts = False, 0, []

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await (gone or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and message.get("body"):
            parts.append(message["body"].decode())
            if on_body is not None:
                on_body(parts[-1])

    await app(scope(path), receive, send)
    return status, "".join(parts)


async def leave_early(app, models: FakeModels, path: str, body: dict, stream: bool) -> tuple[int, str]:
    """The request, its client gone once the request reached the engine (and, streamed, once the first bytes came)."""
    gone = asyncio.Event()
    got_bytes = asyncio.Event()

    async def watch() -> None:
        while models.engine.reached is None:
            await asyncio.sleep(0)
        await models.engine.reached.wait()
        if stream:
            await got_bytes.wait()
        gone.set()

    watcher = asyncio.ensure_future(watch())
    try:  # a safety net, not a timing check: a request that never notices its client must fail, not hang
        result = await asyncio.wait_for(drive(app, path, body, lambda _: got_bytes.set(), gone), 60)
    finally:
        watcher.cancel()
    for _ in range(100):  # the aborted streams' cleanup runs as their cancellations land
        if len(models.engine.closed) == len(models.engine.requests):
            break
        await asyncio.sleep(0)
    return result

"""API keys with policies (frontends/common/keys.py) without a model: the file's checks, reloads, the
sliding-minute limits on a fake clock, and what the gate hands the request path (policy on request.state,
priority and cache group on the engine request, 404 for a model the key may not use)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from mlxhost.config import SecurityConfig
from mlxhost.frontends.anthropic.errors import install_anthropic_errors
from mlxhost.frontends.app import create_app
from mlxhost.frontends.common.errors import install_error_handlers
from mlxhost.frontends.common.keys import KeyPolicy, KeyRing, KeyUsage, parse_key_file
from mlxhost.frontends.common.security import install_security
from tests.frontends.fake_models import NAME, FakeModels

FILE = """
keys:
  - key: sk-alice
    name: alice
    models: [tiny]
    priority: 2
    requests_per_minute: 3
  - key: sk-bob
    name: bob
    tokens_per_minute: 100
    max_concurrent: 1
    cache_group: lab
  - key: sk-anon
"""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_file_parses_and_absent_fields_are_unlimited():
    alice, bob, anon = parse_key_file(FILE)
    assert (alice.name, alice.models, alice.priority, alice.requests_per_minute) == ("alice", ("tiny",), 2, 3)
    assert (bob.tokens_per_minute, bob.max_concurrent, bob.cache_group) == (100, 1, "lab")
    assert anon.name.startswith("key-") and "sk-anon" not in anon.name and anon.models is None
    assert anon.priority is None and anon.requests_per_minute is None and anon.max_concurrent is None
    assert "sk-alice" not in repr(alice)
    # JSON is YAML too.
    assert parse_key_file(json.dumps({"keys": [{"key": "k", "max_concurrent": 2}]}))[0].max_concurrent == 2


@pytest.mark.parametrize("text, why", [
    ("keys: {}", "list under `keys:`"),
    ("keys:\n  - name: x", "`key`"),
    ("keys:\n  - key: a\n  - key: a", "twice"),
    ("keys:\n  - key: a\n    requests_per_minute: 0", "requests_per_minute"),
    ("keys:\n  - key: a\n    colour: red", "unknown field"),
    ("keys:\n  - key: a\n    models: tiny", "list of names"),
    ("keys:\n  - {key: a, name: n}\n  - {key: b, name: n}", "unique"),
])
def test_a_bad_file_says_what_is_wrong_without_the_key(text, why):
    with pytest.raises(ValueError, match=why) as info:
        parse_key_file(text)
    assert "sk-" not in str(info.value)


def test_request_and_token_windows_slide_over_a_minute():
    clock, policy = FakeClock(), KeyPolicy(key="k", name="n", requests_per_minute=2, tokens_per_minute=50)
    usage = KeyUsage(clock)
    assert usage.admit(policy) is None
    usage.release()
    clock.now += 10
    assert usage.admit(policy) is None
    usage.release()
    refusal = usage.admit(policy)
    assert refusal.limit == "requests" and refusal.retry_after_s == 50  # the first one leaves the window then
    clock.now += 50
    assert usage.admit(policy) is None
    usage.release()
    # Tokens are counted after the fact: a request is refused once the window is already at the limit.
    usage.add_tokens(30)
    clock.now += 30
    usage.add_tokens(30)
    clock.now += 1
    refusal = usage.admit(KeyPolicy(key="k", name="n", tokens_per_minute=50))
    assert refusal.limit == "tokens" and refusal.retry_after_s == 29  # then the first 30 leave: 30 < 50
    clock.now += 29
    assert usage.admit(KeyPolicy(key="k", name="n", tokens_per_minute=50)) is None


def test_concurrency_counts_requests_in_flight():
    usage, policy = KeyUsage(FakeClock()), KeyPolicy(key="k", name="n", max_concurrent=2)
    assert usage.admit(policy) is None and usage.admit(policy) is None
    assert usage.admit(policy).limit == "concurrency"
    usage.release()
    assert usage.admit(policy) is None


def test_a_read_neither_waits_for_nor_takes_a_concurrency_slot():
    """A GET (a batch's status, a file) passes while the key's one slot is busy, and leaves it as it was; it still
    counts towards the requests per minute."""
    usage = KeyUsage(FakeClock())
    policy = KeyPolicy(key="k", name="n", max_concurrent=1, requests_per_minute=3)
    assert usage.admit(policy) is None and usage.num_in_flight == 1
    assert usage.admit(policy, in_flight=False) is None and usage.num_in_flight == 1
    assert usage.admit(policy, in_flight=False) is None
    assert usage.admit(policy, in_flight=False).limit == "requests"


def test_the_file_is_read_again_when_it_changes_or_on_request(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(FILE)
    ring = KeyRing(str(path), plain_keys=("sk-flag",))
    assert ring.match([b"sk-bob"]).name == "bob" and ring.match([b"sk-flag"]).requests_per_minute is None
    path.write_text("keys:\n  - {key: sk-carol, name: carol, priority: 1}\n")
    ring.reload_if_changed()
    assert ring.match([b"sk-bob"]) is None and ring.match([b"sk-carol"]).name == "carol"
    assert ring.match([b"sk-flag"]) is not None  # --api-key keys stay
    path.write_text("keys: [broken")  # a bad edit keeps the keys in force
    ring.reload_if_changed()
    assert ring.match([b"sk-carol"]).name == "carol"
    path.write_text("keys:\n  - {key: sk-dave}\n")
    ring.reload_soon()  # SIGHUP
    ring.reload_if_changed()
    assert ring.match([b"sk-dave"]) is not None


def test_cache_groups_by_isolation_mode():
    bob, anon = KeyPolicy(key="b", name="bob", cache_group="lab"), KeyPolicy(key="a", name="anon")
    assert KeyRing(cache_isolation="none").grant(bob).cache_group == ""
    assert KeyRing(cache_isolation="key").grant(bob).cache_group == "key:bob"
    assert KeyRing(cache_isolation="group").grant(bob).cache_group == "group:lab"
    assert KeyRing(cache_isolation="group").grant(anon).cache_group == "key:anon"


def keyed_app(tmp_path, **security) -> tuple[TestClient, FakeModels]:
    path = tmp_path / "keys.yaml"
    path.write_text(FILE)
    models = FakeModels()
    app = create_app(models)
    install_security(app, SecurityConfig(api_key_file=str(path), allowed_hosts=("testserver",), **security),
                     "127.0.0.1")
    return TestClient(app), models


def chat(client, key: str, **body):
    return client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], **body})


def test_the_keys_class_and_group_reach_the_engine_request(tmp_path):
    client, models = keyed_app(tmp_path, cache_isolation="group")
    assert chat(client, "sk-alice").status_code == 200
    assert models.engine.requests[-1].priority == 2 and models.engine.requests[-1].cache_group == "key:alice"
    assert chat(client, "sk-alice", priority=0).status_code == 200  # no better than its key's class
    assert models.engine.requests[-1].priority == 2
    assert chat(client, "sk-alice", priority=7).status_code == 200  # a worse one it may ask for
    assert models.engine.requests[-1].priority == 7
    assert chat(client, "sk-bob", priority=-3).status_code == 200  # a key without a class: the request's own
    assert (models.engine.requests[-1].priority, models.engine.requests[-1].cache_group) == (-3, "group:lab")


def test_a_key_limited_to_other_models_gets_404(tmp_path):
    client, models = keyed_app(tmp_path)
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - {key: sk-alice, name: alice, models: [other]}\n")
    resp = chat(client, "sk-alice")
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found" and not models.engine.requests


def test_a_key_limited_to_some_models_lists_only_those():
    cards = [{"id": "tiny", "aliases": ["small"]}, {"id": "big", "aliases": []}, {"id": "sql-adapter"}]
    grant = lambda models: KeyRing().grant(KeyPolicy(key="k", name="k", models=models))  # noqa: E731
    assert grant(None).visible_cards(cards) == cards
    assert [c["id"] for c in grant(("big", "sql-adapter")).visible_cards(cards)] == ["big", "sql-adapter"]
    assert [c["id"] for c in grant(("small",)).visible_cards(cards)] == ["tiny"]  # an alias it may use
    assert grant(("other",)).visible_cards(cards) == []


def test_the_model_lists_hide_models_the_key_may_not_use(tmp_path):
    client, _ = keyed_app(tmp_path)
    auth = {"Authorization": "Bearer sk-alice"}
    assert [c["id"] for c in client.get("/v1/models", headers=auth).json()["data"]] == [NAME]
    (tmp_path / "keys.yaml").write_text("keys:\n  - {key: sk-alice, name: alice, models: [other]}\n")
    assert client.get("/v1/models", headers=auth).json()["data"] == []
    assert client.get("/api/tags", headers=auth).json()["models"] == []
    assert client.get("/api/ps", headers=auth).json()["models"] == []
    resp = client.get(f"/v1/models/{NAME}", headers=auth)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_429_with_openai_headers_and_anthropic_shape_on_its_routes(tmp_path):
    client, _ = keyed_app(tmp_path)
    for _ in range(3):
        resp = chat(client, "sk-alice")
        assert resp.status_code == 200
    assert resp.headers["x-ratelimit-limit-requests"] == "3"
    assert resp.headers["x-ratelimit-remaining-requests"] == "0"
    resp = chat(client, "sk-alice")
    assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
    assert resp.json()["error"]["code"] == "rate_limit_exceeded"
    assert resp.headers["x-ratelimit-remaining-requests"] == "0"
    resp = client.post("/v1/messages", headers={"x-api-key": "sk-alice", "anthropic-version": "2023-06-01"},
                       json={"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 429
    assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "rate_limit_error"
    assert resp.headers["anthropic-ratelimit-requests-limit"] == "3"
    assert resp.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert "x-ratelimit-limit-requests" not in resp.headers


def test_the_policy_is_on_request_state_for_handlers(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(FILE)
    app = FastAPI()
    install_error_handlers(app)
    install_anthropic_errors(app)

    @app.get("/v1/whoami")
    async def whoami(raw: Request):
        policy = raw.state.api_key
        return {"name": policy.name, "mcp_servers": policy.mcp_servers, **{"fields": list(dataclasses.asdict(policy))}}

    install_security(app, SecurityConfig(api_key_file=str(path), allowed_hosts=("testserver",)), "127.0.0.1")
    body = TestClient(app).get("/v1/whoami", headers={"x-api-key": "sk-bob"}).json()
    assert body["name"] == "bob" and body["mcp_servers"] is None and "cache_group" in body["fields"]


def test_a_key_file_that_does_not_parse_is_reported_without_its_keys():
    import pytest

    from mlxhost.frontends.common.keys import parse_key_file

    with pytest.raises(ValueError) as caught:
        parse_key_file('keys:\n  - key: "sk-SECRET123\n')
    assert "SECRET" not in str(caught.value) and "line" in str(caught.value)

"""Shared system prompts under cache isolation (frontends/common/shared_prefixes.py and the key file's
`shared_prefixes:`) without a model: how many leading tokens are shared, and what the gate hands the engine."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from mlxhost.config import SecurityConfig
from mlxhost.frontends.app import create_app
from mlxhost.frontends.common.keys import KeyPolicy, KeyRing, parse_shared_prefixes
from mlxhost.frontends.common.security import install_security
from mlxhost.frontends.common.shared_prefixes import SharedPrefixes
from tests.frontends.fake_models import NAME, FakeModels, RecordingTokenizer

SHARED = "You are the team's assistant."


class PlainTokenizer(RecordingTokenizer):
    chat_template = None  # a base model: the transcript form


def test_the_shared_part_is_the_longest_common_prefix_with_a_form_of_the_text():
    shared, tok = SharedPrefixes((SHARED, "Another prompt.")), RecordingTokenizer()
    chat = tok.apply_chat_template([{"role": "system", "content": SHARED}, {"role": "user", "content": "hi"}])
    assert shared.num_shared_tokens(NAME, tok, tok.encode(chat)) == len(f"system: {SHARED}\nuser: ")
    assert shared.num_shared_tokens(NAME, tok, tok.encode(SHARED + " Go on.")) == len(SHARED)  # a completion
    assert shared.num_shared_tokens(NAME, tok, tok.encode("Something else entirely")) == 0
    base = PlainTokenizer()
    assert shared.num_shared_tokens("base", base, base.encode(f"system: {SHARED}\nuser: hi\n")) == \
        len(f"system: {SHARED}\n")
    assert SharedPrefixes(()).num_shared_tokens(NAME, tok, tok.encode(SHARED)) == 0 and not SharedPrefixes(())


def test_the_key_file_lists_texts_and_files(tmp_path):
    (tmp_path / "system.txt").write_text("From a file.")
    text = "keys: []\nshared_prefixes:\n  - Inline text.\n  - {file: system.txt}\n"
    assert parse_shared_prefixes(text, str(tmp_path)) == ("Inline text.", "From a file.")
    assert parse_shared_prefixes("keys: []\n") == ()
    for bad in ("shared_prefixes: text", "shared_prefixes: [{file: missing.txt}]", "shared_prefixes: ['']",
                "shared_prefixes: [3]"):
        with pytest.raises(ValueError, match="shared_prefixes"):
            parse_shared_prefixes(bad, str(tmp_path))


def test_only_a_grant_with_a_cache_group_carries_the_shared_prefixes(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - {{key: sk-a, name: a}}\nshared_prefixes: [{SHARED!r}]\n")
    policy = KeyPolicy(key="sk-a", name="a")
    assert KeyRing(str(path), cache_isolation="none").grant(policy).shared is None
    ring = KeyRing(str(path), cache_isolation="key")
    assert ring.grant(policy).shared.texts == (SHARED,)
    path.write_text("keys:\n  - {key: sk-a, name: a}\n")
    assert ring.reload() and ring.grant(policy).shared is None


def test_the_gate_sets_the_shared_tokens_on_the_engine_request(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - {{key: sk-a, name: a}}\nshared_prefixes: [{SHARED!r}]\n")
    models = FakeModels()
    app = create_app(models)
    install_security(app, SecurityConfig(api_key_file=str(path), allowed_hosts=("testserver",),
                                         cache_isolation="key"), "127.0.0.1")
    client = TestClient(app)

    def chat(system: str):
        resp = client.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-a"}, json={
            "model": NAME, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]})
        assert resp.status_code == 200
        return models.engine.requests[-1]

    request = chat(SHARED)
    assert request.cache_group == "key:a"
    assert request.num_shared_prefix_tokens == len(f"system: {SHARED}\nuser: ")
    assert request.block_key_spans[0][0] == request.num_shared_prefix_tokens  # the group's span starts there
    assert chat("Keep this to yourself.").num_shared_prefix_tokens == len("system: ")  # the template's tokens only

"""Several models in one server: routing by `model`, load on first use, LRU unloading under a small
budget (max 2 loaded), a pinned model that is never unloaded, ttl, /v1/models load states, 404 for
unknown names; greedy outputs identical to single-model servers, also with two models streaming at
once (two engine threads running MLX side by side), and the memory of an unloaded model given back.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import mlx.core as mx
import openai
import pytest

from mlxhost.config import EngineConfig, ModelSpec, ServerConfig
from mlxhost.server.app import build_app
from mlxhost.testing.demo import DemoModelConfig, build_model_folder

PROMPTS = ["The quick brown fox", "In the morning the teacher opens the window and"]
MAX_TOKENS = 24
LONG_TOKENS = 160  # long enough that two concurrent streams overlap
_WAIT_S = 60  # a bound for polling loops, not a timing check

ENGINE = dict(max_num_seqs=4, prefill_step_size=64)


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory):
    # A third model, another seed and a wider shape: ~10 MB of weights, easy to see in MLX's counters.
    return build_model_folder(tmp_path_factory.mktemp("qwen3-wide"),
                              DemoModelConfig(seed=2, hidden_size=256, intermediate_size=768))


@pytest.fixture(scope="module")
def dirs(qwen3_model_dir, llama_model_dir, big_model_dir):
    return {"a": qwen3_model_dir, "b": llama_model_dir, "c": big_model_dir}


def _complete(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def refs(dirs, make_module_server):
    """Greedy outputs of single-model servers: {(model, prompt, max_tokens): text}."""
    out = {}
    for name, path in dirs.items():
        live = make_module_server(path, **ENGINE)
        with _client(live) as client:
            for prompt in PROMPTS:
                out[name, prompt, MAX_TOKENS] = _complete(client, "tiny", prompt)
            out[name, PROMPTS[0], LONG_TOKENS] = _complete(client, "tiny", PROMPTS[0], LONG_TOKENS)
        live.stop()  # one at a time (stopping again at the module's end is harmless)
    return out


def _multi_app(dirs, **server_kwargs):
    specs = (ModelSpec("a", str(dirs["a"]), pinned=True, aliases=("alpha",)),
             ModelSpec("b", str(dirs["b"])),
             ModelSpec("c", str(dirs["c"]), ttl_s=server_kwargs.pop("c_ttl", None)))
    return build_app(ServerConfig(models=specs, engine=EngineConfig(**ENGINE), **server_kwargs))


@pytest.fixture(scope="module")
def multi(dirs, refs, serve_module_app):  # refs first: the single-model servers have stopped
    live = serve_module_app(_multi_app(dirs, max_loaded_models=2))
    live.initial_cards = httpx.get(live.url + "/v1/models", timeout=30).json()["data"]
    return live


def _states(live) -> dict[str, str]:
    return {c["id"]: c["status"] for c in httpx.get(live.url + "/v1/models", timeout=30).json()["data"]}


def test_models_lists_every_configured_model_with_its_state(multi):
    cards = {c["id"]: c for c in multi.initial_cards}
    assert {n: c["status"] for n, c in cards.items()} == {"a": "loaded", "b": "not_loaded", "c": "not_loaded"}
    assert cards["a"]["pinned"] and not cards["b"]["pinned"]
    assert cards["a"]["max_model_len"] == 4096 and cards["b"]["max_model_len"] is None
    assert "alpha" in cards["a"]["aliases"] and cards["c"]["weight_bytes"] > cards["a"]["weight_bytes"] > 0


def test_unknown_model_is_404_naming_the_served_models(multi):
    with _client(multi) as client, pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    err = info.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert all(f"`{n}`" in err["message"] for n in ("nope", "a", "b", "c"))
    r = httpx.get(multi.url + "/v1/status", params={"model": "nope"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_lru_unload_pinned_kept_and_outputs_identical(multi, refs):
    with _client(multi) as client:
        # a (pinned) is the least recently used when c comes, so b goes: max 2 loaded.
        for name in ("a", "b", "c"):
            for prompt in PROMPTS:
                assert _complete(client, name, prompt) == refs[name, prompt, MAX_TOKENS], (name, prompt)
        assert _states(multi) == {"a": "loaded", "b": "not_loaded", "c": "loaded"}
        # b again: c goes (a stays pinned); b reloaded answers exactly as before.
        assert _complete(client, "b", PROMPTS[0]) == refs["b", PROMPTS[0], MAX_TOKENS]
        assert _states(multi) == {"a": "loaded", "b": "loaded", "c": "not_loaded"}
        assert _complete(client, "alpha", PROMPTS[1]) == refs["a", PROMPTS[1], MAX_TOKENS]


def test_two_models_stream_at_once_token_identical(multi, refs):
    """Two engine threads run MLX at the same time (each its own default stream in MLX 0.32)."""
    order: list[str] = []

    async def stream(client, name):
        parts = []
        s = await client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=LONG_TOKENS, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        async for chunk in s:
            if chunk.choices and chunk.choices[0].text:
                parts.append(chunk.choices[0].text)
                order.append(name)
        return "".join(parts)

    async def main():
        async with openai.AsyncOpenAI(base_url=multi.base_url, api_key="x", max_retries=0, timeout=120) as c:
            for name in ("a", "b"):  # both loaded before the race starts
                await c.completions.create(model=name, prompt="x", max_tokens=1)
            return await asyncio.gather(stream(c, "a"), stream(c, "b"), stream(c, "a"), stream(c, "b"))

    texts = asyncio.run(main())
    assert texts == [refs[n, PROMPTS[0], LONG_TOKENS] for n in ("a", "b", "a", "b")]
    # The streams overlapped: b's tokens arrived between a's first and last.
    first_a, last_a = order.index("a"), len(order) - 1 - order[::-1].index("a")
    assert "b" in order[first_a:last_a]


def test_status_and_cache_endpoints_take_a_model(multi):
    with _client(multi) as client:
        _complete(client, "a", PROMPTS[0])
    body = httpx.get(multi.url + "/v1/status", timeout=30).json()
    assert set(body["models"]) == {"a", "b", "c"}
    assert "budget" in body["models"]["a"]
    one = httpx.get(multi.url + "/v1/status", params={"model": "a"}, timeout=30).json()
    assert "budget" in one and "models" not in one
    not_loaded = [n for n, s in _states(multi).items() if s == "not_loaded"]
    assert httpx.get(multi.url + "/v1/cache/stats", params={"model": not_loaded[0]}, timeout=30).json() == \
        {"model": not_loaded[0], "status": "not_loaded"}
    cleared = httpx.delete(multi.url + "/v1/cache", timeout=30).json()
    assert set(cleared["models"]) == {"a", "b", "c"} and cleared["cleared_blocks"] >= 1
    metrics = httpx.get(multi.url + "/metrics", timeout=30).text
    assert "mlxhost_num_requests_running" in metrics


def test_ttl_unloads_idle_model_and_its_memory_comes_back(dirs, refs, multi, serve_module_app):
    # Its own server (the module one stays up but idle): a pinned, c with a ttl of 10 s, so
    # the reading just after its request still finds it loaded.
    live = serve_module_app(_multi_app(dirs, c_ttl=10.0))
    with _client(live) as client:
        _complete(client, "a", PROMPTS[0])
        httpx.delete(live.url + "/v1/cache", timeout=30)
        before = mx.get_active_memory()
        assert _complete(client, "c", PROMPTS[0]) == refs["c", PROMPTS[0], MAX_TOKENS]
        loaded = mx.get_active_memory()
        cards = httpx.get(live.url + "/v1/models", timeout=30).json()["data"]
        assert _states(live)["c"] == "loaded"
        weights = next(c["weight_bytes"] for c in cards if c["id"] == "c")
        deadline = time.monotonic() + _WAIT_S
        while _states(live)["c"] != "not_loaded" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _states(live) == {"a": "loaded", "b": "not_loaded", "c": "not_loaded"}
        after = mx.get_active_memory()
        assert loaded - before >= 0.9 * weights
        assert after - before < 0.1 * weights, (before, loaded, after, weights)
        assert mx.get_cache_memory() < 0.5 * weights  # and not kept in MLX's buffer cache either
        # Requested again: loads again, same answer.
        assert _complete(client, "c", PROMPTS[0]) == refs["c", PROMPTS[0], MAX_TOKENS]


def test_no_room_is_503_with_retry_after(dirs, serve_module_app):
    # One model at most and the pinned one takes it: b can never load.
    specs = (ModelSpec("a", str(dirs["a"]), pinned=True), ModelSpec("b", str(dirs["b"])))
    live = serve_module_app(build_app(ServerConfig(models=specs, engine=EngineConfig(**ENGINE), max_loaded_models=1)))
    r = httpx.post(live.url + "/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["code"] == "model_unavailable" and "pinned" in r.json()["error"]["message"]
    assert _states(live) == {"a": "loaded", "b": "not_loaded"}

"""The prefix cache over HTTP: usage.prompt_tokens_details.cached_tokens, /v1/cache/stats, DELETE /v1/cache,
the Prometheus counters, and a server with the cache off giving the same text."""

from __future__ import annotations

import httpx
import openai
import pytest

BS = 16
MAX_TOKENS = 8
# Long enough for several full blocks of 16 tokens once the chat template is applied.
SYSTEM = ("You are a careful assistant. Answer in one short sentence, mention the river and the mountains, "
          "and never repeat the question back to the user.")


@pytest.fixture(scope="module")
def servers(qwen3_model_dir, make_module_server):
    on = make_module_server(qwen3_model_dir, block_size=BS, cache_memory_bytes=16 << 20, max_num_seqs=8)
    off = make_module_server(qwen3_model_dir, block_size=BS, enable_prefix_cache=False, max_num_seqs=8)
    return on, off


@pytest.fixture(scope="module")
def on(servers):
    return servers[0]


@pytest.fixture(scope="module")
def off(servers):
    return servers[1]


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def on_client(on):
    with _client(on) as c:
        yield c


@pytest.fixture(scope="module")
def off_client(off):
    with _client(off) as c:
        yield c


def chat(client: openai.OpenAI, question: str, stream: bool = False) -> tuple[str, int, int]:
    """(text, prompt_tokens, cached_tokens) of a greedy chat completion."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    kw = dict(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0)
    if stream:
        text, usage = "", None
        for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
    else:
        resp = client.chat.completions.create(**kw)
        text, usage = resp.choices[0].message.content, resp.usage
    return text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def stats(live) -> dict:
    r = httpx.get(live.url + "/v1/cache/stats", timeout=30)
    assert r.status_code == 200
    return r.json()


def clear(live) -> dict:
    r = httpx.delete(live.url + "/v1/cache", timeout=30)
    assert r.status_code == 200
    return r.json()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_same_chat_twice_hits_and_answers_the_same(on_client, stream):
    question = f"Where does the river go after the mountains? ({'stream' if stream else 'whole'})"
    text1, prompt1, cached1 = chat(on_client, question, stream)
    text2, prompt2, cached2 = chat(on_client, question, stream)
    assert prompt1 == prompt2 > 2 * BS
    assert cached2 > 0 and cached2 % BS == 0 and cached2 < prompt2
    assert text2 == text1 and text1


def test_cache_stats_fields(on, on_client):
    chat(on_client, "What is the tallest mountain near the valley?")
    chat(on_client, "What is the tallest mountain near the valley?")
    s = stats(on)
    assert s["enabled"] is True and s["block_size"] == BS
    for key in ("num_blocks", "num_cached_blocks", "num_used_blocks", "queried_tokens", "hit_tokens", "hit_rate",
                "evictions", "memory_bytes"):
        assert key in s, key
    assert s["num_blocks"] >= s["num_cached_blocks"] > 0
    assert s["queried_tokens"] > s["hit_tokens"] > 0
    assert s["hit_rate"] == pytest.approx(s["hit_tokens"] / s["queried_tokens"])
    assert s["memory_bytes"] > 0 and s["memory_bytes"] % s["num_cached_blocks"] == 0
    assert s["num_used_blocks"] == 0  # nothing running


def test_delete_clears_the_cache(on, on_client):
    question = "Tell me about the small towns by the river, the valley, the old bridge and the mill."
    # DELETE right after a request: the engine is idle and that request's blocks were the last stored
    # (no other call in between, which would run a step).
    text, _, _ = chat(on_client, question)
    assert clear(on)["cleared_blocks"] > 0
    s = stats(on)
    assert s["num_cached_blocks"] == 0 and s["memory_bytes"] == 0
    again, _, cached = chat(on_client, question)
    assert cached == 0 and again == text
    assert chat(on_client, question)[2] > 0  # and it fills again


def test_metrics_count_hit_tokens(on, on_client):
    question = "Which book did the old man read?"
    chat(on_client, question)
    chat(on_client, question)
    m = on.metrics()
    assert m["mlxhost_prefix_cache_hit_tokens_total"] > 0
    assert m["mlxhost_prefix_cache_queried_tokens_total"] >= m["mlxhost_prefix_cache_hit_tokens_total"]
    assert m["mlxhost_prefix_cache_blocks"] == stats(on)["num_cached_blocks"] > 0


def test_cache_off_gives_the_same_text_and_no_cached_tokens(on_client, off, off_client):
    question = "What did the young engineer write that evening?"
    on_text = chat(on_client, question)[0]
    for stream in (False, True):
        text, _, cached = chat(off_client, question, stream)
        assert (text, cached) == (on_text, 0)
    assert stats(off) == {"enabled": False}
    assert clear(off) == {"cleared_blocks": 0}
    m = off.metrics()
    assert m["mlxhost_prefix_cache_hit_tokens_total"] == 0 and m["mlxhost_prefix_cache_blocks"] == 0

"""Speculative decoding over HTTP: the same greedy text as a server without it (streamed and not, with
stop strings, logprobs and 16 concurrent clients), prefix-cache hits with speculation on, and the
counters in /v1/status and /metrics."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

PROMPT = "Repeat after me: the river runs past the old mill, the river runs past the old mill, the river"


@pytest.fixture(scope="module")
def servers(qwen3_model_dir, make_module_server):
    kw = dict(block_size=16, cache_memory_bytes=16 << 20, max_num_seqs=16)
    return {
        "off": make_module_server(qwen3_model_dir, **kw),
        "ngram": make_module_server(qwen3_model_dir, speculative="ngram", **kw),
        "draft": make_module_server(qwen3_model_dir, draft_model=str(qwen3_model_dir), num_draft_tokens=5, **kw),
    }


def _client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120)


def _chat(live, content: str, **kw):
    with _client(live) as c:
        return c.chat.completions.create(model=live.model_name, messages=[{"role": "user", "content": content}],
                                         temperature=0, **{"max_tokens": 32, **kw})


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_same_text_stop_strings_and_logprobs(servers, mode):
    base = _chat(servers["off"], PROMPT, logprobs=True, top_logprobs=2)
    got = _chat(servers[mode], PROMPT, logprobs=True, top_logprobs=2)
    text = base.choices[0].message.content
    assert got.choices[0].message.content == text
    a, b = got.choices[0].logprobs.content, base.choices[0].logprobs.content
    assert [t.token for t in a] == [t.token for t in b]
    assert [t.logprob for t in a] == pytest.approx([t.logprob for t in b], abs=1e-4)
    assert got.usage.completion_tokens == base.usage.completion_tokens
    # A stop string from the middle of the text: the same cut, and the tokens after it not counted.
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    cut = _chat(servers[mode], PROMPT, stop=[stop])
    ref = _chat(servers["off"], PROMPT, stop=[stop])
    assert cut.choices[0].message.content == ref.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == ref.usage.completion_tokens
    # Streaming gives the same text.
    with _client(servers[mode]) as c:
        stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                           temperature=0, max_tokens=32, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == text


def test_16_concurrent_clients(servers):
    prompts = [f"{PROMPT} {i} " * (1 + i % 3) if i % 2 else f"Tell me about number {i}" for i in range(16)]

    def texts(live):
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda p: _chat(live, p, max_tokens=12 + p.count(" ") % 9).choices[0].message.content,
                                 prompts))

    base = texts(servers["off"])
    assert texts(servers["draft"]) == base
    assert texts(servers["ngram"]) == base


def test_prefix_cache_hits_with_speculation(servers):
    live = servers["draft"]
    first = _chat(live, PROMPT + " once more", max_tokens=40)
    again = _chat(live, PROMPT + " once more", max_tokens=40)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_counters_in_status_and_metrics(servers):
    _chat(servers["draft"], PROMPT)
    body = httpx.get(f"{servers['draft'].url}/v1/status", timeout=30).json()
    spec = body["speculative"]
    assert spec["mode"] == "draft" and spec["num_draft_tokens"] == 5 and spec["spec_max_batch"] == 4
    assert spec["num_accepted"] == spec["num_drafted"] > 0 and spec["acceptance_rate"] == 1.0
    metrics = servers["draft"].metrics()
    assert metrics["mlxhost_spec_draft_tokens_total"] >= spec["num_drafted"] > 0
    assert metrics["mlxhost_spec_acceptance_rate"] == 1.0
    assert metrics["mlxhost_spec_max_batch"] == 4 and "mlxhost_spec_big_batch_steps_total" in metrics
    off = httpx.get(f"{servers['off'].url}/v1/status", timeout=30).json()
    assert off["speculative"] == {"mode": "off"}
    assert servers["off"].metrics()["mlxhost_spec_draft_tokens_total"] == 0
    assert servers["off"].metrics()["mlxhost_spec_max_batch"] == 0

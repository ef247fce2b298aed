"""Tensor- and pipeline-parallel serving, 2 ranks over the ring backend on loopback: greedy output
token-identical to a single process (alone and 8 concurrent), a prefix-cache hit, and the same shards
on both ranks (start-up check). The faults are in test_distributed_faults.py."""

from __future__ import annotations

import asyncio

import httpx
import mlx_lm
import openai
import pytest
from mlx_lm.sample_utils import make_sampler

from tests.distributed.conftest import SERVED_NAME, start_dist_server

MAX_NEW = 16
PROMPT_LENS = [3, 9, 17, 24, 33, 40, 47, 55]  # over --prefill-step-size 16: prefilled in chunks
TEXT = ("The quick brown fox jumps over the lazy dog while the old man reads a long book about rivers, mountains "
        "and the history of small towns. In the morning the teacher opens the window and the students write. ")
FLAGS = ("--prefill-step-size", "16", "--block-size", "16", "--max-num-seqs", "8", "--cache-memory", "64MB",
         "--distributed-timeout", "60")


def _references(model_dir) -> tuple[list[list[int]], list[list[str]]]:
    model, tokenizer = mlx_lm.load(str(model_dir))
    ids = tokenizer.encode(TEXT * 2)
    prompts = [ids[i : i + n] for i, n in enumerate(PROMPT_LENS)]
    refs = []
    for p in prompts:
        out = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt=p, max_tokens=MAX_NEW,
                                                        sampler=make_sampler(temp=0.0))]
        refs.append([tokenizer.decode([t]) for t in out])
    return prompts, refs


# (model fixture, flags): TP over the tiny Qwen3; PP over the tiny Qwen2 with send/recv between stages (the
# ring's default); PP over the tiny Qwen3 with one all-gather per stage, the hand-off NCCL runs (it has no
# send/recv), forced on the ring so it is tested without GPUs.
LAYOUTS = {"tensor": ("qwen3_model_dir", ("--tensor-parallel", "2")),
           "pipeline": ("qwen2_model_dir", ("--pipeline-parallel", "2")),
           "pipeline-gather": ("qwen3_model_dir", ("--pipeline-parallel", "2", "--pipeline-handoff", "gather"))}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def dist(request, tmp_path_factory):
    """(server, prompts, reference per-token strings) of each layout."""
    fixture, flags = LAYOUTS[request.param]
    model_dir = request.getfixturevalue(fixture)
    prompts, refs = _references(model_dir)
    server = start_dist_server(model_dir, tmp_path_factory.mktemp("dist"), *flags, *FLAGS)
    yield server, prompts, refs
    server.stop()


def _complete(client, prompt, **kw):
    r = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0,
                                  logprobs=1, **kw)
    return r


def test_alone_matches_single_process(dist):
    server, prompts, refs = dist
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
        for prompt, ref in zip(prompts, refs):
            r = _complete(client, prompt)
            assert r.choices[0].logprobs.tokens == ref


@pytest.mark.anyio
async def test_8_concurrent_match_single_process(dist):
    server, prompts, refs = dist

    async def one(client, prompt):
        stream = await client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=MAX_NEW,
                                                 temperature=0.0, logprobs=1, stream=True)
        tokens = []
        async for chunk in stream:
            for ch in chunk.choices:
                if ch.logprobs is not None:
                    tokens += ch.logprobs.tokens
        return tokens

    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
        results = await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in prompts)), timeout=180)
    assert results == refs


def test_prefix_cache_hit(dist):
    server, prompts, refs = dist
    longest = prompts[-1]  # 55 tokens: 3 full blocks of 16 are cached after the first request
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
        first = _complete(client, longest)
        second = _complete(client, longest)
    assert second.usage.prompt_tokens_details.cached_tokens >= 48
    assert first.choices[0].logprobs.tokens == second.choices[0].logprobs.tokens == refs[-1]
    status = httpx.get(server.url + "/v1/status", timeout=30).json()
    assert status["prefix_cache"]["hit_tokens"] >= 48
    assert status["distributed"]["world_size"] == 2 and status["distributed"]["num_steps"] > 0


def test_seeded_sampling_is_the_same_on_every_rank(dist):
    """Random sampling: the ranks must draw the same tokens (a rank that drew others would stop the
    server, see engine.DivergenceError), and a seeded request repeats."""
    server, prompts, _ = dist
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
        runs = [client.completions.create(model=SERVED_NAME, prompt=prompts[3], max_tokens=MAX_NEW, temperature=1.0,
                                          seed=7).choices[0].text for _ in range(2)]
        unseeded = client.completions.create(model=SERVED_NAME, prompt=prompts[2], max_tokens=MAX_NEW,
                                             temperature=1.0)
    assert runs[0] == runs[1]
    assert unseeded.choices[0].finish_reason in ("length", "stop")
    assert server.proc.poll() is None, server.log()


def test_ssd_tier_keeps_each_ranks_shard_across_restarts(qwen3_model_dir, tmp_path):
    """Each rank writes its own shard of every block under its own folder; after a restart the same
    prompt is a hit read back from disk on both ranks (a rank missing its shard would stop the server)."""
    ssd = tmp_path / "ssd"
    flags = ("--tensor-parallel", "2", "--block-size", "16", "--ssd-cache-dir", str(ssd))
    prompt = list(range(100, 147))  # 47 tokens: 2 full blocks before the last token
    answers = []
    for run in range(2):
        server = start_dist_server(qwen3_model_dir, tmp_path / f"run{run}", *flags)
        try:
            with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
                answers.append(_complete(client, prompt))
        finally:
            server.stop()
        assert server.proc.returncode == 0, server.log()
    assert answers[0].usage.prompt_tokens_details.cached_tokens == 0
    assert answers[1].usage.prompt_tokens_details.cached_tokens == 32
    assert answers[0].choices[0].logprobs.tokens == answers[1].choices[0].logprobs.tokens
    assert sorted(p.name for p in ssd.iterdir()) == ["tp2-rank0", "tp2-rank1"]


def test_cache_clear_reaches_every_rank(dist):
    """DELETE /v1/cache between steps keeps the ranks in step: rank 0 evicts, the other rank drops the
    same blocks with the next step's plan (replay: test_units.py), and the next request recomputes
    the prompt on both with the same tokens."""
    server, prompts, refs = dist
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
        _complete(client, prompts[-2])
        assert httpx.delete(server.url + "/v1/cache", timeout=30).status_code == 200
        again = _complete(client, prompts[-2])
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].logprobs.tokens == refs[-2]
    assert server.proc.poll() is None, server.log()

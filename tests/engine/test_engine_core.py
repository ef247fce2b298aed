"""The engine core on the tiny fixture model: a failing step, aborts, and outputs."""

from __future__ import annotations

import logging

import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


@pytest.fixture
def core(loaded):
    return EngineCore(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=4), max_model_len=4096)


def run(core: EngineCore, requests: list[Request], max_steps: int = 1000) -> dict[str, list]:
    for r in requests:
        core.add_request(r)
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not core.has_work:
            return outputs
        for out in core.step():
            outputs[out.request_id].append(out)
    raise AssertionError("the engine did not finish")


def sampled(rid: str, **kw) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(**{"max_tokens": 4, "temperature": 1.0, "ignore_eos": True, **kw}))


def test_outputs_carry_tokens_and_counts(core):
    outs = run(core, [sampled("a", temperature=0.0)])["a"]
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4]
    assert all(len(o.new_token_ids) == 1 and o.num_prompt_tokens == 3 for o in outs)
    assert [o.finish_reason for o in outs] == [None, None, None, "length"]


def test_sampling_still_works_after_a_failed_step(core, caplog):
    # A top_k the sampler rejects (the API clamps it; the engine gets it raw here) fails the step inside
    # an mx.compile'd function. Later unseeded sampling must not inherit a broken mx.random state.
    with caplog.at_level(logging.CRITICAL, logger="mlxhost.engine.core"):
        failed = run(core, [sampled("bad", top_k=10**6)])["bad"]
    assert failed and failed[-1].error
    after = run(core, [sampled("good")])["good"]
    assert [o.error for o in after] == [None] * 4
    assert after[-1].finish_reason == "length"


def test_abort_running_request_frees_it(core):
    core.add_request(sampled("long", max_tokens=1000))
    core.add_request(sampled("short", max_tokens=8))
    for _ in range(3):
        core.step()
    core.abort("long")
    after = []
    for _ in range(100):
        if not core.has_work:
            break
        after += core.step()
    assert {o.request_id for o in after} == {"short"}
    assert after[-1].finish_reason == "length" and after[-1].num_output_tokens == 8
    assert core.scheduler.num_running == 0 and not core.has_work


def test_warmup_leaves_nothing_behind(loaded):
    """Warm-up steps the batch through its bucket sizes and traffic's paths (joins of unequal prompts, a
    split prompt, block stores, prefix hits), then leaves no request, block or hit count behind, and
    a request afterwards decodes exactly as on a core that never warmed up."""
    import mlxhost.engine.runner.prefill as runner_module
    from mlxhost.engine.runner.batch import make_buckets

    config = EngineConfig(max_num_seqs=8, block_size=16, prefill_step_size=48)
    warmed = EngineCore(loaded.model, loaded.tokenizer, config, 4096, make_buckets(8))
    together: list[int] = []
    real = runner_module.prefill_rows
    runner_module.prefill_rows = lambda model, caches, chunks, **kw: together.append(len(chunks)) or real(model, caches, chunks, **kw)
    try:
        warmed.warmup(8)
    finally:
        runner_module.prefill_rows = real
    assert max(together) == config.max_num_prefill_rows  # a batched prefill as wide as traffic's
    assert not warmed.has_work and warmed.runner.num_rows == 0
    stats = warmed.cache_stats()
    assert stats["num_cached_blocks"] == 0 and stats["queried_tokens"] == 0 and stats["hit_tokens"] == 0
    assert stats["evictions"] > 0  # it did store blocks (cleared afterwards)

    def tokens(core):
        prompt = list(range(3, 60))
        outs = run(core, [Request("after", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))])
        return [t for o in outs["after"] for t in o.new_token_ids]

    fresh = EngineCore(loaded.model, loaded.tokenizer, config, 4096, make_buckets(8))
    assert tokens(warmed) == tokens(fresh)


def test_lone_row_decodes_through_a_plain_kv_cache(loaded):
    """A batch of one plain-KV row runs on mlx-lm's KVCache (no padding mask, one rope offset), goes back
    to a batch cache when a second request joins and back again when it is alone; the tokens are those
    of mlx-lm's generate_step throughout."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import BatchKVCache, KVCache

    core = EngineCore(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=4, enable_prefix_cache=False), 4096)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    first, second = list(range(5, 30)), list(range(40, 52))
    core.add_request(Request("first", first, greedy))
    got: dict[str, list[int]] = {"first": [], "second": []}
    kinds = []
    for step in range(200):
        if not core.has_work:
            break
        if step == 6:
            core.add_request(Request("second", second, SamplingParams(max_tokens=8, temperature=0.0,
                                                                      ignore_eos=True)))
        for out in core.step():
            got[out.request_id] += out.new_token_ids
        cache = core.runner.batch.cache
        kinds.append(type(cache[0]) if cache else None)
    assert kinds[1] is KVCache  # alone
    assert BatchKVCache in kinds  # while the second request ran
    assert kinds.index(BatchKVCache) < len(kinds) - 1 - kinds[::-1].index(KVCache)  # alone again afterwards

    def reference(prompt, n):
        return [int(t) for t, _ in zip((tok for tok, _ in generate_step(mx.array(prompt), loaded.model)), range(n))]

    assert got["first"] == reference(first, 24)
    assert got["second"] == reference(second, 8)

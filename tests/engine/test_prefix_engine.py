"""The prefix cache inside the engine core, on the tiny fixture model: greedy tokens are identical with
the cache on, with it off and through mlx-lm's own `generate_step`, whether a prompt hits, shares a
prefix with a batch, diverges inside a block, continues an earlier answer or fights a tiny cache."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model

BS = 16
MAX_NEW = 8


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


@pytest.fixture(scope="module")
def block_bytes(loaded) -> int:
    """Bytes of one block's keys and values over all layers, measured independently of the engine."""
    cache = make_prompt_cache(loaded.model)
    loaded.model(mx.array([[1] * BS]), cache=cache)
    mx.eval([c.state for c in cache])
    return sum(c.keys[..., :BS, :].nbytes + c.values[..., :BS, :].nbytes for c in cache)


@pytest.fixture(scope="module")
def reference(loaded):
    """Greedy continuation of a prompt by mlx-lm alone, memoized per (prompt, max_tokens)."""
    memo: dict[tuple, list[int]] = {}

    def ref(prompt: list[int], max_tokens: int = MAX_NEW) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in memo:
            steps = generate_step(mx.array(prompt), loaded.model, max_tokens=max_tokens, sampler=make_sampler(temp=0.0))
            memo[key] = [int(t) for t, _ in steps]
        return memo[key]

    return ref


def make_core(loaded, **kw) -> EngineCore:
    config = EngineConfig(**{"max_num_seqs": 16, "block_size": BS, "cache_memory_bytes": 64 << 20, **kw})
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="qwen3-fixture")


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def drain(core: EngineCore) -> dict[str, dict]:
    """Steps to the end: {rid: {"ids": [...], "cached": n}} for every request that produced output."""
    out: dict[str, dict] = {}
    for _ in range(10_000):
        if not core.has_work:
            break
        for o in core.step():
            assert o.error is None, o.error
            entry = out.setdefault(o.request_id, {"ids": [], "cached": set()})
            entry["ids"] += o.new_token_ids
            entry["cached"].add(o.num_cached_tokens)
    else:
        raise AssertionError("the engine did not finish")
    for rid, o in out.items():
        assert len(o["cached"]) == 1, f"{rid}: num_cached_tokens changed between outputs: {o['cached']}"
        o["cached"] = o["cached"].pop()
    return out


def run(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int = MAX_NEW) -> dict[str, dict]:
    """Adds every prompt at once and steps to the end."""
    for rid, prompt in prompts.items():
        core.add_request(Request(rid, prompt, greedy(max_tokens)))
    out = drain(core)
    assert set(out) == set(prompts)
    return out


def one(core: EngineCore, prompt: list[int], max_tokens: int = MAX_NEW) -> dict:
    return run(core, {"r": prompt}, max_tokens)["r"]


def check_memory(core: EngineCore, block_bytes: int) -> dict:
    stats = core.cache_stats()
    assert stats["enabled"] is True
    assert stats["memory_bytes"] == stats["num_cached_blocks"] * block_bytes
    return stats


def test_a_repeated_prompt_hits_and_gives_the_same_tokens(loaded, reference, block_bytes):
    prompt = tokens(1, 40)
    on, off = make_core(loaded), make_core(loaded, enable_prefix_cache=False)
    first, second = one(on, prompt), one(on, prompt)
    assert first["cached"] == 0 and second["cached"] == 2 * BS
    assert first["ids"] == second["ids"] == one(off, prompt)["ids"] == reference(prompt)
    stats = check_memory(on, block_bytes)
    # 40 prompt + 8 output tokens: three full blocks stored by the first run, none new by the second.
    assert stats["num_cached_blocks"] == 3
    assert stats["hit_tokens"] == 2 * BS and stats["queried_tokens"] == 80
    assert off.cache_stats() == {"enabled": False}


def test_cache_off_reports_no_cached_tokens(loaded, reference):
    off = make_core(loaded, enable_prefix_cache=False)
    prompt = tokens(2, 40)
    assert [one(off, prompt)["cached"] for _ in range(2)] == [0, 0]
    off_by_size = make_core(loaded, cache_memory_bytes=0)
    assert off_by_size.cache_stats() == {"enabled": False}
    assert one(off_by_size, prompt) == {"ids": reference(prompt), "cached": 0}


@pytest.mark.parametrize("kw", [{}, {"prefill_step_size": 20, "decode_buckets": "on"}],
                         ids=["plain", "chunked-buckets"])
def test_concurrent_requests_sharing_a_prefix(loaded, reference, block_bytes, kw):
    shared = tokens(3, 2 * BS + 5)  # two full blocks, then part of a third
    core = make_core(loaded, **kw)
    warm = one(core, shared + tokens(4, 3))
    assert warm["ids"] == reference(shared + tokens(4, 3))
    prompts = {f"r{i}": shared + tokens(10 + i, 1 + 5 * i) for i in range(8)}
    outs = run(core, prompts)
    for rid, prompt in prompts.items():
        assert outs[rid]["ids"] == reference(prompt), rid
        assert outs[rid]["cached"] == 2 * BS, rid
    stats = check_memory(core, block_bytes)
    assert stats["hit_tokens"] == 8 * 2 * BS


def test_cold_concurrent_requests_with_one_prompt_store_its_blocks_once(loaded, reference, block_bytes):
    core = make_core(loaded)
    core.scheduler.wait_for_inflight = False  # all four prefill it side by side
    prompt = tokens(5, 3 * BS + 2)
    outs = run(core, {f"r{i}": prompt for i in range(4)})
    assert all(o == {"ids": reference(prompt), "cached": 0} for o in outs.values())
    # 50 + 8 tokens: three full blocks, all four rows identical, each stored once.
    assert check_memory(core, block_bytes)["num_cached_blocks"] == 3
    assert one(core, prompt)["cached"] == 3 * BS


def test_requests_diverging_inside_a_shared_block(loaded, reference, block_bytes):
    core, off = make_core(loaded), make_core(loaded, enable_prefix_cache=False)
    head = tokens(6, BS + BS // 2)  # the same first 1.5 blocks
    a, b = head + tokens(7, 20), head + tokens(8, 20)
    out_a = one(core, a)
    out_b = one(core, b)
    assert out_b["cached"] == BS  # only the block both share completely
    assert out_a["ids"] == reference(a) == one(off, a)["ids"]
    assert out_b["ids"] == reference(b) == one(off, b)["ids"]
    assert out_a["ids"] != out_b["ids"]  # else this would not show the second block was recomputed
    # Both branches are now cached side by side: each hits its own second block.
    assert one(core, a + [9])["cached"] == 2 * BS
    assert one(core, b + [9])["cached"] == 2 * BS
    check_memory(core, block_bytes)


def test_prompt_of_exactly_whole_blocks(loaded, reference):
    core = make_core(loaded)
    prompt = tokens(9, 3 * BS)
    first, second = one(core, prompt), one(core, prompt)
    # Even though all three blocks are cached, the last one is recomputed for the first logits.
    assert (first["cached"], second["cached"]) == (0, 2 * BS)
    assert first["ids"] == second["ids"] == reference(prompt)
    # Its first two blocks serve a shorter prompt that is exactly those two blocks: one is a hit.
    short = prompt[: 2 * BS]
    assert one(core, short) == {"ids": reference(short), "cached": BS}


def test_follow_up_reuses_the_blocks_of_the_previous_answer(loaded, reference, block_bytes):
    core, off = make_core(loaded), make_core(loaded, enable_prefix_cache=False)
    prompt = tokens(11, 20)
    answer = one(core, prompt, max_tokens=40)
    assert answer["ids"] == reference(prompt, 40)
    # Multi-turn: the next prompt is the whole conversation so far plus a new message.
    follow = prompt + answer["ids"] + tokens(12, 10)
    out = one(core, follow, max_tokens=16)
    # 20 + 40 tokens of KV were stored: three full blocks, reaching well into the answer.
    assert out["cached"] == 3 * BS > len(prompt)
    assert out["ids"] == reference(follow, 16) == one(off, follow, max_tokens=16)["ids"]
    # And a third turn reuses the second answer's blocks in turn.
    third = follow + out["ids"] + tokens(13, 5)
    out3 = one(core, third)
    assert out3["cached"] == (len(follow) + 16) // BS * BS > len(follow)
    assert out3["ids"] == reference(third)
    check_memory(core, block_bytes)


def step_until(core: EngineCore, rid: str, num_tokens: int) -> list[int]:
    """Steps until request `rid` has emitted `num_tokens` tokens; returns them."""
    ids: list[int] = []
    for _ in range(10_000):
        for o in core.step():
            assert o.error is None, o.error
            if o.request_id == rid:
                ids += o.new_token_ids
        if len(ids) >= num_tokens:
            return ids
    raise AssertionError("the request did not get that far")


def test_a_generation_is_reusable_while_it_still_runs(loaded, reference, block_bytes):
    core = make_core(loaded)
    prompt = tokens(18, 20)
    core.add_request(Request("long", prompt, greedy(60)))
    so_far = step_until(core, "long", 40)
    # The blocks that filled while "long" decoded (at 32 and 48 tokens) serve a prompt that continues it,
    # admitted while "long" is still running.
    follow = prompt + so_far[:40] + tokens(19, 5)
    core.add_request(Request("follow", follow, greedy()))
    rest = drain(core)
    assert so_far + rest["long"]["ids"] == reference(prompt, 60)
    assert rest["follow"] == {"ids": reference(follow), "cached": 3 * BS}
    check_memory(core, block_bytes)


def test_an_aborted_generation_is_reusable(loaded, reference, block_bytes):
    core = make_core(loaded)
    prompt = tokens(20, 20)
    core.add_request(Request("long", prompt, greedy(1000)))
    so_far = step_until(core, "long", 30)
    core.abort("long")
    assert drain(core) == {}
    follow = prompt + so_far[:30] + tokens(21, 5)
    # 20 + 30 tokens of KV (and maybe one more in flight): three full blocks were stored.
    assert one(core, follow) == {"ids": reference(follow), "cached": 3 * BS}
    check_memory(core, block_bytes)


def test_tiny_cache_evicts_constantly_and_outputs_still_match(loaded, reference, block_bytes):
    core = make_core(loaded, cache_memory_bytes=4 * block_bytes + block_bytes // 2, prefill_step_size=24)
    assert core.cache_stats()["num_blocks"] == 4
    shared = tokens(14, BS + 3)
    for round_ in range(3):
        prompts = {f"{round_}-{i}": (shared if i % 2 else []) + tokens(100 * round_ + i, 10 + 7 * i) for i in range(6)}
        outs = run(core, prompts)
        for rid, prompt in prompts.items():
            assert outs[rid]["ids"] == reference(prompt), rid
        stats = check_memory(core, block_bytes)
        assert stats["num_cached_blocks"] <= 4
        # One at a time as well: each finished request's blocks push older ones out.
        for i in range(3):
            prompt = tokens(1000 + 10 * round_ + i, 2 * BS + 4)
            assert one(core, prompt)["ids"] == reference(prompt)
            again = one(core, prompt)
            assert again == {"ids": reference(prompt), "cached": 2 * BS}
    stats = check_memory(core, block_bytes)
    assert stats["evictions"] > 10 and stats["hit_tokens"] > 0


def test_clear_cache_drops_blocks_and_their_memory(loaded, reference, block_bytes):
    core = make_core(loaded)
    prompt = tokens(15, 2 * BS + 1)
    one(core, prompt)
    assert core.cache_stats()["num_cached_blocks"] == 2
    assert core.clear_cache() == 2
    core.step()  # the drops run with the next step's plan (the engine loop steps right after the call)
    stats = check_memory(core, block_bytes)
    assert stats["num_cached_blocks"] == 0 and stats["memory_bytes"] == 0
    assert one(core, prompt) == {"ids": reference(prompt), "cached": 0}
    assert one(core, prompt)["cached"] == 2 * BS


def test_a_failed_request_keeps_the_cache_and_releases_its_blocks(loaded, reference, block_bytes, caplog):
    core = make_core(loaded)
    prompt = tokens(16, 2 * BS + 1)
    one(core, prompt)
    # A top_k the sampler rejects (the API clamps it) makes the step fail inside the runner.
    bad = SamplingParams(max_tokens=4, temperature=1.0, top_k=10**6)
    core.add_request(Request("bad", prompt, bad))
    with caplog.at_level("CRITICAL"):
        outs = core.step()
    assert outs and all(o.error for o in outs)
    # Only the failed request ends: the blocks it hit are released, not dropped, and still serve.
    stats = check_memory(core, block_bytes)
    assert stats["num_cached_blocks"] == 2 and stats["num_used_blocks"] == 0
    assert one(core, prompt) == {"ids": reference(prompt), "cached": 2 * BS}


# -- with the SSD tier behind the memory cache ----------------------------------------------------------


def test_ssd_tier_serves_a_restarted_engine_the_same_tokens(loaded, reference, tmp_path):
    prompt = tokens(17, 2 * BS + 1)
    first = make_core(loaded, ssd_cache_dir=str(tmp_path))
    assert one(first, prompt) == {"ids": reference(prompt), "cached": 0}
    first.close()  # the last step's blocks are written on shutdown
    second = make_core(loaded, ssd_cache_dir=str(tmp_path))
    assert second.cache_stats()["num_cached_blocks"] == 0  # a new process: memory is empty
    assert one(second, prompt) == {"ids": reference(prompt), "cached": 2 * BS}
    assert second.cache_stats()["ssd"]["hits"] == 2
    second.close()


def test_blocks_evicted_from_memory_come_back_from_ssd(loaded, reference, block_bytes, tmp_path):
    core = make_core(loaded, cache_memory_bytes=4 * block_bytes, ssd_cache_dir=str(tmp_path))
    prompts = [tokens(30 + i, 2 * BS + 3) for i in range(4)]
    for p in prompts:
        assert one(core, p)["ids"] == reference(p)
    assert core.cache_stats()["evictions"] > 0  # the first prompts' blocks left memory...
    for p in prompts:
        assert one(core, p) == {"ids": reference(p), "cached": 2 * BS}  # ...and were read back
    assert core.cache_stats()["ssd"]["hits"] > 0
    check_memory(core, block_bytes)
    core.close()


def test_ssd_miss_at_admission_evicts_no_memory_block(loaded, block_bytes, tmp_path):
    core = make_core(loaded, cache_memory_bytes=2 * block_bytes, ssd_cache_dir=str(tmp_path))
    one(core, tokens(40, 2 * BS + 3))
    assert core.cache_stats()["num_cached_blocks"] == 2  # memory is full
    core.add_request(Request("new", tokens(41, BS + 4), greedy(4)))  # one full block, in neither tier
    core.step()  # admission and prefill; it stores nothing before it finishes
    stats = core.cache_stats()
    core.close()
    assert (stats["num_cached_blocks"], stats["evictions"]) == (2, 0)


def test_clear_cache_also_drops_blocks_waiting_to_be_spilled(loaded, reference, tmp_path):
    core = make_core(loaded, ssd_cache_dir=str(tmp_path))
    a, b = tokens(50, 2 * BS + 1), tokens(51, 2 * BS + 1)
    one(core, a)
    core.clear_cache()
    one(core, b)  # its first step spills whatever is still queued
    core.close()
    restarted = make_core(loaded, ssd_cache_dir=str(tmp_path))
    out = one(restarted, a)
    restarted.close()
    assert out == {"ids": reference(a), "cached": 0}  # a was cleared and never ran again


# -- prefill stored chunk by chunk; one prefill for prompts sent together --------------------------------


def prefill_steps(core: EngineCore, rid: str, num_tokens: int) -> None:
    """Steps until request `rid` has prefilled at least `num_tokens` prompt tokens."""
    for _ in range(1000):
        core.step()
        if core.scheduler.running[rid].num_computed_tokens >= num_tokens:
            return
    raise AssertionError("the prefill did not get that far")


def test_an_aborted_prefill_leaves_its_finished_blocks_cached(loaded, reference, block_bytes):
    core = make_core(loaded, prefill_step_size=32)
    prompt = tokens(60, 300)
    core.add_request(Request("long", prompt, greedy()))
    prefill_steps(core, "long", 160)
    assert core.scheduler.running["long"].num_computed_tokens == 160  # 5 chunks of 32, no first token yet
    core.abort("long")
    assert drain(core) == {}
    assert check_memory(core, block_bytes)["num_cached_blocks"] == 160 // BS
    # The retry resumes where the aborted prefill stopped, and its tokens are the uncached ones.
    assert one(core, prompt) == {"ids": reference(prompt), "cached": 160}


def test_an_aborted_prefill_with_quantized_kv(loaded):
    quantized = {"prefill_step_size": 32, "kv_bits": 8, "kv_group_size": 32}
    core, off = make_core(loaded, **quantized), make_core(loaded, enable_prefix_cache=False, **quantized)
    prompt = tokens(64, 200)
    core.add_request(Request("long", prompt, greedy()))
    prefill_steps(core, "long", 96)
    core.abort("long")
    drain(core)
    assert one(core, prompt) == {"ids": one(off, prompt)["ids"], "cached": 96}


def test_identical_prompts_sent_together_prefill_once(loaded, reference, block_bytes):
    core = make_core(loaded, prefill_step_size=32)
    prompt = tokens(61, 300)
    outs = run(core, {"first": prompt, "second": prompt, "other": tokens(62, 40)})
    assert outs["first"] == {"ids": reference(prompt), "cached": 0}
    assert outs["second"] == {"ids": reference(prompt), "cached": 299 // BS * BS}  # >= 90% of its prompt
    assert outs["other"]["ids"] == reference(tokens(62, 40))
    stats = check_memory(core, block_bytes)
    assert stats["hit_tokens"] == 299 // BS * BS


def test_a_waiter_computes_the_rest_when_the_owner_is_aborted(loaded, reference):
    core = make_core(loaded, prefill_step_size=32)
    prompt = tokens(63, 300)
    core.add_request(Request("owner", prompt, greedy()))
    core.add_request(Request("waiter", prompt, greedy()))
    prefill_steps(core, "owner", 96)
    assert "waiter" not in core.scheduler.running
    core.abort("owner")
    out = drain(core)
    assert out["waiter"] == {"ids": reference(prompt), "cached": 96}


# The same on the other cache kinds: MLA (keys and values of different widths), sliding windows (blocks
# carry the window's KV only while the prefill still holds it) and recurrent state (snapshots only where
# a forward stops: chunks inside a prompt end on block boundaries there). Step 24 is not a block multiple.
LAYOUT_FAMILIES = ["deepseek_v2", "gemma3_text", "qwen3_next"]


@pytest.fixture(scope="module", params=LAYOUT_FAMILIES)
def family(request, tmp_path_factory):
    from mlxhost.testing.families import build_family_folder

    return request.param, load_model(str(build_family_folder(tmp_path_factory.mktemp(request.param), request.param)))


def test_other_layouts_keep_an_aborted_prefill_and_prefill_shared_prompts_once(family):
    name, fam = family
    core, off = make_core(fam, prefill_step_size=24), make_core(fam, enable_prefix_cache=False)
    prompt = tokens(70, 150)
    expected = one(off, prompt)["ids"]
    core.add_request(Request("long", prompt, greedy()))
    prefill_steps(core, "long", 70)
    computed = core.scheduler.running["long"].num_computed_tokens
    core.abort("long")
    assert drain(core) == {}
    assert core.cache_stats()["num_cached_blocks"] == computed // BS, name
    assert one(core, prompt) == {"ids": expected, "cached": computed // BS * BS}, name
    other = tokens(71, 150)
    outs = run(core, {"first": other, "second": other})
    assert outs["first"]["ids"] == outs["second"]["ids"] == one(off, other)["ids"], name
    assert outs["second"]["cached"] == 149 // BS * BS, name

"""KV pre-allocation: the decode batch's buffers are reserved up front, decoding writes in place (flat
active memory over a 2k-token generation, measured with MLX's own counters, which work on the CPU
backend), past the reservation mlx-lm's growth takes over, and tokens are identical with and without."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.runner.kv_prealloc import reserve, room
from mlxhost.models.loader import load_model

H, D = 2, 8


def kv(length: int, seed: int) -> KVCache:
    c = KVCache()
    mx.random.seed(seed)
    c.update_and_fetch(mx.random.normal((1, H, length, D)), mx.random.normal((1, H, length, D)))
    return c


def step(c: BatchKVCache, seed: int) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    rows = c.offset.shape[0]
    return c.update_and_fetch(mx.random.normal((rows, H, 1, D)), mx.random.normal((rows, H, 1, D)))


def test_reserve_widens_once_and_decode_writes_in_place():
    plain, reserved = BatchKVCache.merge([kv(5, 0), kv(3, 1)]), BatchKVCache.merge([kv(5, 0), kv(3, 1)])
    assert reserve([reserved], 300) == 2 * 2 * H * (300 - 5) * D * 4  # keys and values, float32
    assert reserved.keys.shape[2] == 300 and room([reserved]) == 295
    assert reserve([reserved], 300) == 0  # already wide enough
    for i in range(295):
        a, b = step(plain, i), step(reserved, i)
        assert reserved.keys.shape[2] == 300  # never reallocated within the reservation
        if i % 97 == 0:
            assert mx.array_equal(a[0], b[0]) and mx.array_equal(a[1], b[1])
    assert room([reserved]) == 0
    step(reserved, 999)  # past the reservation: mlx-lm's own growth
    assert reserved.keys.shape[2] > 300 and reserved.size() == 301


def test_room_survives_rows_leaving_and_joining():
    c = BatchKVCache.merge([kv(5, 0), kv(40, 1)])
    reserve([c], 200)
    c.filter(mx.array([0]))  # the long row leaves: padding trimmed off both index and width
    assert room([c]) == 160 and c.size() == 5
    c.extend(BatchKVCache.merge([kv(20, 2)]))  # the widest buffer is kept; rows align right at 20
    assert c.keys.shape[2] == 165 and c.size() == 20 and room([c]) == 145
    assert reserve([c], 200) > 0 and room([c]) == 180  # what DecodeBatch.join does after each join
    assert room([KVCache()]) is None  # no batch cache: nothing to report


def test_other_cache_kinds_are_left_alone():
    c = KVCache()
    assert reserve([c, BatchKVCache([0])], 100) == 0  # per-request cache, empty batch cache


# ---------------------------------------------------------------- the engine on the tiny fixture

NUM_TOKENS = 2000
PROMPT = [5, 9, 11, 13, 17, 19, 23, 29]


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


def generate(loaded, kv_prealloc_tokens: int) -> tuple[list[int], list[int], list[int]]:
    """Greedy tokens, active and peak memory after each step (the prefix cache is off: its blocks
    would grow memory on purpose)."""
    config = EngineConfig(max_num_seqs=1, enable_prefix_cache=False, kv_prealloc_tokens=kv_prealloc_tokens)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096)
    core.add_request(Request("r", PROMPT, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)))
    tokens, active, peak = [], [], []
    first = True
    while core.has_work:
        for out in core.step():
            tokens += out.new_token_ids
        mx.synchronize()
        if first:  # the prefill's transients are not what this measures
            mx.reset_peak_memory()
            first = False
        active.append(mx.get_active_memory())
        peak.append(mx.get_peak_memory())
    return tokens, active, peak


def test_prealloc_keeps_memory_flat_over_2k_tokens_and_tokens_identical(loaded):
    reserved = len(PROMPT) + NUM_TOKENS + 8
    grown_tokens, grown_active, _ = generate(loaded, 0)
    flat_tokens, flat_active, flat_peak = generate(loaded, reserved)
    assert flat_tokens == grown_tokens and len(flat_tokens) == NUM_TOKENS
    kv_bytes = 2 * 2 * 2 * 32 * 4 * reserved  # layers x (K, V) x kv heads x head dim x float32 x positions
    decode = slice(1, -2)  # after the first decode step, before the last rows are dropped
    # Without: a 256-position stair every 256 tokens.
    stairs = sum(b > a for a, b in zip(grown_active[decode], grown_active[decode][1:]))
    assert stairs >= NUM_TOKENS // 256 - 1
    assert max(grown_active[decode]) - min(grown_active[decode]) > kv_bytes // 2
    # With: the reservation is made at the join, then nothing moves (allow 1% of it for allocator noise).
    assert max(flat_active[decode]) - min(flat_active[decode]) <= kv_bytes // 100
    # Peak too: what still grows is the attention scores' transient, a few bytes per position.
    assert max(flat_peak[decode]) - min(flat_peak[decode]) <= kv_bytes // 20

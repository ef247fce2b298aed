"""BatchQuantizedKVCache: the decode batch's quantized KV keeps each row exactly what a per-request
QuantizedKVCache fed the same keys and values holds, through merge, decode steps, rows leaving
(filter), rows joining (extend), extract, KV pre-allocation and the speculative rewind; its bytes are
the quantized ones. In the dequantize mode the same KV is kept and attention is handed float copies of it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxhost.engine.runner.kv_prealloc import reserve, room
from mlxhost.engine.spec.verify import rewind
from mlxhost.kv.kinds.quantized import BatchQuantizedKVCache, QuantizedRowKVCache

H, D, GS = 2, 64, 32


def kv(n: int, seed: int, rows: int = 1) -> tuple[mx.array, mx.array]:
    k1, k2 = mx.random.split(mx.random.key(seed))
    return mx.random.normal((rows, H, n, D), key=k1), mx.random.normal((rows, H, n, D), key=k2)


def row_cache(n: int, seed: int, bits: int, dequantize: bool = False) -> QuantizedRowKVCache:
    c = QuantizedRowKVCache(group_size=GS, bits=bits, dequantize=dequantize)
    c.update_and_fetch(*kv(n, seed))
    return c


def same(a: QuantizedRowKVCache, b: QuantizedRowKVCache) -> bool:
    """Equal quantized contents over the written positions."""
    ka, va = a.keys_and_values() if a.offset else (a.keys, a.values)
    kb, vb = b.keys_and_values()
    return a.offset == b.offset and all(mx.array_equal(x, y) for x, y in zip((*ka, *va), (*kb, *vb)))


def dequantized(q: tuple, bits: int) -> mx.array:
    return mx.dequantize(*q, group_size=GS, bits=bits)


@pytest.mark.parametrize("dequantize", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_rows_stay_what_a_per_request_cache_holds(bits, dequantize):
    """The references always quantize natively; the batch under test in either mode."""
    lengths = [5, 40, 17]
    refs = [row_cache(n, i, bits) for i, n in enumerate(lengths)]
    batch = QuantizedRowKVCache.merge([row_cache(n, i, bits, dequantize) for i, n in enumerate(lengths)])
    assert isinstance(batch, BatchQuantizedKVCache) and batch.kv_bits == bits and batch.group_size == GS
    assert batch.dequantize == dequantize and hasattr(batch, "bits") == (not dequantize)
    assert batch.left_padding.tolist() == [35, 0, 23] and batch.size() == 40
    for step in range(3):  # decode: each row gets its own new position
        keys, values = kv(1, 100 + step, rows=3)
        fetched = batch.update_and_fetch(keys, values)
        for i, ref in enumerate(refs):
            ref_fetched = ref.update_and_fetch(keys[i : i + 1], values[i : i + 1])
            if dequantize:  # float copies of the row's quantized KV, past its left padding
                pad = batch.left_padding[i].item()
                for got, want in zip(fetched, ref_fetched):
                    assert got.dtype == keys.dtype
                    assert mx.array_equal(got[i : i + 1, :, pad:], dequantized(want, bits))
    assert all(same(batch.extract(i), ref) for i, ref in enumerate(refs))
    assert all(batch.extract(i).dequantize == dequantize for i in range(3))

    batch.filter(mx.array([0, 2]))  # the longest row leaves: the common padding is trimmed
    refs = [refs[0], refs[2]]
    assert batch.left_padding.tolist() == [12, 0] and batch.size() == 20
    newcomer = row_cache(30, 9, bits)
    batch.extend(QuantizedRowKVCache.merge([row_cache(30, 9, bits, dequantize)]))
    refs.append(newcomer)
    for step in range(2):
        keys, values = kv(1, 200 + step, rows=3)
        batch.update_and_fetch(keys, values)
        for i, ref in enumerate(refs):
            ref.update_and_fetch(keys[i : i + 1], values[i : i + 1])
    assert all(same(batch.extract(i), ref) for i, ref in enumerate(refs))
    # The mask of the next token hides each row's left padding, as mlx-lm's BatchKVCache's does.
    mask = batch.make_mask(1)
    assert mask.shape == (3, 1, 1, batch.size() + 1)
    assert [int(mask[i, 0, 0].sum()) for i in range(3)] == [r.offset + 1 for r in refs]


@pytest.mark.parametrize("dequantize", [False, True])
def test_speculative_rewind_drops_each_rows_own_count(dequantize):
    """trim + prepare(right_padding) + finalize (speculative.rewind): each row keeps its accepted prefix."""
    refs = [row_cache(6, 0, 8), row_cache(9, 1, 8)]
    batch = QuantizedRowKVCache.merge([row_cache(6, 0, 8, dequantize), row_cache(9, 1, 8, dequantize)])
    keys, values = kv(4, 5, rows=2)  # a draft of 4 positions per row, verified in one forward
    batch.update_and_fetch(keys, values)
    rewind([batch], [3, 1])  # row 0 accepted 1 of them, row 1 accepted 3
    for ref, (i, kept) in zip(refs, enumerate([1, 3])):
        ref.update_and_fetch(keys[i : i + 1, :, :kept], values[i : i + 1, :, :kept])
    assert all(same(batch.extract(i), ref) for i, ref in enumerate(refs))
    mask = batch.make_mask(1)
    assert [int(mask[i, 0, 0].sum()) for i in range(2)] == [r.offset + 1 for r in refs]


def test_row_state_round_trips_in_either_mode():
    """The prefix cache fills a fresh request's cache through `state` (mlx-lm's QuantizedKVCache's
    tuple); the mode is the cache's own and survives it."""
    for dequantize in (False, True):
        src = row_cache(7, 3, 4, dequantize)
        dst = QuantizedRowKVCache(GS, 8, dequantize=dequantize)
        dst.state = src.state
        assert dst.kv_bits == 4 and dst.dequantize == dequantize and same(dst, src)


def test_empty_rows_merge_and_extend():
    batch = BatchQuantizedKVCache.merge([QuantizedRowKVCache(GS, 8), QuantizedRowKVCache(GS, 8)])
    assert batch.keys is None and batch.size() == 0
    batch.extend(QuantizedRowKVCache.merge([row_cache(4, 0, 8)]))
    assert batch.keys[0].shape[0] == 3 and batch.left_padding.tolist() == [4, 4, 0]


def test_reserve_widens_every_part_and_decoding_writes_in_place():
    batch = QuantizedRowKVCache.merge([row_cache(5, 0, 8), row_cache(3, 1, 8)])
    before = batch.nbytes
    added = reserve([batch], 300)
    assert added == batch.nbytes - before > 0
    assert all(a.shape[2] == 300 for a in (*batch.keys, *batch.values)) and room([batch]) == 295
    ref = QuantizedRowKVCache.merge([row_cache(5, 0, 8), row_cache(3, 1, 8)])
    for step in range(4):
        keys, values = kv(1, step, rows=2)
        batch.update_and_fetch(keys, values)
        ref.update_and_fetch(keys, values)
    assert batch.keys[0].shape[2] == 300  # never reallocated within the reservation
    assert all(same(batch.extract(i), ref.extract(i)) for i in range(2))


@pytest.mark.parametrize("dtype,bits,factor", [(mx.bfloat16, 8, 1.8), (mx.bfloat16, 4, 3.0),
                                               (mx.float32, 8, 3.5), (mx.float32, 4, 6.0)])
def test_bytes_per_token_against_float_kv(dtype, bits, factor):
    """Group 64 (the default): bf16 KV takes 2 bytes a value, 8-bit 1 + 4/64, 4-bit 0.5 + 4/64."""
    keys, values = (a.astype(dtype) for a in kv(256, 0))
    plain = KVCache()
    plain.update_and_fetch(keys, values)
    quant = QuantizedRowKVCache(group_size=64, bits=bits)
    quant.update_and_fetch(keys, values)
    batch_plain = BatchKVCache.merge([plain])
    batch_quant = QuantizedRowKVCache.merge([quant])
    assert plain.nbytes / quant.nbytes >= factor
    assert batch_plain.nbytes / batch_quant.nbytes == plain.nbytes / quant.nbytes

"""Quantized KV caches for the continuous batch (`--kv-bits`), after mlx-lm's `QuantizedKVCache`.

mlx-lm 0.32 has a per-request `QuantizedKVCache` (keys and values kept as `mx.quantize` tuples:
packed uint32 data, scales, biases; attention through `mx.quantized_matmul` in
`models.base.quantized_scaled_dot_product_attention`, which a model picks when its cache has `bits`)
but no batch version, so its server serves quantized KV one request at a time. `BatchQuantizedKVCache`
is that batch version: mlx-lm's `BatchKVCache` (left padding, offsets, masks, trim) with every array
operation applied to the three parts of each tuple. `QuantizedRowKVCache` is mlx-lm's per-request
cache plus what the batch needs from it (`size()`, `merge`) and the mode below.

Every attention, prefill included, reads the quantized KV: a prompt's KV is quantized as it is
written, not after the prefill. Then a position's KV does not depend on how the prompt was chunked,
whether it came from the prefix cache, or which batch it ran in, so those paths give the same tokens.

Two modes, one storage. With quantized attention (`dequantize=False`) the caches have `bits`, so mlx-lm's
models read the KV through `quantized_scaled_dot_product_attention`. Some backends' quantized matmul
rejects its GQA-broadcast shapes (MLX-CUDA 0.32: "No implementation for problem shape"); there
(`dequantize=True`) `update_and_fetch` returns float keys and values and the cache has no `bits`, so the
models take their float SDPA. The KV kept, the prefix-cache blocks and the SSD files are the same bytes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache, dynamic_roll

from mlxhost.kv.kinds.registry import KV, CacheKind, LayerSpec

Quantized = tuple[mx.array, mx.array, mx.array]  # (packed data, scales, biases), as mx.quantize gives

SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts


def quantized_widths(width: int, bits: int, group_size: int) -> tuple[int, int, int]:
    """Last-axis widths of (data, scales, biases) for `width` values."""
    return width * bits // 32, width // group_size, width // group_size


def _zeros(batch: int, heads: int, length: int, width: int, dtype: mx.Dtype, bits: int,
           group_size: int) -> Quantized:
    w_data, w_scales, _ = quantized_widths(width, bits, group_size)
    return (mx.zeros((batch, heads, length, w_data), mx.uint32),
            mx.zeros((batch, heads, length, w_scales), dtype),
            mx.zeros((batch, heads, length, w_scales), dtype))


def quantized_width(q: Quantized, bits: int) -> int:
    return q[0].shape[-1] * 32 // bits


def _write(stored: tuple[Quantized, Quantized] | None, prev: int, keys: mx.array, values: mx.array, step: int,
           bits: int, group_size: int) -> tuple[Quantized, Quantized]:
    """Quantizes `keys`/`values` into positions [prev, prev + n) of the stored tuples, first growing them
    in `step`s (dropping what lies past `prev`) when they are too short, as mlx-lm's caches do."""
    n = keys.shape[2]
    if stored is None or prev + n > stored[0][0].shape[2]:
        B, H = keys.shape[:2]
        grow = (step + n - 1) // step * step
        new = (_zeros(B, H, grow, keys.shape[3], keys.dtype, bits, group_size),
               _zeros(B, H, grow, values.shape[3], values.dtype, bits, group_size))
        if stored is None:
            stored = new
        else:
            if prev % step != 0:
                stored = tree_map(lambda x: x[..., :prev, :], stored)
            stored = tuple(tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old, grown))
                           for old, grown in zip(stored, new))
    for q, target in zip((mx.quantize(keys, group_size=group_size, bits=bits),
                          mx.quantize(values, group_size=group_size, bits=bits)), stored):
        for i in range(3):
            target[i][..., prev : prev + n, :] = q[i]
    return stored


class _QuantizedKV:
    """The mode both caches share. `kv_bits` is always set; `bits` only with quantized attention."""

    kv_bits: int
    group_size: int
    dequantize: bool

    @property
    def bits(self) -> int:
        if self.dequantize:
            # mlx-lm's attention reads quantized KV when `hasattr(cache, "bits")`: here it must not.
            raise AttributeError("bits (KV is dequantized per layer for float attention)")
        return self.kv_bits

    def _fetched(self, keys: Quantized, values: Quantized):
        """What attention gets: the quantized tuples, or float copies of them. A float copy is transient
        (only the quantized KV is kept) and the memory budget does not count it."""
        if not self.dequantize:
            return keys, values
        return tuple(mx.dequantize(*q, group_size=self.group_size, bits=self.kv_bits) for q in (keys, values))


class QuantizedRowKVCache(_QuantizedKV, QuantizedKVCache):
    """One request's quantized KV (mlx-lm's cache), which the decode batch can merge."""

    def __init__(self, group_size: int = 64, bits: int = 8, dequantize: bool = False) -> None:
        # Not the parent's __init__: it sets `bits`, which the dequantize mode must not have.
        self.keys = self.values = None
        self.offset = 0
        self.group_size, self.kv_bits, self.dequantize = group_size, bits, dequantize

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        stored = None if self.keys is None else (self.keys, self.values)
        self.keys, self.values = _write(stored, self.offset, keys, values, self.step, self.kv_bits, self.group_size)
        self.offset += keys.shape[2]
        return self._fetched(*self.keys_and_values())

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.group_size, self.kv_bits

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, self.offset, self.group_size, self.kv_bits = v

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: list[Any]) -> "BatchQuantizedKVCache":
        return BatchQuantizedKVCache.merge(caches)


class BatchQuantizedKVCache(_QuantizedKV, BatchKVCache):
    """mlx-lm's BatchKVCache whose keys and values are quantized tuples. The bookkeeping (offsets,
    left padding, `_idx`, masks, trim, prepare) is the parent's; what touches arrays is here."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8,
                 dequantize: bool = False) -> None:
        super().__init__(left_padding)
        self.group_size, self.kv_bits, self.dequantize = group_size, bits, dequantize

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        stored = None if self.keys is None else (self.keys, self.values)
        self.keys, self.values = _write(stored, self._idx, keys, values, self.step, self.kv_bits, self.group_size)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return self._fetched(*self.keys_and_values())

    def keys_and_values(self):
        idx = self._idx
        return tree_map(lambda x: x[..., :idx, :], (self.keys, self.values))

    def finalize(self) -> None:
        if self._right_padding is not None:
            shifts = self._right_padding[:, None]
            self.keys, self.values = tree_map(lambda x: dynamic_roll(x, shifts, axis=2), (self.keys, self.values))
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
            self._right_padding = None

    def filter(self, batch_indices: mx.array) -> None:
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        # Shift left to drop padding every remaining row has (as the parent does).
        min_left_pad = min(self.left_padding.tolist())
        if min_left_pad > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(lambda x: x[..., min_left_pad:, :], (self.keys, self.values))
            self._idx -= min_left_pad
            self.left_padding -= min_left_pad

    def extend(self, other: "BatchQuantizedKVCache") -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        max_idx = max(self._idx, other._idx)
        ref = self if self.keys is not None else other
        H, dtype = ref.keys[1].shape[1], ref.keys[1].dtype
        Dk, Dv = quantized_width(ref.keys, self.kv_bits), quantized_width(ref.values, self.kv_bits)
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c):
            k, v = c.keys, c.values
            if k is None:
                rows = c.offset.shape[0]
                k = _zeros(rows, H, 0, Dk, dtype, self.kv_bits, self.group_size)
                v = _zeros(rows, H, 0, Dv, dtype, self.kv_bits, self.group_size)
            left = max_idx - c._idx
            right = max_size - k[0].shape[2] - left
            if right < 0:
                k, v = tree_map(lambda x: x[..., :right, :], (k, v))
                right = 0
            if left or right:
                k, v = tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]), (k, v))
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2))
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = max_idx

    def extract(self, idx: int) -> QuantizedRowKVCache:
        cache = QuantizedRowKVCache(self.group_size, self.kv_bits, self.dequantize)
        padding = self.left_padding.tolist()[idx]
        cache.keys, cache.values = tree_map(lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]),
                                            (self.keys, self.values))
        cache.offset = cache.keys[0].shape[2]
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> "BatchQuantizedKVCache":
        """Per-request quantized caches (batch 1) -> one batch cache, left-padded to the longest."""
        first = next((c for c in caches if c.keys is not None), caches[0])
        group_size, bits, dequantize = first.group_size, first.kv_bits, first.dequantize
        lengths = [c.offset for c in caches]
        max_length = max(lengths)
        if max_length == 0:
            return cls([0] * len(caches), group_size, bits, dequantize)
        padding = [max_length - n for n in lengths]
        H, dtype = first.keys[1].shape[1], first.keys[1].dtype
        B, Dk, Dv = len(caches), quantized_width(first.keys, bits), quantized_width(first.values, bits)
        keys = _zeros(B, H, max_length, Dk, dtype, bits, group_size)
        values = _zeros(B, H, max_length, Dv, dtype, bits, group_size)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for part in range(3):
                keys[part][i : i + 1, :, p : p + c.offset] = c.keys[part][..., : c.offset, :]
                values[part][i : i + 1, :, p : p + c.offset] = c.values[part][..., : c.offset, :]
        cache = cls(padding, group_size, bits, dequantize)
        cache.keys, cache.values = keys, values
        cache.offset += max_length
        cache._idx = max_length
        return cache

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))


def _spec(c: Any) -> LayerSpec | None:
    if c.keys is None or c.keys[1].shape[1] != c.values[1].shape[1]:
        return None
    widths = quantized_width(c.keys, c.kv_bits), quantized_width(c.values, c.kv_bits)
    return LayerSpec(KV, (c.keys[1].shape[1], *widths, c.keys[1].dtype), quant=(c.kv_bits, c.group_size))


# Blocks keep the plain kind's layout as (data, scales, biases) tuples (plain.py reads and fills them).
# Rewound past a rejected draft as plain KV is (the parent's trim, and `finalize` rolls rows that drop more).
# Not padded for a batched prefill.
QUANTIZED = CacheKind("quantized", (QuantizedRowKVCache,), (BatchQuantizedKVCache,), can_batch=True,
                      can_store=True, can_reserve=True, can_rewind=True, spec=_spec)

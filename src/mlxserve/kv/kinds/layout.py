"""Which layers of a model the prefix cache stores, and how (this module may touch MLX).

Three kinds of layer caches can be reused from a prefix:
  * "kv": a plain `KVCache`, whose keys and values may differ in width (MLA keeps its latent as keys
    and the rope part as values). A block holds the keys and values of its positions, concatenated on
    the last axis, for every such layer: one array [layers, kv_heads, block_size, key_width + value_width].
  * "swa": a sliding-window `RotatingKVCache`. A block holds these layers' keys and values for its
    positions too (same layout, a second array), when they were still in the window at store time.
  * "state": an `ArraysCache` (linear attention, SSM, conv): fixed-size recurrent state, kept as
    snapshots at block boundaries, never per position.
Anything else (quantized, chunked, CacheList, a rotating cache that keeps its first tokens) turns the
prefix cache off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlxserve.kv.kinds.quantized import QuantizedRowKVCache, quantized_width, quantized_widths

KV, SWA, STATE = "kv", "swa", "state"


@dataclass(frozen=True)
class KVLayout:
    kinds: tuple[str, ...]  # per layer: KV, SWA or STATE
    key_width: int = 0  # last-axis width of the attention layers' keys (their values follow it)
    window: int = 0  # the sliding layers' window (their caches' max_size), 0 without any
    kv_bits: int = 0  # the "kv" layers' quantization (0: float KV)
    kv_group_size: int = 0

    def key_widths(self) -> tuple[int, ...]:
        """Last-axis width of the keys' part of a "kv" block array (one per array of the block)."""
        if not self.kv_bits:
            return (self.key_width,)
        return quantized_widths(self.key_width, self.kv_bits, self.kv_group_size)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k == KV)

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k == SWA)

    @property
    def state_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k == STATE)

    def window_start(self, num_tokens: int) -> int:
        """First position whose sliding KV a sequence resumed after `num_tokens` tokens needs: the
        last `window` positions, as many as mlx-lm's rotating cache would hold there."""
        return num_tokens - min(self.window, num_tokens) if self.swa_layers else num_tokens


def read_layout(cache: list[Any]) -> KVLayout | None:
    """The layout of mlx-lm caches after a one-token forward, or None when the prefix cache cannot
    store it. Attention layers must agree on their shapes (one block array holds them all)."""
    kinds, shapes, windows, quant = [], set(), set(), set()
    for c in cache:
        if type(c) is QuantizedRowKVCache:
            if c.keys is None or c.keys[1].shape[1] != c.values[1].shape[1]:
                return None
            kinds.append(KV)
            quant.add((c.kv_bits, c.group_size))
            widths = quantized_width(c.keys, c.kv_bits), quantized_width(c.values, c.kv_bits)
            shapes.add((c.keys[1].shape[1], *widths, c.keys[1].dtype))
        elif type(c) is KVCache or (type(c) is RotatingKVCache and c.keep == 0):
            if c.keys is None or c.keys.shape[1] != c.values.shape[1]:
                return None
            kinds.append(KV if type(c) is KVCache else SWA)
            if type(c) is KVCache:
                quant.add((0, 0))
            shapes.add((c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype))
            if type(c) is RotatingKVCache:
                windows.add(c.max_size)
        elif isinstance(c, ArraysCache) and getattr(type(c), "merge", None) is not None:
            kinds.append(STATE)
        else:
            return None
    if len(shapes) > 1 or len(windows) > 1 or len(quant) > 1:
        return None
    key_width = next(iter(shapes))[1] if shapes else 0
    bits, group_size = next(iter(quant), (0, 0))
    return KVLayout(tuple(kinds), key_width, next(iter(windows), 0), bits, group_size)

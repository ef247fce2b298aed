"""The physical half of the prefix cache: the KV arrays of each cached block, as MLX arrays."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

# One block: per layer (keys, values), each [1, kv_heads, block_size, head_dim].
BlockKV = list[tuple[mx.array, mx.array]]


class KVBlockStore:
    def __init__(self) -> None:
        self._blocks: dict[int, BlockKV] = {}
        self.nbytes = 0

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, block_id: int) -> BlockKV | None:
        return self._blocks.get(block_id)

    def put(self, block_id: int, kv: BlockKV) -> None:
        self.drop(block_id)
        self._blocks[block_id] = kv
        self.nbytes += sum(k.nbytes + v.nbytes for k, v in kv)

    def drop(self, block_id: int) -> None:
        kv = self._blocks.pop(block_id, None)
        if kv is not None:
            self.nbytes -= sum(k.nbytes + v.nbytes for k, v in kv)

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0

    def copy_from(self, cache: list[Any], start: int, block_size: int) -> BlockKV:
        """A block's own copy of positions [start, start + block_size) of a batch-1 cache.

        `mx.contiguous` makes a copy: a slice would keep the request's whole buffer alive."""
        kv = []
        for c in cache:
            keys, values = c.keys[..., start : start + block_size, :], c.values[..., start : start + block_size, :]
            kv.append((mx.contiguous(keys), mx.contiguous(values)))
        return kv

    def make_cache(self, block_ids: list[int], cache: list[KVCache]) -> None:
        """Fills a fresh per-request cache with the given blocks, in order: the one copy a hit costs."""
        blocks = [self._blocks[b] for b in block_ids]
        for layer, c in enumerate(cache):
            keys = mx.concatenate([blk[layer][0] for blk in blocks], axis=2)
            values = mx.concatenate([blk[layer][1] for blk in blocks], axis=2)
            c.state = (keys, values, keys.shape[2])

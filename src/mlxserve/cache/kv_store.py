"""The physical half of the prefix cache: the KV arrays of each cached block, as MLX arrays, with an
optional SSD tier behind them (write-behind for new blocks, read-through on a memory miss)."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlxserve.cache.ssd_tier import BlockData, SSDTier

# One block: per layer (keys, values), each [1, kv_heads, block_size, head_dim].
BlockKV = list[tuple[mx.array, mx.array]]


def _to_bytes(a: mx.array) -> tuple[bytes, tuple[int, ...]]:
    # bfloat16 has no numpy dtype: ship the raw bytes, the shape and (in the tier's header) the dtype.
    return np.array(a.view(mx.uint8)).tobytes(), tuple(a.shape)


def _from_bytes(raw: bytes, shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
    return mx.array(np.frombuffer(raw, dtype=np.uint8)).view(dtype).reshape(shape)


class KVBlockStore:
    def __init__(self, ssd: SSDTier | None = None, dtype: mx.Dtype | None = None) -> None:
        self._blocks: dict[int, BlockKV] = {}
        self.nbytes = 0
        self.ssd = ssd
        self.dtype = dtype
        # Blocks stored this step, spilled to the SSD tier next step: by then their arrays are computed,
        # so reading them back costs a copy and never a wait.
        self._to_spill: list[tuple[bytes, tuple[int, ...], BlockKV]] = []

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

    # -- SSD tier ------------------------------------------------------------------------------
    def queue_spill(self, block_hash: bytes, token_ids: tuple[int, ...], kv: BlockKV) -> None:
        if self.ssd is not None:
            self._to_spill.append((block_hash, token_ids, kv))

    def spill_pending(self) -> None:
        """Hands last step's new blocks to the SSD tier's writer thread (which never blocks us)."""
        pending, self._to_spill = self._to_spill, []
        for block_hash, token_ids, kv in pending:
            if self.ssd.contains(block_hash):
                continue
            tensors = {}
            for layer, (k, v) in enumerate(kv):
                tensors[f"l{layer}.k"] = _to_bytes(k)
                tensors[f"l{layer}.v"] = _to_bytes(v)
            self.ssd.put(block_hash, BlockData(token_ids, tensors))

    def load_from_ssd(self, block_hash: bytes, token_ids: Sequence[int], block_id: int) -> bool:
        """Read-through on a memory miss: the block's data from disk into `block_id`, if it is there."""
        if self.ssd is None or not self.ssd.contains(block_hash):
            return False
        data = self.ssd.get(block_hash, token_ids)
        if data is None:
            return False
        num_layers = len(data.tensors) // 2
        kv = [
            (_from_bytes(*data.tensors[f"l{i}.k"], self.dtype), _from_bytes(*data.tensors[f"l{i}.v"], self.dtype))
            for i in range(num_layers)
        ]
        self.put(block_id, kv)
        return True

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

"""The physical half of the prefix cache: the KV arrays of each cached block, as MLX arrays, with an
optional SSD tier behind them (write-behind for new blocks, read-through on a memory miss).

A block is ONE array [layers, 2, kv_heads, block_size, head_dim] (keys and values of every layer):
storing, attaching and spilling then cost a kernel launch or a device-to-host copy per block, not
per block and layer (on an H200 the per-layer version made a hit slower than recomputing).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlxserve.cache.ssd_tier import BlockData, SSDTier

log = logging.getLogger(__name__)


def _from_bytes(raw: bytes, shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
    # bfloat16 has no numpy dtype: blocks travel as raw bytes, the shape and (in the header) the dtype.
    return mx.array(np.frombuffer(raw, dtype=np.uint8)).view(dtype).reshape(shape)


class KVBlockStore:
    def __init__(self, ssd: SSDTier | None = None, dtype: mx.Dtype | None = None) -> None:
        self._blocks: dict[int, mx.array] = {}
        self.nbytes = 0
        self.ssd = ssd
        self.dtype = dtype
        # Blocks stored this step, spilled to the SSD tier next step: by then their arrays are computed,
        # so reading them back costs a copy and never a wait.
        self._to_spill: list[tuple[bytes, tuple[int, ...], mx.array]] = []

    def put(self, block_id: int, block: mx.array) -> None:
        self.drop(block_id)
        self._blocks[block_id] = block
        self.nbytes += block.nbytes

    def drop(self, block_id: int) -> None:
        block = self._blocks.pop(block_id, None)
        if block is not None:
            self.nbytes -= block.nbytes

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0

    @staticmethod
    def stack_row(batch_cache: list[Any], row: int, start: int, end: int) -> mx.array:
        """Positions [start, end) of one row of mlx-lm batch caches, as one array [layers, 2, kv_heads,
        end - start, head_dim]. Rows are left-padded; all layers share the row's padding."""
        pad = batch_cache[0].left_padding[row].item()
        lo, hi = pad + start, pad + end
        return mx.stack([mx.stack([c.keys[row, :, lo:hi], c.values[row, :, lo:hi]]) for c in batch_cache])

    def make_cache(self, block_ids: list[int], cache: list[KVCache]) -> None:
        """Fills a fresh per-request cache with the given blocks, in order: the one copy a hit costs."""
        kv = mx.concatenate([self._blocks[b] for b in block_ids], axis=3)
        for layer, c in enumerate(cache):
            keys, values = kv[layer, 0][None], kv[layer, 1][None]
            c.state = (keys, values, keys.shape[2])

    # -- SSD tier ------------------------------------------------------------------------------
    def queue_spill(self, block_hash: bytes, token_ids: tuple[int, ...], block: mx.array) -> None:
        if self.ssd is not None:
            self._to_spill.append((block_hash, token_ids, block))

    def drop_pending_spills(self) -> None:
        self._to_spill = []

    def spill_pending(self) -> None:
        """Hands last step's new blocks to the SSD tier's writer thread (which never blocks us).

        One device-to-host copy for all of them: on MLX-CUDA a copy per block cost more than
        recomputing the prefix (0.6B model on an H200: 32 blocks, ~400 ms)."""
        pending = [p for p in self._to_spill if not self.ssd.contains(p[0])]
        self._to_spill = []
        if not pending:
            return
        flat = mx.concatenate([block.reshape(-1) for _, _, block in pending])
        raw = np.array(flat.view(mx.uint8))
        size = raw.nbytes // len(pending)  # every block has the same shape and dtype
        for i, (block_hash, token_ids, block) in enumerate(pending):
            data = raw[i * size : (i + 1) * size].tobytes()
            self.ssd.put(block_hash, BlockData(token_ids, {"kv": (data, tuple(block.shape))}))

    def load_from_ssd(self, block_hash: bytes, token_ids: Sequence[int], block_id: int) -> bool:
        """Read-through on a memory miss: the block's data from disk into `block_id`, if it is there."""
        if self.ssd is None or not self.ssd.contains(block_hash):
            return False
        data = self.ssd.get(block_hash, token_ids)
        if data is None:
            return False
        try:
            block = _from_bytes(*data.tensors["kv"], self.dtype)
        except (KeyError, ValueError, TypeError) as exc:  # a file that passed the checks but not ours
            log.warning("SSD block %s unusable (%s): a miss", block_hash.hex(), exc)
            return False
        self.put(block_id, block)
        return True

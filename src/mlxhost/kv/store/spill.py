"""Arrays to the SSD tier's raw-byte tensors (this module touches MLX); each role reads its own back
(kv/roles/).

Blocks and snapshots stored in one step are copied to the host in one go the step after (by then
they are computed, so the copy never waits on the device), or at once when the engine goes idle: on
MLX-CUDA a copy per block cost more than recomputing the prefix (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxhost.kv.store.ssd_format import BlockData
from mlxhost.kv.store.ssd_tier import SSDTier


class SpillQueue:
    """Arrays waiting for their device-to-host copy, each item bound for one tier under one hash."""

    def __init__(self) -> None:
        self._items: list[tuple[SSDTier, bytes, tuple[int, ...], dict[str, mx.array]]] = []

    def add(self, tier: SSDTier, block_hash: bytes, token_ids: tuple[int, ...], tensors: dict[str, mx.array]) -> None:
        self._items.append((tier, block_hash, token_ids, tensors))

    def clear(self) -> None:
        self._items = []

    def flush(self) -> None:
        pending = [item for item in self._items if not item[0].contains(item[1])]
        self._items = []
        arrays = [a for *_, tensors in pending for a in tensors.values()]
        if not arrays:
            for tier, block_hash, token_ids, _ in pending:  # blocks of a model without attention layers
                tier.put(block_hash, BlockData(token_ids, {}))
            return
        raw = np.array(mx.concatenate([a.reshape(-1).view(mx.uint8) for a in arrays]))
        offset = 0
        for tier, block_hash, token_ids, tensors in pending:
            out = {}
            for name, a in tensors.items():
                out[name] = (raw[offset : offset + a.nbytes].tobytes(), tuple(a.shape))
                offset += a.nbytes
            tier.put(block_hash, BlockData(token_ids, out))

"""The physical half of the prefix cache: each cached block's arrays and the recurrent-state
snapshots, as MLX arrays, with an optional SSD tier behind them (write-behind for new data,
read-through on a memory miss).

A block is at most two arrays (see `kinds/layout.py`): `kv` [full layers, kv_heads, block_size, key_width +
value_width] (under --kv-bits the quantized tuple's three arrays, each laid out so) and, for
sliding-window models, `swa` with the sliding layers' KV of the same positions when it was still in
the window at store time. One array per kind, not per layer: storing, attaching
and spilling then cost a kernel launch or a device-to-host copy per block (per layer, a hit was slower
than recomputing: docs/BENCHMARKS.md).

On the SSD tier `swa` has its own files (`window_ssd`): a hit reads it back only for the few blocks
inside the window where it resumes, not for the whole chain (Gemma 3 4B: 29 of 34 layers slide).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx

from mlxhost.kv.kinds.block_io import fill_cache
from mlxhost.kv.kinds.layout import KVLayout
from mlxhost.kv.kinds.plain import KVArrays, kv_arrays
from mlxhost.kv.kinds.recurrent import Snapshot
from mlxhost.kv.store.snapshots import SnapshotStore
from mlxhost.kv.store.spill import QUANT_TENSORS, SpillQueue, block_from_data, snapshot_from_data, window_from_data

WINDOW_MARK = "window"  # a block file's tensor: its sliding KV is in a window file of its own
from mlxhost.kv.store.ssd_tier import SSDTier

log = logging.getLogger(__name__)


@dataclass
class KVBlock:
    kv: KVArrays | None  # full-attention layers (None for a model without any); a tuple when quantized
    swa: mx.array | None = None  # sliding layers; None when their KV had left the window

    @property
    def arrays(self) -> list[mx.array]:
        return kv_arrays(self.kv) + kv_arrays(self.swa)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def snapshot_nbytes(snapshot: Snapshot) -> int:
    return sum(a.nbytes for arrays in snapshot for a in arrays)


class KVBlockStore:
    def __init__(self, layout: KVLayout, block_size: int, ssd: SSDTier | None = None, dtype: mx.Dtype | None = None,
                 snapshot_bytes: int = 0, state_ssd: SSDTier | None = None,
                 window_ssd: SSDTier | None = None) -> None:
        self.layout = layout
        self.block_size = block_size
        self._blocks: dict[int, KVBlock] = {}
        self._hash_of: dict[int, bytes] = {}
        self._block_bytes = 0
        self.snapshots = SnapshotStore(snapshot_bytes)
        self.ssd = ssd
        self.state_ssd = state_ssd  # snapshots' own files (same format, own folder and cap)
        self.window_ssd = window_ssd  # blocks' sliding KV, likewise; None: inside the block files
        self._lost_windows: list[int] = []  # blocks whose window file turned out unreadable
        # Blocks read from the SSD tier without their sliding KV, which `window_ssd` holds: block id ->
        # (hash, tokens) to read it by once a hit resumes with the block inside its window.
        self._window_on_disk: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        self.dtype = dtype
        self._spill = SpillQueue()
        # Where a hit's time goes besides its prefill (`bench prefix` prints them): filling caches from
        # blocks, and reading blocks and snapshots back from the SSD tier.
        self.num_restores = 0
        self.restore_seconds = 0.0
        self.ssd_read_seconds = 0.0
        self.spill_seconds = 0.0

    @property
    def nbytes(self) -> int:
        return self._block_bytes + self.snapshots.nbytes

    @property
    def wants_snapshots(self) -> bool:
        return bool(self.layout.state_layers) and self.snapshots.max_bytes > 0

    def put(self, block_id: int, block_hash: bytes, block: KVBlock) -> None:
        self.drop(block_id)
        self._blocks[block_id] = block
        self._hash_of[block_id] = block_hash
        self._block_bytes += block.nbytes

    def drop(self, block_id: int) -> None:
        self._window_on_disk.pop(block_id, None)
        block = self._blocks.pop(block_id, None)
        if block is not None:
            self._block_bytes -= block.nbytes
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:  # a snapshot is reached only through its block
            self.snapshots.drop(block_hash)

    def clear(self) -> None:
        for block_id in list(self._blocks):
            self.drop(block_id)

    def put_snapshot(self, block_hash: bytes, snapshot: Snapshot) -> bool:
        return self.snapshots.put(block_hash, snapshot, snapshot_nbytes(snapshot))

    # -- admission -----------------------------------------------------------------------------
    def can_resume(self, request_id: str, block_ids: Sequence[int], block_hash: bytes,
                   token_ids: Sequence[int]) -> bool:
        """Whether a request can start after these hit blocks (the last one's hash and tokens given): the blocks
        covering the sliding window there carry sliding KV, and the recurrent state there has a
        snapshot (read from the SSD tier if need be), which is then pinned for `request_id`."""
        layout, bs = self.layout, self.block_size
        depth = len(block_ids) * bs
        if layout.swa_layers:
            first = layout.window_start(depth) // bs
            # A block planned this step is not copied yet: not known to carry sliding KV.
            if any(getattr(self._blocks.get(b), "swa", None) is None and not self._load_window(b)
                   for b in block_ids[first:]):
                return False
        if layout.state_layers:
            if block_hash not in self.snapshots and not self._load_snapshot(block_hash, token_ids):
                return False
            self.snapshots.pin(request_id, block_hash)
        return True

    def release(self, request_id: str) -> None:
        self.snapshots.unpin(request_id)

    def make_cache(self, block_ids: list[int], cache: list[Any], sync: bool = True) -> None:
        """Fills a fresh per-request cache with the given blocks (and the snapshot at their end). With
        `sync` the copy is waited for, so `restore_seconds` holds its device time; without, only launched
        (while other rows decode, a wait here would idle the device) and the time is the host's share."""
        started = time.perf_counter()
        layout, bs = self.layout, self.block_size
        depth = len(block_ids) * bs
        blocks = [self._blocks[b] for b in block_ids]
        swa = [b.swa for b in blocks[layout.window_start(depth) // bs :]]
        snapshot = None
        if layout.state_layers:
            snapshot = self.snapshots.get(self._hash_of[block_ids[-1]])
            if snapshot is None:
                raise RuntimeError("the pinned state snapshot of a prefix hit is gone")
        fill_cache(cache, layout, [b.kv for b in blocks], swa, depth, snapshot)
        # Evaluated (or launched) now rather than inside the prefill's graph, so the restore's time is its own.
        (mx.eval if sync else mx.async_eval)([c.state for c in cache])
        self.num_restores += 1
        self.restore_seconds += time.perf_counter() - started

    # -- SSD tier ------------------------------------------------------------------------------
    def queue_spill(self, block_hash: bytes, token_ids: tuple[int, ...], block: KVBlock) -> None:
        if self.ssd is not None:
            tensors = {}
            if block.swa is not None:
                if self.window_ssd is not None:
                    self._spill.add(self.window_ssd, block_hash, token_ids, {"swa": block.swa})
                    # The block file says it has a window file: without that file (a crash between the
                    # two writes, an eviction) the block is a miss, recomputed and stored whole again.
                    tensors[WINDOW_MARK] = mx.ones((1,), dtype=mx.uint8)
                else:
                    tensors["swa"] = block.swa
            if isinstance(block.kv, tuple):  # quantized: data, scales, biases
                tensors.update(zip(QUANT_TENSORS, block.kv))
            elif block.kv is not None:
                tensors["kv"] = block.kv
            self._spill.add(self.ssd, block_hash, token_ids, tensors)

    def queue_spill_snapshot(self, block_hash: bytes, token_ids: tuple[int, ...], snapshot: Snapshot) -> None:
        if self.state_ssd is not None:
            tensors = {f"s{j}.{k}.{str(a.dtype).rsplit('.', 1)[-1]}": a
                       for j, arrays in enumerate(snapshot) for k, a in enumerate(arrays)}
            self._spill.add(self.state_ssd, block_hash, token_ids, tensors)

    def drop_pending_spills(self) -> None:
        self._spill.clear()

    def spill_pending(self) -> None:
        """Hands last step's new blocks and snapshots to the SSD writer threads (the device-to-host copy is
        ours: it waits for the arrays)."""
        started = time.perf_counter()
        self._spill.flush()
        self.spill_seconds += time.perf_counter() - started

    def load_from_ssd(self, block_hash: bytes, token_ids: Sequence[int], block_id: int) -> bool:
        """Read-through on a memory miss: the block's data from disk into `block_id`, if it is there."""
        if self.ssd is None or not self.ssd.contains(block_hash):
            return False
        started = time.perf_counter()
        data = self.ssd.get(block_hash, token_ids)
        block = block_from_data(data, self.layout, self.dtype, log) if data is not None else None
        self.ssd_read_seconds += time.perf_counter() - started
        if block is None:
            return False
        has_window = WINDOW_MARK in data.tensors
        if has_window and (self.window_ssd is None or not self.window_ssd.contains(block_hash)):
            return False
        self.put(block_id, block_hash, KVBlock(*block))
        if block[1] is None and self.window_ssd is not None and self.window_ssd.contains(block_hash):
            self._window_on_disk[block_id] = (block_hash, tuple(token_ids))
        return True

    def _load_window(self, block_id: int) -> bool:
        """Reads a block's sliding KV from `window_ssd` into it, if it was left on disk."""
        entry = self._window_on_disk.get(block_id)
        block = self._blocks.get(block_id)
        if entry is None or block is None:
            return False
        started = time.perf_counter()
        data = self.window_ssd.get(*entry)
        swa = window_from_data(data, self.layout, self.dtype, log) if data is not None else None
        self.ssd_read_seconds += time.perf_counter() - started
        del self._window_on_disk[block_id]
        if swa is None:
            # The block stays without sliding KV: its hash must go, or no later request could store
            # it whole (a store skips hashes already cached). The prefix cache forgets it.
            self._lost_windows.append(block_id)
            return False
        block.swa = swa
        self._block_bytes += swa.nbytes
        return True

    def take_lost_windows(self) -> list[int]:
        """Blocks whose sliding KV could not be read back since the last call (for the prefix cache)."""
        lost, self._lost_windows = self._lost_windows, []
        return lost

    def _load_snapshot(self, block_hash: bytes, token_ids: Sequence[int]) -> bool:
        if self.state_ssd is None or not self.state_ssd.contains(block_hash):
            return False
        started = time.perf_counter()
        data = self.state_ssd.get(block_hash, token_ids)
        snapshot = snapshot_from_data(data, self.layout, log) if data is not None else None
        self.ssd_read_seconds += time.perf_counter() - started
        return snapshot is not None and self.put_snapshot(block_hash, snapshot)

    # -- housekeeping --------------------------------------------------------------------------
    def clear_ssd(self) -> int:
        self.drop_pending_spills()  # else they reach the disk after the clear
        return sum(t.clear() for t in (self.ssd, self.state_ssd, self.window_ssd) if t is not None)

    def close(self) -> None:
        self.spill_pending()
        for tier in (self.ssd, self.state_ssd, self.window_ssd):
            if tier is not None:
                tier.close()

    def stats(self) -> dict:
        """Blocks and snapshots per tier."""
        def disk(tier):
            return tier.stats() if tier is not None else None

        return {
            "memory": {"num_blocks": len(self._blocks), "block_bytes": self._block_bytes,
                       "num_snapshots": len(self.snapshots), "snapshot_bytes": self.snapshots.nbytes,
                       "snapshot_budget_bytes": self.snapshots.max_bytes,
                       "snapshot_evictions": self.snapshots.num_evictions},
            "ssd": disk(self.ssd),
            "ssd_snapshots": disk(self.state_ssd),
            "ssd_windows": disk(self.window_ssd),
            "timings": {"num_restores": self.num_restores, "restore_seconds": self.restore_seconds,
                        "ssd_read_seconds": self.ssd_read_seconds, "spill_seconds": self.spill_seconds},
        }

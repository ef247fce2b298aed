"""The physical half of the prefix cache: each cached block's arrays and the recurrent-state
snapshots, as MLX arrays, with an optional SSD tier behind them (write-behind for new data,
read-through on a memory miss).

A block holds one part per per-block role of the model (kv/roles/: `kv` [full layers, kv_heads, block_size,
key_width + value_width], and for sliding-window models `swa` with the sliding layers' KV of the same positions
when it was still in the window at store time); snapshot roles (recurrent state) are kept at block boundaries
by `SnapshotStore`. One array per role, not per layer: storing, attaching and spilling then cost a kernel
launch or a device-to-host copy per block (per layer, a hit was slower than recomputing: docs/BENCHMARKS.md).

A role with its own SSD folder (`tiers`: sliding windows, snapshots) is read back only where a hit needs it
(a window: the few blocks inside it where a hit resumes, not the whole chain).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import mlx.core as mx

from mlxhost.kv.cache_ops import ResumeIndex
from mlxhost.kv.kinds.layout import KVLayout
from mlxhost.kv.roles import ROLES, CacheRole
from mlxhost.kv.store.snapshots import SnapshotStore
from mlxhost.kv.store.spill import SpillQueue
from mlxhost.kv.store.ssd_tier import SSDTier

log = logging.getLogger(__name__)


@dataclass
class KVBlock:
    # Role name -> its part of this block; an optional role's is missing (or None) when the block has none
    # (sliding KV that had left the window).
    parts: dict[str, Any]

    @property
    def arrays(self) -> list[mx.array]:
        return [a for name, part in self.parts.items() for a in ROLES[name].arrays(part)]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


# Snapshot role name -> its snapshot at one block boundary.
Snapshot = dict[str, Any]


def snapshot_arrays(snapshot: Snapshot) -> list[mx.array]:
    return [a for name, part in snapshot.items() for a in ROLES[name].arrays(part)]


def snapshot_nbytes(snapshot: Snapshot) -> int:
    return sum(a.nbytes for a in snapshot_arrays(snapshot))


class KVBlockStore:
    def __init__(self, layout: KVLayout, block_size: int, ssd: SSDTier | None = None, dtype: mx.Dtype | None = None,
                 snapshot_bytes: int = 0, tiers: dict[str, SSDTier] | None = None) -> None:
        self.layout = layout
        self.block_size = block_size
        self._blocks: dict[int, KVBlock] = {}
        self._hash_of: dict[int, bytes] = {}
        self._block_bytes = 0
        self.snapshots = SnapshotStore(snapshot_bytes)
        self.ssd = ssd
        # Role name -> its own files (same format, own folder and cap); a per-block role without one keeps
        # its tensors inside the block files.
        self.tiers = dict(tiers or {})
        self._lost_parts: list[int] = []  # blocks whose part in a role's own file turned out unreadable
        # Blocks read from the SSD tier without a part their role's own tier holds: (role, block id) ->
        # (hash, tokens) to read it by once a hit needs it.
        self._on_disk: dict[tuple[str, int], tuple[bytes, tuple[int, ...]]] = {}
        self.dtype = dtype
        self._spill = SpillQueue()
        # What the prefix cache reads to decide where a hit resumes, kept as plain data (kv/cache_ops.py).
        optional = [role for role in layout.roles if role.per_block and role.optional]
        self.index = ResumeIndex({role.name: set() for role in optional},
                                 {role.name: partial(role.first_needed, layout) for role in optional},
                                 bool(layout.snapshot_roles), self.snapshots)
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
        return bool(self.layout.snapshot_roles) and self.snapshots.max_bytes > 0

    def keeps(self, role: CacheRole) -> bool:
        """Whether this store keeps `role`'s data: per-block roles always, snapshots within a budget."""
        return role.per_block or self.wants_snapshots

    def put(self, block_id: int, block_hash: bytes, block: KVBlock) -> None:
        self.drop(block_id)
        self._blocks[block_id] = block
        self._hash_of[block_id] = block_hash
        self._block_bytes += block.nbytes
        for name, ids in self.index.parts.items():
            if block.parts.get(name) is not None:
                ids.add(block_id)

    def drop(self, block_id: int) -> None:
        for role in self.layout.roles:
            self._on_disk.pop((role.name, block_id), None)
        block = self._blocks.pop(block_id, None)
        if block is not None:
            self._block_bytes -= block.nbytes
        for ids in self.index.parts.values():
            ids.discard(block_id)
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:  # a snapshot is reached only through its block
            self.snapshots.drop(block_hash)

    def clear(self) -> None:
        for block_id in list(self._blocks):
            self.drop(block_id)

    def put_snapshot(self, block_hash: bytes, snapshot: Snapshot) -> bool:
        """Keeps the snapshot roles' parts at the boundary ending the block `block_hash`, within the budget."""
        return self.snapshots.put(block_hash, snapshot, snapshot_nbytes(snapshot))

    # -- admission -----------------------------------------------------------------------------
    def can_resume(self, request_id: str, block_ids: Sequence[int], block_hash: bytes,
                   token_ids: Sequence[int]) -> bool:
        """Whether a request can start after these hit blocks (the last one's hash and tokens given): each
        optional per-block role has its part in the blocks it needs there (sliding KV in those covering the
        window), and the snapshot roles have a snapshot there (read from the SSD tier if need be), which is
        then pinned for `request_id`."""
        layout, bs = self.layout, self.block_size
        depth = len(block_ids) * bs
        for role in layout.roles:
            if not (role.per_block and role.optional):
                continue
            first = role.first_needed(layout, depth) // bs
            # A block planned this step is not copied yet: not known to carry the part.
            if any(self._part(b, role) is None and not self._load_part(role, b) for b in block_ids[first:]):
                return False
        if layout.snapshot_roles:
            if block_hash not in self.snapshots and not self._load_snapshot(block_hash, token_ids):
                return False
            self.snapshots.pin(request_id, block_hash)
        return True

    def _part(self, block_id: int, role: CacheRole) -> Any:
        block = self._blocks.get(block_id)
        return None if block is None else block.parts.get(role.name)

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
        for role in layout.roles:
            if role.per_block:
                needed = blocks[role.first_needed(layout, depth) // bs :]
                role.fill(cache, layout, [b.parts.get(role.name) for b in needed], depth)
        if layout.snapshot_roles:
            snapshot = self.snapshots.get(self._hash_of[block_ids[-1]])
            if snapshot is None:
                raise RuntimeError("the pinned state snapshot of a prefix hit is gone")
            for role in layout.snapshot_roles:
                role.fill(cache, layout, [snapshot[role.name]], depth)
        # Evaluated (or launched) now rather than inside the prefill's graph, so the restore's time is its own.
        (mx.eval if sync else mx.async_eval)([c.state for c in cache])
        self.num_restores += 1
        self.restore_seconds += time.perf_counter() - started

    # -- SSD tier ------------------------------------------------------------------------------
    def queue_spill(self, block_hash: bytes, token_ids: tuple[int, ...], block: KVBlock) -> None:
        if self.ssd is not None:
            tensors = {}
            for role in self.layout.roles:
                part = block.parts.get(role.name)
                if part is None:
                    continue
                own = self.tiers.get(role.name)
                if own is not None:
                    self._spill.add(own, block_hash, token_ids, role.to_tensors(part))
                    # The block file says the part has a file of its own: without that file (a crash between
                    # the two writes, an eviction) the block is a miss, recomputed and stored whole again.
                    tensors[role.ssd_mark] = mx.ones((1,), dtype=mx.uint8)
                else:
                    tensors.update(role.to_tensors(part))
            self._spill.add(self.ssd, block_hash, token_ids, tensors)

    def queue_spill_snapshot(self, block_hash: bytes, token_ids: tuple[int, ...], snapshot: Snapshot) -> None:
        for role in self.layout.snapshot_roles:
            tier = self.tiers.get(role.name)
            if tier is not None:
                self._spill.add(tier, block_hash, token_ids, role.to_tensors(snapshot[role.name]))

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
        parts = self._read_parts(data) if data is not None else None
        self.ssd_read_seconds += time.perf_counter() - started
        if parts is None:
            return False
        own = {role: self.tiers.get(role.name) for role in self.layout.roles if role.per_block}
        if any(role.ssd_mark in data.tensors and (tier is None or not tier.contains(block_hash))
               for role, tier in own.items()):
            return False
        self.put(block_id, block_hash, KVBlock(parts))
        for role, tier in own.items():
            if parts.get(role.name) is None and tier is not None and tier.contains(block_hash):
                self._on_disk[role.name, block_id] = (block_hash, tuple(token_ids))
        return True

    def _read_parts(self, data) -> dict[str, Any] | None:
        """The per-block roles' parts a block file holds, or None (a miss) if it does not fit this layout."""
        try:
            return {role.name: role.from_tensors(data.tensors, self.layout, self.dtype)
                    for role in self.layout.roles if role.per_block}
        except (KeyError, ValueError, TypeError) as exc:  # a file that passed the checks but not ours
            log.warning("SSD block unusable (%s): a miss", exc)
            return None

    def _load_part(self, role: CacheRole, block_id: int) -> bool:
        """Reads a block's part from its role's own tier into it, if it was left on disk."""
        entry = self._on_disk.get((role.name, block_id))
        block = self._blocks.get(block_id)
        if entry is None or block is None:
            return False
        del self._on_disk[role.name, block_id]
        started = time.perf_counter()
        data = self.tiers[role.name].get(*entry)
        part = None
        if data is not None:
            try:
                part = role.from_tensors(data.tensors, self.layout, self.dtype)
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("SSD %s file unusable (%s): a miss", role.name, exc)
        self.ssd_read_seconds += time.perf_counter() - started
        if part is None:
            # The block stays without this part: its hash must go, or no later request could store it
            # whole (a store skips hashes already cached). The prefix cache forgets it.
            self._lost_parts.append(block_id)
            return False
        block.parts[role.name] = part
        self.index.parts[role.name].add(block_id)
        self._block_bytes += sum(a.nbytes for a in role.arrays(part))
        return True

    def take_lost_windows(self) -> list[int]:
        """Blocks whose part in a role's own file (a sliding window) could not be read back since the last
        call (for the prefix cache)."""
        lost, self._lost_parts = self._lost_parts, []
        return lost

    def _load_snapshot(self, block_hash: bytes, token_ids: Sequence[int]) -> bool:
        tiers = {role: self.tiers.get(role.name) for role in self.layout.snapshot_roles}
        if any(tier is None or not tier.contains(block_hash) for tier in tiers.values()):
            return False
        started = time.perf_counter()
        snapshot = {}
        for role, tier in tiers.items():
            data = tier.get(block_hash, token_ids)
            if data is None:
                break
            try:
                snapshot[role.name] = role.from_tensors(data.tensors, self.layout, self.dtype)
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("SSD snapshot unusable (%s): a miss", exc)
                break
        self.ssd_read_seconds += time.perf_counter() - started
        return len(snapshot) == len(tiers) and self.put_snapshot(block_hash, snapshot)

    # -- housekeeping --------------------------------------------------------------------------
    def clear_ssd(self) -> int:
        self.drop_pending_spills()  # else they reach the disk after the clear
        return sum(t.clear() for t in self._all_tiers())

    def close(self) -> None:
        self.spill_pending()
        for tier in self._all_tiers():
            tier.close()

    def _all_tiers(self) -> list[SSDTier]:
        return [t for t in (self.ssd, *self.tiers.values()) if t is not None]

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
            # Every role with its own folder, whether or not this model has it (a stable shape for /v1/status).
            **{f"ssd_{role.ssd_stats}": disk(self.tiers.get(role.name)) for role in ROLES if role.ssd_folder},
            "timings": {"num_restores": self.num_restores, "restore_seconds": self.restore_seconds,
                        "ssd_read_seconds": self.ssd_read_seconds, "spill_seconds": self.spill_seconds},
        }

"""The budget while running: desktop mode re-reads free memory now and then and gives memory back in
order — budget nobody holds yet (idle KV headroom, the prefix cache's empty room), then the prefix
cache's blocks (LRU first), then the KV that admission may hand to new requests — and takes it back
when the pressure passes. Running requests are never touched: they finish with what they hold.

No MLX here. The governor acts on the prefix cache through its public handle (`set_max_cached_blocks`)
and moves the KV capacity it shares with the scheduler (capacity.py), so tests drive it with fake
readings.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from mlxhost.memory.budget import MemoryBudget, MemoryBudgetError, kv_tokens, shrink_for_pressure
from mlxhost.memory.capacity import KVCapacity
from mlxhost.memory.device import MemoryReadings, read_memory
from mlxhost.memory.release import give_back_memory

log = logging.getLogger(__name__)

_MIB = 1 << 20
# A new ceiling closer than this to the one in force is noise (a browser tab, the page cache) and
# is not applied: no evict/regrow flapping and no log line every refresh.
_MIN_CHANGE_BYTES = 64 * _MIB
_MIN_CHANGE_FRACTION = 0.01


@dataclass(frozen=True)
class MemoryLimits:
    """What the engine enforces for a budget: a cap on cached prefix blocks and the KV tokens that
    admission may hand out (None: no prefix cache / no KV limit)."""

    prefix_blocks: int | None
    kv_tokens: int | None
    snapshot_bytes: int | None = None  # recurrent-state snapshots' share of the prefix memory


def limits_for(
    budget: MemoryBudget, kv_bytes_per_token: int, block_bytes: int | None, kv_tokens_override: int | None,
    snapshot_share: float = 0.0,
) -> MemoryLimits:
    """An explicit `--kv-budget-tokens` is the operator's number and stays fixed. `snapshot_share`: the
    part of the prefix memory that snapshots had at start-up; they keep that part as it shrinks."""
    snapshots = int(budget.prefix_cache * snapshot_share) if snapshot_share else None
    prefix = (budget.prefix_cache - (snapshots or 0)) // block_bytes if block_bytes else None
    kv = kv_tokens_override if kv_tokens_override is not None else kv_tokens(budget, kv_bytes_per_token)
    return MemoryLimits(prefix, kv, snapshots)


class MemoryGovernor:
    """Owns the live budget. `maybe_refresh()` is cheap (a clock read) between refreshes; a refresh
    reads memory (/proc on Linux, `vm_stat` on macOS) and applies the new limits if they moved."""

    def __init__(
        self,
        budget: MemoryBudget,
        kv_bytes_per_token: int,
        prefix: Any = None,
        scheduler: Any = None,
        *,
        block_bytes: int | None = None,
        kv_tokens_override: int | None = None,
        capacity: KVCapacity | None = None,
        refresh_s: float = 2.0,
        read: Callable[[], MemoryReadings] = read_memory,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.startup = budget
        self.live = budget
        self.prefix = prefix
        self.scheduler = scheduler  # read only: the KV its running requests hold
        self.capacity = capacity  # the KV tokens admission may hand out: set here under pressure
        self.vision_cache = None  # a VLM's VisionCache, set by its owner: shrinks with the budget
        self.snapshots = None  # recurrent-state snapshots (attach_snapshots): shrink with the prefix share
        self._snapshot_share = 0.0
        self._per_token = kv_bytes_per_token
        self._block_bytes = block_bytes if prefix is not None else None
        self._kv_override = kv_tokens_override
        self._read = read
        self._clock = clock
        # Dedicated mode takes a fixed share and ignores what others hold: nothing to follow.
        self.refresh_s = refresh_s if budget.mode == "desktop" else 0.0
        self._next = clock() + self.refresh_s
        self.num_refreshes = 0
        self.num_changes = 0
        self.limits = limits_for(budget, kv_bytes_per_token, self._block_bytes, kv_tokens_override)

    def attach_snapshots(self, snapshots: Any) -> None:
        """A hybrid model's SnapshotStore: it keeps the share of the prefix memory it started with."""
        if snapshots is None or not self.startup.prefix_cache:
            return
        self.snapshots = snapshots
        self._snapshot_share = min(1.0, snapshots.max_bytes / self.startup.prefix_cache)
        self.limits = self._limits(self.live)

    def _limits(self, budget: MemoryBudget) -> MemoryLimits:
        return limits_for(budget, self._per_token, self._block_bytes, self._kv_override, self._snapshot_share)

    def maybe_refresh(self) -> bool:
        """Refreshes when `refresh_s` has passed since the last one; True when the limits changed."""
        if not self.refresh_s:
            return False
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self.refresh_s
        return self.refresh()

    def refresh(self, readings: MemoryReadings | None = None) -> bool:
        readings = readings if readings is not None else self._read()
        self.num_refreshes += 1
        new = shrink_for_pressure(self.startup, readings, *self._in_use())
        if not self._worth_applying(new):
            self.live = _with_ceiling_of(self.live, new)
            return False
        old = self.live
        self.live = new
        self.num_changes += 1
        evicted = self._apply(self._limits(new))
        if evicted:
            give_back_memory(collect=False)  # evicted blocks' buffers back to the system, not MLX's cache
        if self.vision_cache is not None:
            self.vision_cache.set_max_bytes(new.vision_cache)  # what the budget takes, the cache gives back
        # Info only when it bites (blocks evicted, new requests may wait); idle budget moving is routine.
        kv = self.limits.kv_tokens
        bites = evicted or (kv is not None and self.scheduler is not None
                            and kv < self.scheduler.num_committed_kv_tokens)
        log.log(
            logging.INFO if bites else logging.DEBUG,
            "memory %s: ceiling %.2f -> %.2f GiB; prefix cache <= %s blocks (%d evicted), KV %s tokens for new"
            " requests (read: %.2f GiB free, this process %.2f GiB, MLX %.2f GiB active + %.2f GiB cached)",
            "pressure" if new.ceiling < old.ceiling else "freed", old.ceiling / (1 << 30),
            new.ceiling / (1 << 30), self.limits.prefix_blocks, evicted, kv, readings.available_now / (1 << 30),
            readings.held_by_process / (1 << 30), (readings.mlx_active or 0) / (1 << 30),
            (readings.mlx_cache or 0) / (1 << 30),
        )
        return True

    def _in_use(self) -> tuple[int | None, int | None]:
        """(prefix-cache bytes held, KV bytes committed to running requests): budget beyond these is
        given up first, at no cost."""
        prefix = self.prefix.pool.num_cached * self._block_bytes if self._block_bytes else None
        if prefix is not None and self.snapshots is not None:
            prefix += self.snapshots.nbytes
        kv = self.scheduler.num_committed_kv_tokens * self._per_token if self.scheduler is not None else None
        return prefix, kv

    def _worth_applying(self, new: MemoryBudget) -> bool:
        if new.ceiling == self.live.ceiling:
            return False
        if new.ceiling == self.startup.ceiling:
            return True  # back to full: always restore exactly
        step = max(_MIN_CHANGE_BYTES, int(_MIN_CHANGE_FRACTION * self.startup.ceiling))
        return abs(new.ceiling - self.live.ceiling) >= step

    def _apply(self, limits: MemoryLimits) -> int:
        """Prefix cache first (its blocks are only saved recompute), then new admissions' KV."""
        evicted = 0
        if self.prefix is not None and limits.prefix_blocks is not None:
            evicted = self.prefix.set_max_cached_blocks(limits.prefix_blocks)
        if self.snapshots is not None and limits.snapshot_bytes is not None:
            evicted += self.snapshots.set_max_bytes(limits.snapshot_bytes)
        if self.capacity is not None:
            self.capacity.set_limit(limits.kv_tokens)
        self.limits = limits
        return evicted

    def hold_fixed(self, nbytes: int) -> None:
        """`nbytes` more held from now on outside KV and the caches (LoRA adapters loaded at run time;
        negative: given back). They leave the KV share, in the start-up budget and the live one, so new
        admissions see the room they take. MemoryBudgetError where KV has not that much to give."""
        if nbytes > self.live.kv:
            raise MemoryBudgetError(f"{nbytes / 1e6:.1f} MB more do not fit: the KV budget holds "
                                    f"{self.live.kv / 1e6:.1f} MB")
        self.startup = replace(self.startup, weights=self.startup.weights + nbytes, kv=self.startup.kv - nbytes)
        self.live = replace(self.live, weights=self.live.weights + nbytes, kv=self.live.kv - nbytes)
        self._apply(self._limits(self.live))

    def status(self) -> dict:
        return {
            "refresh_s": self.refresh_s,
            "num_refreshes": self.num_refreshes,
            "num_changes": self.num_changes,
            "prefix_cache_max_blocks": self.limits.prefix_blocks,
            "kv_capacity_tokens": self.capacity.tokens if self.capacity is not None else self.limits.kv_tokens,
        }


def _with_ceiling_of(live: MemoryBudget, new: MemoryBudget) -> MemoryBudget:
    """The budget in force, with the freshest free_for_others (a number for display only)."""
    return replace(live, free_for_others=new.free_for_others + new.ceiling - live.ceiling)

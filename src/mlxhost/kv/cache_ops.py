"""The prefix cache's physical work as data: what the logical half decided, carried in the step plan. No MLX here.

The prefix cache manager never calls the physical half (the runner's block store). Whatever it needs done there
(free an evicted block's arrays, read a block back from the SSD tier, find how deep a hit can resume on a model
with sliding windows or recurrent state) it queues as one of these ops; the scheduler puts them in its output,
and the store runs them, in order, at the start of the runner's step (`kv/store/ops.py`), on every rank of a
distributed server alike. What the store found comes back as `CacheResults` before the next `schedule()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Container, Protocol, Union


class DiskIndex(Protocol):
    """Hashes known to be on disk (the SSD tier's own in-memory index): a dict lookup, no file I/O."""

    def contains(self, block_hash: bytes) -> bool: ...


@dataclass(frozen=True)
class DropBlock:
    """The block's hash left the cache: its arrays (and the snapshot at its end) go."""

    block_id: int


@dataclass(frozen=True)
class LoadBlock:
    """Read the block stored on disk under this hash and these tokens into `block_id`."""

    block_id: int
    block_hash: bytes
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class CheckResume:
    """How deep `request_id`'s hit can resume (its window blocks carry sliding KV, a state snapshot exists
    there, read from disk if need be and then pinned for it): the blocks, their hashes and tokens."""

    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    token_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class PinSnapshot:
    """The snapshot at the end of `request_id`'s hit, in memory when it was decided: kept until it unpins."""

    request_id: str
    block_hash: bytes


@dataclass(frozen=True)
class UnpinSnapshot:
    """The request's hold ended: the snapshot its check pinned may be evicted again."""

    request_id: str


@dataclass(frozen=True)
class ClearDisk:
    """Delete every block and snapshot file (and the blocks still queued for writing)."""


CacheOp = Union[DropBlock, LoadBlock, CheckResume, PinSnapshot, UnpinSnapshot, ClearDisk]


@dataclass
class ResumeIndex:
    """Where a hit can resume without reading the disk, as plain data the store keeps up to date as it runs the
    ops and copies blocks: a hit whose whole depth passes needs no CheckResume (and no step's wait)."""

    # Optional per-block role (sliding KV) -> ids of the blocks whose part is in memory.
    parts: dict[str, set[int]] = field(default_factory=dict)
    # Role -> the first position whose part a request resumed after n tokens reads (a pure function).
    first_needed: dict[str, Callable[[int], int]] = field(default_factory=dict)
    needs_snapshot: bool = False
    snapshots: Container[bytes] = frozenset()  # hashes with a snapshot in memory


@dataclass(frozen=True)
class CacheResults:
    """What running a plan's ops found: the same on every rank, or the ranks' caches differ."""

    failed_loads: tuple[int, ...] = ()  # blocks whose LoadBlock found no usable file
    resume_depths: tuple[tuple[str, int], ...] = ()  # (request id, blocks it resumes after), per CheckResume
    lost_windows: tuple[int, ...] = ()  # blocks whose sliding KV could not be read back: stored whole again

    def depth_of(self, request_id: str) -> int | None:
        """The depth the last check for `request_id` found (a request preempted and admitted again in one step
        was checked twice), or None if none was made."""
        found = None
        for rid, depth in self.resume_depths:
            if rid == request_id:
                found = depth
        return found

"""Recurrent-state snapshots at block boundaries, in memory, under a byte budget. No MLX here: a
snapshot is whatever the runner hands in, with its size.

Keyed by the chained hash of the block that ends at the boundary, like the blocks themselves. A
snapshot chosen at admission is pinned by that request until it is released, so the budget cannot
evict it between the lookup and the prefill that resumes from it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any


class SnapshotStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()  # front = least recently used
        self._pins: Counter[bytes] = Counter()
        self._pinned_by: dict[str, bytes] = {}
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def put(self, block_hash: bytes, snapshot: Any, nbytes: int) -> bool:
        if nbytes > self.max_bytes:
            return False
        self.drop(block_hash)
        self._entries[block_hash] = (snapshot, nbytes)
        self.nbytes += nbytes
        self._evict_over_budget()
        return block_hash in self._entries

    def get(self, block_hash: bytes) -> Any | None:
        entry = self._entries.get(block_hash)
        if entry is None:
            return None
        self._entries.move_to_end(block_hash)
        return entry[0]

    def drop(self, block_hash: bytes) -> None:
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self.nbytes -= entry[1]

    def clear(self) -> None:
        for block_hash in [h for h in self._entries if not self._pins[h]]:
            self.drop(block_hash)

    def pin(self, request_id: str, block_hash: bytes) -> None:
        self.unpin(request_id)
        self._pins[block_hash] += 1
        self._pinned_by[request_id] = block_hash

    def unpin(self, request_id: str) -> None:
        block_hash = self._pinned_by.pop(request_id, None)
        if block_hash is not None:
            self._pins[block_hash] -= 1
            if not self._pins[block_hash]:
                del self._pins[block_hash]
            self._evict_over_budget()

    def set_max_bytes(self, max_bytes: int) -> int:
        """A new budget (the memory governor's, under pressure or after it); returns how many snapshots
        went. Pinned ones stay: a request is about to resume from each."""
        before = self.num_evictions
        self.max_bytes = max_bytes
        self._evict_over_budget()
        return self.num_evictions - before

    def _evict_over_budget(self) -> None:
        for block_hash in list(self._entries):
            if self.nbytes <= self.max_bytes:
                return
            if not self._pins[block_hash]:
                self.drop(block_hash)
                self.num_evictions += 1

"""Vision-encoder outputs kept by content hash, so a picture sent again skips the vision tower.

An LRU bounded by the bytes of its MLX arrays. Used only from the engine thread, which owns the model
and its MLX stream: no locks (another thread calling in would be a bug, not a race to guard against).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx


def _nbytes(value: Any) -> int:
    if isinstance(value, mx.array):
        return value.nbytes
    if isinstance(value, (list, tuple)):  # e.g. Qwen3-VL's deepstack features, one array per layer
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


@dataclass
class VisionCacheEntry:
    """Encoder outputs of one image or video.

    `arrays` maps a name to an mx.array or a list of them ("features", "deepstack", "grid_thw", ...);
    `meta` holds small plain values (token count, model id, ...). Evaluate the arrays before `put`:
    the size comes from shapes, but a lazy graph would keep its inputs alive too.
    """

    arrays: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = _nbytes(self.arrays)


class VisionCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, VisionCacheEntry] = OrderedDict()  # oldest first
        self._bytes = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        """Membership without touching recency or the hit counters."""
        return key in self._entries

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> VisionCacheEntry | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: str, entry: VisionCacheEntry) -> bool:
        """Store (or replace) `key`, evicting least recently used entries; False if it can never fit."""
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        if entry.nbytes > self.max_bytes:
            return False
        while self._bytes + entry.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes
            self.evictions += 1
        self._entries[key] = entry
        self._bytes += entry.nbytes
        return True

    def set_max_bytes(self, max_bytes: int) -> int:
        """New size limit (memory pressure); evicts least recently used entries down to it. Returns
        how many were evicted."""
        self.max_bytes = max(0, max_bytes)
        evicted = 0
        while self._bytes > self.max_bytes:
            _, entry = self._entries.popitem(last=False)
            self._bytes -= entry.nbytes
            self.evictions += 1
            evicted += 1
        return evicted

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "bytes": self._bytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "misses": self.misses, "evictions": self.evictions}

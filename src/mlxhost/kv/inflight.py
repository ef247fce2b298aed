"""Prompt blocks being computed right now, by hash: which request prefills each one. No MLX here.

A request that shares a prefix with one still prefilling would otherwise compute the same blocks again
beside it (agents send a sub-agent's or a title helper's request with the same long system prompt at
once). With this table the scheduler lets such a request wait until the owner's blocks are in the prefix
cache, then admits it with the hit. A block stays "in flight" from its owner's admission until the
runner has copied it into the cache (one step after its store was planned, so a request resuming there
finds its data, sliding windows and recurrent snapshots included), or until the owner ends.
"""

from __future__ import annotations

from typing import Iterable, Sequence


class InflightBlocks:
    def __init__(self) -> None:
        self._owner: dict[bytes, str] = {}  # block hash -> the request computing it
        self._owned: dict[str, list[bytes]] = {}  # request id -> the hashes it claimed
        self._copying: list[bytes] = []  # planned in the last step: copied once the next one starts

    def __len__(self) -> int:
        return len(self._owner)

    def owner(self, block_hash: bytes) -> str | None:
        return self._owner.get(block_hash)

    def claim(self, request_id: str, hashes: Iterable[bytes]) -> None:
        """`request_id` will compute these blocks (those no one else computes already)."""
        mine = self._owned.setdefault(request_id, [])
        for h in hashes:
            if h not in self._owner:
                self._owner[h] = request_id
                mine.append(h)

    def planned(self, hashes: Iterable[bytes]) -> None:
        """Their stores were planned this step: they land when the next step starts (`copied`)."""
        self._copying.extend(h for h in hashes if h in self._owner)

    def copied(self) -> None:
        """The last step's planned stores were copied: those blocks are ordinary cache entries now."""
        for h in self._copying:
            self._owner.pop(h, None)
        self._copying = []

    def release(self, request_id: str) -> None:
        """The owner ends (or its prompt's stores are all planned): what it has not planned, no one computes
        any more. Planned blocks stay in flight until copied."""
        copying = set(self._copying)
        for h in self._owned.pop(request_id, ()):
            if self._owner.get(h) == request_id and h not in copying:
                del self._owner[h]

    def clear(self) -> None:
        self._owner.clear()
        self._owned.clear()
        self._copying = []

    def waits_for(self, hashes: Sequence[bytes], is_cached) -> str | None:
        """The request whose blocks a prompt with these block hashes should wait for, or None: the first
        of its blocks that is not simply cached is someone's in flight. `is_cached(hash)` says whether
        the prefix cache holds a block."""
        if not self._owner:
            return None
        for h in hashes:
            owner = self._owner.get(h)
            if owner is not None:
                return owner
            if not is_cached(h):
                return None
        return None

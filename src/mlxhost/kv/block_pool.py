"""The logical KV block pool: ids, reference counts, the hash index and the free queues.

No arrays live here; the runner's physical half maps a block id to its slice of the KV
buffers. The pool is the single owner of every `Block` and of the two free queues.

Free blocks sit in one of three queues:
  * `empty_queue`: free blocks that hold nothing worth keeping (no hash). Order does not
    matter; they are handed out first because reusing them costs no cached prefix.
  * `free_queue`: free blocks that still hold a cached full block, in LRU order (front =
    evicted first). Their hash stays in `cached` until the block is reallocated (lazy
    eviction), so a freed prefix remains a hit until memory is actually needed.
  * `kept_queue`: free cached blocks a client asked to keep (a cache breakpoint, a prompt cache
    key) until `keep_until`, in LRU order. They are evicted only when `free_queue` is empty: a
    hint, not a guarantee, so an allocation never fails while a kept block could serve it. Expired
    ones move to `free_queue` when it runs dry, before any kept block is taken.
Invariant: a free block is in `empty_queue` if it has no hash, else in `kept_queue` iff its
`keep_until` is set, else in `free_queue`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

EvictCallback = Callable[[bytes, int], None]


class NoFreeBlocksError(RuntimeError):
    """Fewer free blocks than requested; the caller should wait or preempt."""


@dataclass(eq=False)  # identity semantics: two blocks are never "equal"
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    # Tokens of a cached full block: a hash hit is only trusted if these match.
    token_ids: tuple[int, ...] | None = None
    # Clock time until which a client asked to keep it ahead of LRU eviction; 0: no such hint.
    keep_until: float = 0.0
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


class FreeBlockQueue:
    """Doubly linked list of blocks with sentinels: O(1) popleft, append and remove.

    A deque cannot remove from the middle in O(1), and a prefix hit on a free cached block
    must pull exactly that block out of the queue.
    """

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def popleft(self) -> Block:
        if self._len == 0:
            raise IndexError("popleft from an empty FreeBlockQueue")
        block = self._head.next_free
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in a free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in a free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1


@dataclass(frozen=True)
class CowResult:
    """Outcome of copy_on_write: the physical half copies src -> dst when they differ."""

    src_block_id: int
    block: Block

    @property
    def dst_block_id(self) -> int:
        return self.block.block_id

    @property
    def needs_copy(self) -> bool:
        return self.src_block_id != self.block.block_id


class BlockPool:
    """Owns all blocks, the free queues and the hash -> block index.

    `on_evict(block_hash, block_id)` is called whenever a hash leaves the index, so the
    physical half or the SSD tier can react (e.g. spill the block before it is overwritten).
    Stats: `num_hits` / `num_misses` / `num_collisions` count block lookups (a waiting
    request that is looked up again counts again); `num_evictions` counts hashes dropped
    to make room (reuse or cap), not those dropped by `reset`.
    """

    def __init__(
        self, num_blocks: int, block_size: int, on_evict: EvictCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks/block_size, got {num_blocks}/{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.on_evict = on_evict
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.empty_queue = FreeBlockQueue(self.blocks)
        self.free_queue = FreeBlockQueue()
        self.kept_queue = FreeBlockQueue()
        self.clock = clock
        # No kept block expires before this: the scan for expired ones is skipped until then.
        self._next_expiry = float("inf")
        self.cached: dict[bytes, Block] = {}
        self.num_hits = 0
        self.num_misses = 0
        self.num_collisions = 0
        self.num_evictions = 0

    # -- sizes ---------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.empty_queue) + len(self.free_queue) + len(self.kept_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (free cached blocks count as free)."""
        return self.num_used / self.num_blocks

    def iter_free(self) -> Iterator[Block]:
        """Free blocks in the order `allocate` hands them out."""
        yield from self.empty_queue
        yield from self.free_queue
        yield from self.kept_queue

    @property
    def num_kept(self) -> int:
        """Free cached blocks under a keep hint (referenced ones are not evictable anyway)."""
        return len(self.kept_queue)

    # -- allocation ----------------------------------------------------------

    def allocate(self, n: int) -> list[Block]:
        """Take n free blocks with ref_count 1; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise NoFreeBlocksError(f"need {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self.empty_queue:
                block = self.empty_queue.popleft()
            else:
                block = self._pop_cached()
                self._drop_hash(block)  # lazy eviction: only now is the content lost
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference; a free cached block comes back into use without recompute."""
        for block in blocks:
            if block.ref_count == 0:
                self._queue_of(block).remove(block)
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop a reference; blocks reaching 0 become free, in the order given.

        Cached blocks go to the back of the LRU queue, so callers pass a sequence's blocks
        tail first: the tail is then evicted before the head, which other requests share.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"block {block.block_id} freed more often than referenced")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.keep_until and block.keep_until <= self.clock():
                    block.keep_until = 0.0  # expired while in use: plain LRU from now on
                self._queue_of(block).append(block)

    def copy_on_write(self, block: Block) -> CowResult:
        """Give the caller a private block to write into.

        If others share `block`, allocate a new one and drop the caller's reference to the
        old one; the physical half must copy src -> dst (see CowResult.needs_copy).
        """
        if block.ref_count <= 0:
            raise ValueError(f"block {block.block_id} is not referenced")
        if block.ref_count == 1:
            return CowResult(block.block_id, block)
        (new_block,) = self.allocate(1)
        self.free([block])  # ref_count > 1, so it stays in use by the others
        return CowResult(block.block_id, new_block)

    # -- the hash index ------------------------------------------------------

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> Block | None:
        """The cached block for this hash, if its stored tokens match `token_ids`."""
        block = self.cached.get(block_hash)
        if block is None:
            self.num_misses += 1
            return None
        if block.token_ids != tuple(token_ids):
            # Same hash, other tokens: a collision (or a corrupted entry); never serve it.
            self.num_collisions += 1
            self.num_misses += 1
            return None
        self.num_hits += 1
        return block

    def cache_full_block(
        self, block: Block, block_hash: bytes, token_ids: Sequence[int]
    ) -> Block:
        """Register a filled block under its hash; return the block the index now serves.

        If another block already holds this hash, it is kept and returned and `block` stays
        uncached, so the caller can dedupe. On a collision (same hash, other tokens) nothing
        is registered and `block` itself is returned, still uncached.
        """
        if block.ref_count <= 0:
            raise ValueError(f"block {block.block_id} must be held while it is cached")
        if len(token_ids) != self.block_size:
            raise ValueError(f"a cached block needs {self.block_size} tokens, got {len(token_ids)}")
        tokens = tuple(token_ids)
        existing = self.cached.get(block_hash)
        if existing is not None:
            if existing.token_ids != tokens:
                self.num_collisions += 1
                return block
            return existing
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is already cached under another hash")
        block.block_hash = block_hash
        block.token_ids = tokens
        self.cached[block_hash] = block
        return block

    def keep(self, block: Block, until: float) -> None:
        """Keeps a cached block ahead of LRU eviction until clock time `until` (a later hint extends
        an earlier one, never shortens it)."""
        if block.block_hash is None or until <= block.keep_until:
            return
        if block.ref_count == 0 and not block.keep_until:
            self.free_queue.remove(block)
            self.kept_queue.append(block)
        block.keep_until = until
        self._next_expiry = min(self._next_expiry, until)

    def uncache(self, block: Block) -> None:
        """Forgets a block's hash while it may still be referenced (its data never arrived); once
        freed it goes back as an empty block."""
        if block.is_cached:
            self._drop_hash(block)

    def evict_unreferenced(self, n: int) -> int:
        """Drop the hashes of up to n free cached blocks, least recently used first.

        For cap enforcement. Cached blocks still referenced are never touched, so the cap is
        soft while requests hold them. Returns how many were evicted.
        """
        count = 0
        while count < n and (self.free_queue or self.kept_queue):
            block = self._pop_cached()
            self._drop_hash(block)
            self.empty_queue.append(block)
            count += 1
        self.num_evictions += count
        return count

    def reset(self) -> bool:
        """Forget every cached hash; refuse (return False, change nothing) if any block is
        in use, because a running request's blocks would otherwise lose or keep hashes
        inconsistently. Use `evict_unreferenced(num_cached)` for a partial clear."""
        if self.num_free != self.num_blocks:
            return False
        while self.free_queue or self.kept_queue:
            block = self._pop_cached()
            self._drop_hash(block)
            self.empty_queue.append(block)
        return True

    # -- internals -----------------------------------------------------------

    def _queue_of(self, block: Block) -> FreeBlockQueue:
        if block.block_hash is None:
            return self.empty_queue
        return self.kept_queue if block.keep_until else self.free_queue

    def _pop_cached(self) -> Block:
        """The free cached block to evict next: plain LRU first, then kept blocks whose time is up (in
        LRU order), and only then the least recently used kept block."""
        if not self.free_queue:
            self._expire()
        queue = self.free_queue if self.free_queue else self.kept_queue
        return queue.popleft()

    def _expire(self) -> None:
        now = self.clock()
        if now < self._next_expiry:
            return
        self._next_expiry = float("inf")
        for block in list(self.kept_queue):
            if block.keep_until <= now:
                self.kept_queue.remove(block)
                block.keep_until = 0.0
                self.free_queue.append(block)
            else:
                self._next_expiry = min(self._next_expiry, block.keep_until)

    def _drop_hash(self, block: Block) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        if self.cached.get(block_hash) is block:
            del self.cached[block_hash]
        block.block_hash = None
        block.token_ids = None
        block.keep_until = 0.0
        if self.on_evict is not None:
            self.on_evict(block_hash, block.block_id)

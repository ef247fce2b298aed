"""The logical half of the prefix cache: which blocks a prompt can reuse, which a finished request
adds. No MLX here; the runner's `KVBlockStore` holds the arrays under the same block ids.

Stored blocks are immutable copies: a running request attaches them to its own cache (one copy)
and writes its new tokens there, never into a shared block. Divergence inside a block therefore
needs no copy-on-write at run time: the diverging block simply has another hash and is computed.
Blocks stay referenced while a request that hit them runs, so eviction never takes them.

The physical half is never called from here: evictions, reads from the SSD tier and the checks of where a hit
can resume are queued as ops (`cache_ops.py`) that the step plan carries to the store; their results come back
through `finish_ops` before the next step is scheduled. A hit that needs them waits for them (`PrefixHold.loading`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from mlxhost.kv.block_pool import Block, BlockPool
from mlxhost.kv.cache_ops import (
    CacheOp,
    CacheResults,
    CheckResume,
    ClearDisk,
    DiskIndex,
    DropBlock,
    LoadBlock,
    PinSnapshot,
    ResumeIndex,
    UnpinSnapshot,
)
from mlxhost.kv.hashing import extend_block_hashes
from mlxhost.kv.inflight import InflightBlocks

# (start, end, content hash) of a prompt's image/video placeholder runs; see hashing.extend_block_hashes.
MediaSpans = Sequence[tuple[int, int, str]]


@dataclass(frozen=True)
class StoreOp:
    """Copy tokens [start, start + block_size) of a request's KV into block `block_id`."""

    block_id: int
    start: int
    block_hash: bytes
    token_ids: tuple[int, ...]
    # The block ends where the request's KV ends: its recurrent state is at this boundary right now.
    is_row_end: bool = False


class PrefixHold:
    """A request's hold on the prefix cache, from its lookup to the one place it leaves the scheduler: the hit
    blocks it references, where the store checks hits (sliding windows, recurrent state) the snapshot that
    check pinned for it, and its claim on the blocks it computes (`InflightBlocks`). `loading` while the plan's
    loads or check for it are out: its prefill waits for them. `release()` gives everything back once; calling
    it again does nothing."""

    def __init__(self, manager: PrefixCacheManager, request_id: str, blocks: list[Block]) -> None:
        self._manager = manager
        self.request_id = request_id
        self.blocks = blocks
        self.pinned = False  # the store may hold a snapshot pinned for it (a PinSnapshot or a CheckResume)
        self.checked = False  # a CheckResume is out for it: it ends where that check found it can resume
        self.loading = False
        self.released = False
        self._inflight: InflightBlocks | None = None

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self._manager.block_size

    def claim(self, inflight: InflightBlocks, hashes: Sequence[bytes]) -> None:
        """It computes these blocks: requests that need them wait for them instead of computing them too."""
        inflight.claim(self.request_id, hashes)
        self._inflight = inflight

    def release_claim(self) -> None:
        """Every block it could store is planned (or it ends): it computes no more of them for others."""
        if self._inflight is not None:
            self._inflight.release(self.request_id)
            self._inflight = None

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.release_claim()
            self._manager._release(self)


class PrefixCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_key: str,
        disk: DiskIndex | None = None,
        resume: ResumeIndex | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.model_key = model_key
        # An evicted block's arrays are dropped by the store at the start of the next step (a DropBlock op),
        # before the block's new data (a copy or a load planned in the same step) arrives.
        self.pool = BlockPool(num_blocks, block_size, on_evict=self._on_evict, clock=clock)
        self.disk = disk  # hashes the SSD tier holds: a memory miss found there is loaded by the plan
        # Where the store says a hit may end (sliding windows, snapshots): None, anywhere. Read as plain data;
        # what it cannot answer from memory a CheckResume op asks.
        self.resume = resume
        self._ops: list[CacheOp] = []  # for the next plan, in the order they were decided
        # Evicted since the plan was last taken: the store still holds their old data until the plan runs.
        self._dropped_ids: set[int] = set()
        self._dropped_hashes: set[bytes] = set()
        self._loads: dict[int, LoadBlock] = {}  # block id -> its load, until the plan's results come back
        self._waiting: list[PrefixHold] = []  # holds whose loads or check are out
        self._writing: list[Block] = []  # planned stores, held until the runner has copied them
        self.max_cached_blocks = num_blocks  # lowered under memory pressure, see set_max_cached_blocks
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def hashes(self, token_ids: Sequence[int], media_spans: MediaSpans = (),
               known: list[bytes] | None = None) -> list[bytes]:
        """Chained hashes of the full blocks of `token_ids`. `known` (hashes of a prefix of the same tokens,
        a request's memo) is extended in place, so a growing sequence is hashed once; the result covers
        exactly the full blocks of `token_ids`."""
        known = [] if known is None else known
        extend_block_hashes(known, token_ids, self.block_size, model_key=self.model_key, media_spans=media_spans)
        return known[: len(token_ids) // self.block_size]

    def is_cached(self, block_hash: bytes) -> bool:
        """Whether memory holds this block now (a peek: nothing is held or touched)."""
        return block_hash in self.pool.cached

    def keep(self, hashes: Sequence[bytes], ttl_s: float) -> int:
        """Keeps the cached blocks among `hashes` ahead of LRU eviction for `ttl_s` seconds from now (a
        client's cache breakpoint or prompt cache key); a hit on them renews it, as Anthropic's TTL does.
        Returns how many were cached (the rest are kept once stored, if asked again)."""
        until = self.pool.clock() + ttl_s
        count = 0
        for h in hashes:
            block = self.pool.cached.get(h)
            if block is not None:
                self.pool.keep(block, until)
                count += 1
        return count

    # -- admission -----------------------------------------------------------------------------
    def lookup(self, request_id: str, token_ids: Sequence[int], media_spans: MediaSpans = (),
               hashes: list[bytes] | None = None, max_blocks: int | None = None) -> PrefixHold:
        """The hold of `request_id` on the longest run of cached full blocks at the start of the prompt (at most
        `max_blocks`). At least one prompt token is always left to compute (it yields the logits). Blocks
        only on disk are loaded by the plan, and where the store checks hits a check is planned: such a hold
        is `loading` until `finish_ops` settles it. `hashes`: the prompt's block hashes if the caller keeps
        them (see `hashes`)."""
        bs = self.block_size
        hashes = self.hashes(token_ids, media_spans, hashes)[: (len(token_ids) - 1) // bs][:max_blocks]
        hold = PrefixHold(self, request_id, [])
        if max_blocks == 0:
            return hold
        for i, h in enumerate(hashes):
            tokens = token_ids[i * bs : (i + 1) * bs]
            block = self.pool.lookup(h, tokens)
            if block is None:
                block = self._load_cold(h, tokens)
            if block is None:
                break
            self.pool.touch([block])
            hold.blocks.append(block)
            hold.loading = hold.loading or block.block_id in self._loads  # its data comes with this plan
        if hold.blocks and self.resume is not None:
            blocks = hold.blocks
            hold.pinned = self.resume.needs_snapshot
            if hold.loading or not self._resumes_now(blocks):
                self._ops.append(CheckResume(request_id, tuple(b.block_id for b in blocks),
                                             tuple(b.block_hash for b in blocks), tuple(b.token_ids for b in blocks)))
                hold.loading = hold.checked = True
            elif hold.pinned:
                self._ops.append(PinSnapshot(request_id, blocks[-1].block_hash))
        self.num_queried_tokens += len(token_ids)
        if hold.loading:
            self._waiting.append(hold)
        else:
            self.num_hit_tokens += hold.num_tokens
        return hold

    def _resumes_now(self, blocks: list[Block]) -> bool:
        """Whether a hit on `blocks` can resume after all of them from what memory holds: the parts each optional
        role needs there, and the snapshot at their end (blocks evicted or planned since the last plan left
        count as not holding them: the store has not seen that yet)."""
        resume, bs, depth = self.resume, self.block_size, len(blocks) * self.block_size
        stale = self._dropped_ids | {b.block_id for b in self._writing} | set(self._loads)
        for role, ids in resume.parts.items():
            needed = blocks[resume.first_needed[role](depth) // bs :]
            if any(b.block_id not in ids or b.block_id in stale for b in needed):
                return False
        last = blocks[-1].block_hash
        return not resume.needs_snapshot or (last in resume.snapshots and last not in self._dropped_hashes)

    def _load_cold(self, block_hash: bytes, tokens: Sequence[int]) -> Block | None:
        """A block taken for the SSD tier's copy of this hash (loaded by the plan), or None."""
        # Taking a block may evict the LRU cached one: without the index check every cold miss (any new
        # prompt's first uncached block) cost a memory block that later prompts could have hit.
        if self.disk is None or self.pool.num_free == 0 or not self.disk.contains(block_hash):
            return None
        if not self._make_room():
            return None
        (block,) = self.pool.allocate(1)
        if self.pool.cache_full_block(block, block_hash, tokens) is not block or not block.is_cached:
            self.pool.free([block])  # a collision: never served
            return None
        self.pool.free([block])  # the caller touches it like any memory hit
        load = LoadBlock(block.block_id, block_hash, tuple(tokens))
        self._ops.append(load)
        self._loads[block.block_id] = load
        return block

    def finish_ops(self, results: CacheResults) -> None:
        """The last plan's ops ran: a block whose load failed is forgotten (the requests that hit it compute it),
        and every waiting hold ends before its first such block and where its check found it can resume."""
        failed = set(results.failed_loads)
        for block_id in failed:
            load, block = self._loads.get(block_id), self.pool.blocks[block_id]
            if load is not None and block.block_hash == load.block_hash:
                self.pool.uncache(block)
        self._loads.clear()
        for hold in self._waiting:
            n = next((i for i, b in enumerate(hold.blocks) if b.block_id in failed), len(hold.blocks))
            if hold.checked:  # no check made (none in the plan that ran): no depth it may resume at
                n = min(n, results.depth_of(hold.request_id) or 0)
            hold.checked = False
            self.pool.free(reversed(hold.blocks[n:]))  # handed back, still cached (unless their load failed)
            del hold.blocks[n:]
            hold.loading = False
            self.num_hit_tokens += hold.num_tokens
        self._waiting = []
        for block_id in results.lost_windows:
            block = self.pool.blocks[block_id]
            if block.ref_count == 0:  # without its sliding KV: forgotten, so a recompute stores it whole
                self.pool.uncache(block)

    def take_ops(self) -> list[CacheOp]:
        """The ops decided since the last call, for the step plan."""
        ops, self._ops = self._ops, []
        self._dropped_ids.clear()
        self._dropped_hashes.clear()
        return ops

    def _on_evict(self, block_hash: bytes, block_id: int) -> None:
        load = self._loads.pop(block_id, None)
        if load is not None and load in self._ops:  # evicted before the plan left: never loaded
            self._ops.remove(load)
        self._ops.append(DropBlock(block_id))
        self._dropped_ids.add(block_id)
        self._dropped_hashes.add(block_hash)

    def _release(self, hold: PrefixHold) -> None:
        # Tail first: a prompt's last blocks are evicted before the head other requests share.
        self.pool.free(reversed(hold.blocks))
        hold.blocks = []
        if hold.pinned:
            self._ops.append(UnpinSnapshot(hold.request_id))
        if hold in self._waiting:
            self._waiting.remove(hold)
        if self.pool.num_cached > self.max_cached_blocks:  # held past a lowered cap: give them back now
            self.evict_to(self.max_cached_blocks)

    # -- insertion -----------------------------------------------------------------------------
    def plan_store(self, token_ids: Sequence[int], media_spans: MediaSpans = (),
                   hashes: list[bytes] | None = None) -> list[StoreOp]:
        """Blocks of `token_ids` (tokens whose KV exists) not cached yet, each given a block id.

        Planned blocks stay referenced until `finish_stores`, so an allocation later in the same
        step cannot evict a block before the runner has written it."""
        return self.plan_store_from(token_ids, media_spans, hashes)[0]

    def plan_store_from(self, token_ids: Sequence[int], media_spans: MediaSpans = (),
                        hashes: list[bytes] | None = None, first_block: int = 0) -> tuple[list[StoreOp], int]:
        """`plan_store` from block `first_block` on (the blocks before it were planned earlier, e.g. by
        the previous chunks of a prefill). Also returns where the next plan of this sequence starts: after
        the last block planned or found cached, so blocks that found no room are tried again."""
        bs = self.block_size
        ops = []
        kept: list[Block] = []
        hashes = self.hashes(token_ids, media_spans, hashes)
        done = first_block
        for i in range(first_block, len(hashes)):
            h = hashes[i]
            tokens = token_ids[i * bs : (i + 1) * bs]
            cached = self.pool.cached.get(h)
            if cached is not None:  # this request's own hit, or another request stored it first
                # Held while we allocate: else the allocation for the next block could evict this one
                # and store that block unreachable (a chain is only found from its head).
                self.pool.touch([cached])
                kept.append(cached)
                done = i + 1
                continue
            if not self._make_room():
                break
            (block,) = self.pool.allocate(1)
            self.pool.cache_full_block(block, h, tokens)
            self._writing.append(block)
            ops.append(StoreOp(block.block_id, i * bs, h, tuple(tokens), (i + 1) * bs == len(token_ids)))
            done = i + 1
        self.pool.free(reversed(kept))
        return ops, done

    def discard_stores(self, block_ids: Sequence[int]) -> None:
        """Planned blocks the runner could not copy: their hashes go, so no lookup finds them empty."""
        ids = set(block_ids)
        for block in self._writing:
            if block.block_id in ids:
                self.pool.uncache(block)

    def finish_stores(self) -> None:
        """The runner copied every planned block: they become ordinary evictable cache entries."""
        self.pool.free(reversed(self._writing))
        self._writing = []

    def evict_to(self, num_blocks: int) -> int:
        """Shrinks the cached, unreferenced set so at most `num_blocks` are cached."""
        return self.pool.evict_unreferenced(max(0, self.pool.num_cached - num_blocks))

    def set_max_cached_blocks(self, num_blocks: int) -> int:
        """Caps the blocks holding data (memory pressure): evicts LRU unreferenced blocks down to the
        cap now and keeps later stores under it; raising it again lets the cache regrow, up to the
        pool's size. Blocks running requests hold stay, so the cap is soft until they finish.
        Returns how many blocks were evicted."""
        self.max_cached_blocks = max(0, min(num_blocks, self.pool.num_blocks))
        return self.evict_to(self.max_cached_blocks)

    def _make_room(self) -> bool:
        """Whether one more block may hold data: a free block exists, and under the cap, if need be
        by evicting the least recently used unreferenced block."""
        if self.pool.num_free == 0:
            return False
        return self.pool.num_cached < self.max_cached_blocks or self.pool.evict_unreferenced(1) == 1

    def reset_stats(self) -> None:
        """Hit counters from zero (after start-up's warm-up traffic, which is no one's)."""
        self.num_queried_tokens = self.num_hit_tokens = 0

    def clear(self, disk: bool = False) -> int:
        """Drops every unreferenced block (their arrays go with the next plan), and with `disk` the SSD tier's
        files too. Call between steps only: the blocks planned in the last step are then copied, but stay held
        until the next `schedule()`, which never comes while the engine is idle; without finishing them here
        DELETE /v1/cache left them cached."""
        self.finish_stores()
        if disk and self.disk is not None:
            self._ops.append(ClearDisk())
        return self.pool.evict_unreferenced(self.pool.num_cached)

    def stats(self) -> dict:
        q = self.num_queried_tokens
        return {
            "block_size": self.block_size,
            "num_blocks": self.pool.num_blocks,
            "max_cached_blocks": self.max_cached_blocks,
            "num_cached_blocks": self.pool.num_cached,
            "num_used_blocks": self.pool.num_used,
            "num_kept_blocks": self.pool.num_kept,
            "queried_tokens": q,
            "hit_tokens": self.num_hit_tokens,
            "hit_rate": self.num_hit_tokens / q if q else 0.0,
            "evictions": self.pool.num_evictions,
        }

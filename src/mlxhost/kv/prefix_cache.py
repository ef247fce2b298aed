"""The logical half of the prefix cache: which blocks a prompt can reuse, which a finished request
adds. No MLX here; the runner's `KVBlockStore` holds the arrays under the same block ids.

Stored blocks are immutable copies: a running request attaches them to its own cache (one copy)
and writes its new tokens there, never into a shared block. Divergence inside a block therefore
needs no copy-on-write at run time: the diverging block simply has another hash and is computed.
Blocks stay referenced while a request that hit them runs, so eviction never takes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

EvictCallback = Callable[[bytes, int], None]
# Asked on a memory miss (a second tier, e.g. SSD): fill block `block_id` with the data stored under
# this hash and these tokens, and say whether it could.
ColdLookup = Callable[[bytes, Sequence[int], int], bool]
# Cheap "does the second tier hold this hash?", asked before a block is taken for a cold load.
ColdContains = Callable[[bytes], bool]
# (start, end, content hash) of a prompt's image/video placeholder runs; see hashing.extend_block_hashes.
MediaSpans = Sequence[tuple[int, int, str]]


class ResumeCheck(Protocol):
    """The physical half's say on where a hit may end (sliding windows, recurrent snapshots)."""

    def can_resume(self, request_id: str, block_ids: Sequence[int], block_hash: bytes,
                   token_ids: Sequence[int]) -> bool: ...

    def release(self, request_id: str) -> None: ...

    def take_lost_windows(self) -> list[int]: ...

from mlxhost.kv.block_pool import Block, BlockPool
from mlxhost.kv.hashing import extend_block_hashes


@dataclass(frozen=True)
class StoreOp:
    """Copy tokens [start, start + block_size) of a request's KV into block `block_id`."""

    block_id: int
    start: int
    block_hash: bytes
    token_ids: tuple[int, ...]
    # The block ends where the request's KV ends: its recurrent state is at this boundary right now.
    is_row_end: bool = False


class PrefixCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_key: str,
        on_evict: EvictCallback | None = None,
        lookup_cold: ColdLookup | None = None,
        has_cold: ColdContains | None = None,
        resume: ResumeCheck | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.model_key = model_key
        # Called the moment a block's hash is dropped, before its id is handed out again, so the
        # physical store can free (or spill) the data in time.
        self.pool = BlockPool(num_blocks, block_size, on_evict=on_evict, clock=clock)
        self._lookup_cold = lookup_cold
        self._has_cold = has_cold
        self._resume = resume
        self._held: dict[str, list[Block]] = {}
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
               hashes: list[bytes] | None = None) -> list[int]:
        """Ids of the longest run of cached full blocks at the start of the prompt, now held by
        `request_id`. At least one prompt token is always left to compute (it yields the logits).
        `hashes`: the prompt's block hashes if the caller keeps them (see `hashes`)."""
        bs = self.block_size
        hashes = self.hashes(token_ids, media_spans, hashes)[: (len(token_ids) - 1) // bs]
        hits: list[Block] = []
        for i, h in enumerate(hashes):
            tokens = token_ids[i * bs : (i + 1) * bs]
            block = self.pool.lookup(h, tokens)
            if block is None and self._lookup_cold is not None:
                block = self._load_cold(h, tokens)
            if block is None:
                break
            self.pool.touch([block])
            hits.append(block)
        if self._resume is not None:
            # Stop at the deepest block where the physical half can resume (its window blocks carry
            # sliding KV, a state snapshot exists there); the deeper blocks are handed back.
            while hits and not self._resume.can_resume(request_id, [b.block_id for b in hits],
                                                       hits[-1].block_hash, hits[-1].token_ids):
                self.pool.free([hits.pop()])
            for block_id in self._resume.take_lost_windows():
                self.pool.uncache(self.pool.blocks[block_id])  # stored whole again by the recompute
        self._held[request_id] = hits
        self.num_queried_tokens += len(token_ids)
        self.num_hit_tokens += len(hits) * bs
        return [b.block_id for b in hits]

    def _load_cold(self, block_hash: bytes, tokens: Sequence[int]) -> Block | None:
        if self.pool.num_free == 0:
            return None
        # Taking a block may evict the LRU cached one: without this check every cold miss (any new
        # prompt's first uncached block) cost a memory block that later prompts could have hit.
        if self._has_cold is not None and not self._has_cold(block_hash):
            return None
        if not self._make_room():
            return None
        (block,) = self.pool.allocate(1)
        if not self._lookup_cold(block_hash, tokens, block.block_id):
            self.pool.free([block])
            return None
        self.pool.cache_full_block(block, block_hash, tokens)
        self.pool.free([block])  # the caller touches it like any memory hit
        return block

    def release(self, request_id: str) -> None:
        # Tail first: a prompt's last blocks are evicted before the head other requests share.
        self.pool.free(reversed(self._held.pop(request_id, [])))
        if self._resume is not None:
            self._resume.release(request_id)
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

    def clear(self) -> int:
        """Drops every unreferenced block. Call between steps only: the blocks planned in the last
        step are then copied, but stay held until the next `schedule()`, which never comes while
        the engine is idle; without finishing them here DELETE /v1/cache left them cached."""
        self.finish_stores()
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

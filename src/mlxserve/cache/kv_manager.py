"""What the scheduler calls to place requests in the paged KV cache (logical half, no MLX).

Per request it keeps the block table, the chained block hashes computed so far and how
many of its blocks are registered in the prefix cache. The pool stays the owner of the
blocks; this class only holds references and asks the pool to move them.

Typical use by the scheduler, per step:
    blocks, num_cached = mgr.get_computed_blocks(rid, prompt_ids)   # only when admitting
    new = mgr.allocate_slots(rid, num_computed + num_new_tokens)     # None -> wait/preempt
    ... runner writes KV (copies from mgr.take_pending_copies() first) ...
    mgr.cache_blocks(rid, token_ids_with_kv)                         # after the step
    mgr.free(rid)                                                    # finished/aborted/preempted
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

from mlxserve.cache.block_pool import Block, BlockPool, CowResult
from mlxserve.cache.hashing import extend_block_hashes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _RequestState:
    extra_keys: tuple = ()
    blocks: list[Block] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the pool's index
    num_computed_tokens: int = 0  # end of the last allocate_slots range: where writes resume
    admitted: bool = False
    # Prefix hits found by get_computed_blocks, not yet referenced (see allocate_slots).
    pending_hits: list[Block] | None = None
    pending_query_tokens: int = 0


class KVCacheManager:
    """Per-request block tables on top of a BlockPool, with prefix reuse and copy-on-write."""

    def __init__(self, pool: BlockPool, block_size: int, model_key: str = "") -> None:
        if block_size != pool.block_size:
            raise ValueError(f"block_size {block_size} != pool block_size {pool.block_size}")
        self.pool = pool
        self.block_size = block_size
        # Mixed into every block hash so two models sharing a pool or an SSD dir never mix KV.
        self.model_key = model_key
        self._requests: dict[Hashable, _RequestState] = {}
        self._pending_copies: list[CowResult] = []
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # -- admission -----------------------------------------------------------

    def get_computed_blocks(
        self, request_id: Hashable, token_ids: Sequence[int], extra_keys: tuple = ()
    ) -> tuple[list[Block], int]:
        """Longest cached prefix of full blocks, stopping at the first miss.

        Never covers the whole prompt: only the full blocks of `token_ids[:-1]` are looked
        up, so at least one token is computed and the model yields logits. (This drops the
        last block only when the prompt is an exact multiple of the block size; a prompt
        with a partial tail keeps all its hits.)

        Takes no references: the hits may still be evicted until `allocate_slots`, which
        must follow for the same request before other requests allocate, or it returns
        None and the scheduler asks again next step. Safe to call again while waiting.
        """
        state = self._requests.get(request_id)
        extra = tuple(extra_keys)
        if state is None:
            state = self._requests[request_id] = _RequestState(extra_keys=extra)
        elif state.admitted:
            raise RuntimeError(f"request {request_id!r} already holds blocks; free it first")
        elif state.extra_keys != extra:
            state.extra_keys, state.block_hashes = extra, []
        bs = self.block_size
        extend_block_hashes(state.block_hashes, token_ids, bs, extra, self.model_key)
        max_blocks = max(len(token_ids) - 1, 0) // bs
        hits: list[Block] = []
        for i in range(max_blocks):
            block = self.pool.lookup(state.block_hashes[i], token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        state.pending_hits = hits
        state.pending_query_tokens = len(token_ids)
        return list(hits), len(hits) * bs

    def allocate_slots(
        self,
        request_id: Hashable,
        num_tokens_total: int,
        num_computed_tokens: int | None = None,
    ) -> list[Block] | None:
        """Grow the request's table to hold `num_tokens_total` tokens; all or nothing.

        Returns the newly appended blocks ([] if it already fits), or None when the pool
        lacks free blocks (nothing changes; the scheduler waits or preempts). Positions from
        `num_computed_tokens` on will be written; a shared block in that range is replaced
        by a private copy (copy-on-write, copies via `take_pending_copies`). It defaults to
        the previous call's `num_tokens_total`, i.e. the step-by-step growth the scheduler does.
        """
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestState()
        if not state.admitted:
            return self._admit(state, num_tokens_total)

        bs, blocks = self.block_size, state.blocks
        start = state.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        num_needed = max(0, _cdiv(num_tokens_total, bs) - len(blocks))
        end_block = min(len(blocks), _cdiv(num_tokens_total, bs))
        shared = [i for i in range(start // bs, end_block) if blocks[i].ref_count > 1]
        if num_needed + len(shared) > self.pool.num_free:
            return None
        for i in shared:
            result = self.pool.copy_on_write(blocks[i])
            blocks[i] = result.block
            self._pending_copies.append(result)
            # The copy is uncached; let cache_blocks consider it again once it is full.
            state.num_cached_blocks = min(state.num_cached_blocks, i)
        new_blocks = self.pool.allocate(num_needed)
        blocks.extend(new_blocks)
        state.num_computed_tokens = max(state.num_computed_tokens, num_tokens_total)
        return new_blocks

    def _admit(self, state: _RequestState, num_tokens_total: int) -> list[Block] | None:
        hits = state.pending_hits or []
        # Another request may have reallocated a hit since the lookup: then its hash changed.
        if any(b.block_hash != state.block_hashes[i] for i, b in enumerate(hits)):
            state.pending_hits = None
            return None
        num_needed = max(0, _cdiv(num_tokens_total, self.block_size) - len(hits))
        # Hits that are free cached blocks leave the free queue too, so they count as demand.
        num_reclaimed = sum(1 for b in hits if b.ref_count == 0)
        if num_needed + num_reclaimed > self.pool.num_free:
            return None
        self.pool.touch(hits)
        new_blocks = self.pool.allocate(num_needed)
        state.blocks = hits + new_blocks
        state.num_cached_blocks = len(hits)
        num_hit_tokens = len(hits) * self.block_size
        state.num_computed_tokens = max(num_tokens_total, num_hit_tokens)
        state.admitted = True
        # Counted here, once per admission, not per (repeated) lookup while waiting.
        self.num_queried_tokens += state.pending_query_tokens
        self.num_hit_tokens += num_hit_tokens
        state.pending_hits, state.pending_query_tokens = None, 0
        return new_blocks

    # -- caching, forking, freeing -------------------------------------------

    def cache_blocks(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        num_computed_tokens: int | None = None,
    ) -> int:
        """Register the request's newly filled full blocks in the prefix cache.

        Only tokens whose KV is written may be covered: pass `num_computed_tokens` (or trim
        `token_ids`) so a just-sampled token without KV is excluded. Incremental: blocks
        registered before are skipped, so calling it every step costs only new hashes.
        Returns the number of blocks newly considered.

        If another request already cached the same content, this request keeps its own
        block (uncached) rather than swapping tables mid-flight: the runner may already
        have a step in flight that reads the current table.
        """
        state = self._requests[request_id]
        bs = self.block_size
        num_tokens = len(token_ids)
        if num_computed_tokens is not None:
            num_tokens = min(num_tokens, num_computed_tokens)
        num_full = min(num_tokens // bs, len(state.blocks))
        first = state.num_cached_blocks
        if num_full <= first:
            return 0
        hashes = extend_block_hashes(
            state.block_hashes, token_ids, bs, state.extra_keys, self.model_key, num_full
        )
        for i in range(first, num_full):
            block = state.blocks[i]
            if block.block_hash is None:
                self.pool.cache_full_block(block, hashes[i], token_ids[i * bs : (i + 1) * bs])
        state.num_cached_blocks = num_full
        return num_full - first

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Let `child_id` share all of the parent's blocks (e.g. parallel sampling).

        Nothing is copied now; whichever request first writes into a shared block gets a
        private copy in allocate_slots.
        """
        parent = self._requests.get(parent_id)
        if parent is None or not parent.admitted:
            raise KeyError(f"request {parent_id!r} holds no blocks to fork")
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already exists")
        self.pool.touch(parent.blocks)
        self._requests[child_id] = _RequestState(
            extra_keys=parent.extra_keys,
            blocks=list(parent.blocks),
            block_hashes=list(parent.block_hashes),
            num_cached_blocks=parent.num_cached_blocks,
            num_computed_tokens=parent.num_computed_tokens,
            admitted=True,
        )

    def free(self, request_id: Hashable) -> None:
        """Release the request's blocks (tail first, so its head survives longest)."""
        state = self._requests.pop(request_id, None)
        if state is not None and state.admitted:
            self.pool.free(reversed(state.blocks))

    def take_pending_copies(self) -> list[CowResult]:
        """Copy-on-write copies the physical half must do before the next forward pass."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # -- queries -------------------------------------------------------------

    def get_blocks(self, request_id: Hashable) -> list[Block]:
        state = self._requests.get(request_id)
        return list(state.blocks) if state is not None else []

    def get_block_ids(self, request_id: Hashable) -> list[int]:
        state = self._requests.get(request_id)
        return [b.block_id for b in state.blocks] if state is not None else []

    def num_cached_blocks(self, request_id: Hashable) -> int:
        state = self._requests.get(request_id)
        return state.num_cached_blocks if state is not None else 0

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; False (and no change) while any request holds blocks."""
        return self.pool.reset()

    def stats(self) -> dict[str, float | int]:
        pool = self.pool
        return {
            "num_queried_tokens": self.num_queried_tokens,
            "num_hit_tokens": self.num_hit_tokens,
            "hit_rate": self.num_hit_tokens / self.num_queried_tokens
            if self.num_queried_tokens
            else 0.0,
            "num_blocks": pool.num_blocks,
            "num_used_blocks": pool.num_used,
            "num_free_blocks": pool.num_free,
            "num_cached_blocks": pool.num_cached,
            "usage": pool.usage,
            "num_evictions": pool.num_evictions,
            "num_block_hits": pool.num_hits,
            "num_block_misses": pool.num_misses,
            "num_collisions": pool.num_collisions,
        }

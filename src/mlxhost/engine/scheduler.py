"""Who runs this step: admission, prefill chunks, finishes and aborts. Imports no tensor library.

The scheduler owns the waiting queue and the running set. Each call to `schedule()` admits waiting
requests up to `max_num_seqs`, in the order of their priority classes and arrival (priority.py), hands out
at most `prefill_step_size` prompt tokens of prefill work (shared by several waiting prompts, whose chunks
the runner runs as one forward; a long prompt is split across steps and never freezes the streams that are
already decoding), and lists the requests whose state the runner must drop.

A request of a better priority class that finds no slot or no KV preempts the fewest running requests of worse
classes that make room: their full blocks go to the prefix cache and they wait again, to recompute prompt and
output so far (mostly cache hits) when they are admitted next.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mlxhost.config import EngineConfig
from mlxhost.engine.priority import PriorityOrder
from mlxhost.engine.request import Request, RequestStatus
from mlxhost.engine.step_cost import StepCostModel
from mlxhost.kv.cache_ops import CacheOp
from mlxhost.kv.inflight import InflightBlocks
from mlxhost.kv.prefix_cache import PrefixCacheManager, PrefixHold, StoreOp
from mlxhost.memory.capacity import KVCapacity


class QueueFullError(Exception):
    """The waiting queue is at its limit; the API answers 429 with Retry-After."""


@dataclass(frozen=True)
class PrefillChunk:
    request_id: str
    start: int  # first prompt position of this chunk
    num_tokens: int
    is_last: bool  # the chunk that ends the prompt: the runner samples the first token from it


@dataclass
class SchedulerOutput:
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    # Requests already decoding (their prompt finished in an earlier step).
    decode_request_ids: list[str] = field(default_factory=list)
    # Requests that finished or were aborted since the last step: the runner frees their KV.
    finished_request_ids: list[str] = field(default_factory=list)
    # Before freeing, the runner copies these blocks of a finished request's KV into the prefix cache.
    store_ops: dict[str, list[StoreOp]] = field(default_factory=dict)
    # Requests sent back to the queue to make room for better-priority ones (also in finished_request_ids:
    # the runner drops their state the same way; the engine core keeps them).
    preempted_request_ids: list[str] = field(default_factory=list)
    # The prefix cache's physical work (drops, SSD loads, resume checks), run by the store before anything else.
    cache_ops: list[CacheOp] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.prefill_chunks or self.decode_request_ids or self.finished_request_ids or self.cache_ops)


def split_prefill_budget(num_left: list[int], budget: int, max_rows: int) -> list[int]:
    """Prompt tokens each prefilling request (oldest first) gets this step.

    `max_rows` 1: one prompt after another, oldest first; what one leaves of the budget goes to the next
    (each chunk is its own forward). Otherwise the first `max_rows` prompts share it fairly, since their
    chunks run as one forward padded to the longest: each gets at most budget // rows, so a burst of short
    prompts finishes together in one step and the padded forward never exceeds `budget` tokens (the
    bound the memory budget and the decode streams' step time rely on)."""
    sizes = [0] * len(num_left)
    if max_rows == 1:
        for i, n in enumerate(num_left):
            sizes[i] = min(n, budget)
            budget -= sizes[i]
            if budget == 0:
                break
        return sizes
    rows = min(len(num_left), max_rows, budget)
    if rows == 0:
        return sizes
    share = budget // rows
    for i in range(rows):
        sizes[i] = min(num_left[i], share)
    return sizes


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        max_model_len: int,
        prefix: PrefixCacheManager | None = None,
        kv_capacity: KVCapacity | None = None,
        align_chunks: bool = False,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.prefix = prefix
        # The KV tokens admission may hand out: memory/ owns the number (the governor moves it).
        self.kv_capacity = kv_capacity if kv_capacity is not None else KVCapacity()
        # Prompt blocks being prefilled, by hash: a request whose next block is one of them waits for it
        # instead of computing it again beside its owner. Off: every request computes its own misses.
        self.inflight = InflightBlocks()
        self.wait_for_inflight = True
        # Prefill chunks that end inside a prompt end on a block boundary, where the runner can snapshot
        # recurrent state (a snapshot exists only where a forward stopped): set for such models.
        self.align_chunks = align_chunks and prefix is not None
        self._next_store_block: dict[str, int] = {}  # prefilling request -> its first block not planned
        self._holds: dict[str, PrefixHold] = {}  # running request -> its hold on the prefix cache
        self._settling: list[str] = []  # running requests whose hit waits for the plan's loads or check
        self.waiting: deque[Request] = deque()
        # Insertion order is admission order: prefill work goes to the oldest request first.
        self.running: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self._finished: list[Request] = []
        self._at_boundary: list[Request] = []
        self.priority = PriorityOrder(config)  # arrivals, classes and aging: the admission order
        self.num_preemptions = 0
        # Measured step costs (the engine core feeds them): how much prefill fits beside the decode rows.
        self.step_cost = StepCostModel(config.max_decode_gap_s)

    # -- queue -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if len(self.waiting) >= self.config.max_num_waiting:
            raise QueueFullError(
                f"{len(self.waiting)} requests are already waiting (limit {self.config.max_num_waiting})"
            )
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.priority.arrive(request)

    def abort(self, request_id: str) -> Request | None:
        """Drops a request wherever it is; returns it, or None if it already finished."""
        request = self.running.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            return request
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self.priority.forget(request_id)
                request.status = RequestStatus.FINISHED_ABORTED
                return request
        return None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_capacity_tokens(self) -> int | None:
        return self.kv_capacity.tokens

    @property
    def num_committed_kv_tokens(self) -> int:
        """KV tokens admission set aside for the running requests (the bound `can_admit` checks)."""
        return self._kv_bound(list(self.running.values())) if self.running else 0

    def _kv_bound(self, rows: list[Request]) -> int:
        # mlx-lm's batch cache is rectangular: rows × the longest (a reserved row holds that much anyway).
        longest = max(r.num_prompt_tokens + r.sampling.max_tokens for r in rows)
        return len(rows) * max(longest, self.config.kv_prealloc_tokens)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_ids)

    # -- step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        if self.prefix is not None:
            self._plan_stores(out)
        else:
            for request in self._finished:
                self._leave(request)
            self._finished = []

        # Requests whose prompt finished in an earlier step decode now.
        out.decode_request_ids = [r.request_id for r in self.running.values() if r.is_prefill_done]

        self.priority.tick()
        self._admit(out)

        # A request whose hit waits for the plan's loads or check prefills once their results are in.
        prefilling = [r for r in self.running.values() if not r.is_prefill_done and not self._is_loading(r)]
        if len(prefilling) > 1:  # stable: within a class, the oldest admitted first
            prefilling.sort(key=lambda r: self.priority.admitted_rank(r.request_id))
        sizes = split_prefill_budget([r.num_prompt_tokens_left for r in prefilling], self._prefill_budget(out),
                                     self.config.max_num_prefill_rows)
        for request, n in zip(prefilling, sizes):
            if n == 0:
                continue
            start = request.num_computed_tokens
            if self.align_chunks and start + n < request.num_prompt_tokens:
                bs = self.prefix.block_size
                n = max((start + n) // bs * bs - start, 0) or n
            request.num_computed_tokens += n
            out.prefill_chunks.append(
                PrefillChunk(request.request_id, start, n, is_last=request.is_prefill_done)
            )
        if self.prefix is not None:
            out.cache_ops = self.prefix.take_ops()
        return out

    def _is_loading(self, request: Request) -> bool:
        hold = self._holds.get(request.request_id)
        return hold is not None and hold.loading

    def _prefill_budget(self, out: SchedulerOutput) -> int:
        """Prompt tokens this step prefills: `prefill_step_size`, or less while rows decode, as much as keeps
        their gap under `max_decode_gap_s` by the measured step costs (step_cost.py)."""
        return self.step_cost.prefill_budget(self.config.prefill_step_size, bool(out.decode_request_ids))

    def _admit(self, out: SchedulerOutput) -> None:
        """Admits waiting requests in order while slots and the KV budget allow, preempting worse classes
        for a better one. One whose next prompt block another request is prefilling stays queued (its
        place kept) and the ones behind it go on."""
        self.waiting = self.priority.sorted(self.waiting)
        blocked: list[Request] = []
        while self.waiting:
            request = self.waiting[0]
            if self._waits_for_inflight(request):
                blocked.append(self.waiting.popleft())
                continue
            if self._holds_back():
                break
            fits = len(self.running) < self.config.max_num_seqs and self.can_admit(request)
            if not fits and not self._preempt_for(request, out):
                break
            self.waiting.popleft()
            self.priority.admit(request)
            request.status = RequestStatus.RUNNING
            self.running[request.request_id] = request
            if self.prefix is not None:
                self._look_up(request)
        self.waiting.extendleft(reversed(blocked))

    # -- preemption ----------------------------------------------------------------------------
    def _preempt_for(self, request: Request, out: SchedulerOutput) -> bool:
        """Preempts the fewest running requests of the worst classes (the latest arrivals first) that make
        room for `request`; none if even all of them would not."""
        victims = self.priority.victims(self.running.values(), request)
        cap, left, chosen = self.kv_capacity_tokens, dict(self.running), []
        for victim in victims:
            del left[victim.request_id]
            chosen.append(victim)
            if len(left) < self.config.max_num_seqs and (
                    cap is None or not left or self._kv_bound([*left.values(), request]) <= cap):
                break
        else:
            return False
        for victim in chosen:
            self._preempt(victim, out)
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        rid = request.request_id
        if self.prefix is not None:
            # Its blocks go to the prefix cache (copied before the runner drops its state), so its
            # resumption hits them and recomputes only the tail.
            ops = self._ops(request) if request.is_prefill_done else self._prefill_ops(request)
            self._keep(out, request, ops, prompt_done=True)
        self._leave(request)
        del self.running[rid]
        self.priority.preempted(rid)
        if rid in out.decode_request_ids:
            out.decode_request_ids.remove(rid)
        out.finished_request_ids.append(rid)
        out.preempted_request_ids.append(rid)
        # The token it sampled last is dropped with its row: the recompute samples it again.
        request.num_replayed_tokens = request.num_output_tokens
        request.num_computed_tokens = 0
        request.cached_block_ids = []
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self.num_preemptions += 1

    def _look_up(self, request: Request) -> None:
        rid, prefix, tokens = request.request_id, self.prefix, request.prefill_token_ids
        hashes = prefix.hashes(tokens, request.block_key_spans, request.block_hashes)
        # A scored prompt needs every position's logits: nothing comes from the cache (its blocks are stored).
        scored = request.sampling.prompt_logprobs is not None
        self._holds[rid] = prefix.lookup(rid, tokens, request.block_key_spans, hashes, max_blocks=0 if scored else None)
        request.cached_block_ids = []
        request.num_cached_tokens = request.num_computed_tokens = 0
        if self._holds[rid].loading:
            self._settling.append(rid)
        else:
            self._use_hit(request)

    def _use_hit(self, request: Request) -> None:
        """The request starts after its hold's blocks (known now, or once the plan's loads and check are in)."""
        rid, prefix, hold = request.request_id, self.prefix, self._holds[request.request_id]
        hashes = prefix.hashes(request.prefill_token_ids, request.block_key_spans, request.block_hashes)
        request.cached_block_ids = hold.block_ids
        request.num_cached_tokens = hold.num_tokens
        request.num_computed_tokens = request.num_cached_tokens
        if request.cache_ttl_s:  # a hit renews the client's keep hint, as a hit renews Anthropic's TTL
            prefix.keep(hashes[: len(request.cached_block_ids)], request.cache_ttl_s)
        self._next_store_block[rid] = len(request.cached_block_ids)
        hold.claim(self.inflight, [h for h in hashes[len(request.cached_block_ids):] if not prefix.is_cached(h)])

    def _waits_for_inflight(self, request: Request) -> bool:
        if not self.wait_for_inflight or self.prefix is None or not len(self.inflight):
            return False
        if request.sampling.prompt_logprobs is not None:  # it would not use the blocks it waited for
            return False
        hashes = self.prefix.hashes(request.prefill_token_ids, request.block_key_spans, request.block_hashes)
        usable = hashes[: (request.num_prefill_tokens - 1) // self.prefix.block_size]  # as a lookup takes them
        return self.inflight.waits_for(usable, self.prefix.is_cached) is not None

    def _holds_back(self) -> bool:
        """Whether new prompts wait this step for others to prefill with (`prefill_wait_steps`): only while
        rows decode and no prompt is mid-prefill (whose forward they could join for free), until the oldest
        has waited its steps or enough wait to fill a batched prefill."""
        wait = self.config.prefill_wait_steps
        if not wait or not self.running or len(self.waiting) >= self.config.max_num_prefill_rows:
            return False
        if any(not r.is_prefill_done for r in self.running.values()):
            return False
        return self.priority.num_waited_steps(self.waiting[0]) <= wait

    def can_admit(self, request: Request) -> bool:
        """Whether the KV budget holds `request` next to the running ones at their longest.

        mlx-lm's batch cache is rectangular (rows left-padded to the longest), so the bound is rows ×
        the longest prompt + max_tokens, not a sum. With nothing running a request is always admitted
        (the API already refused those that can never fit), so the queue cannot stall."""
        if self.kv_capacity_tokens is None or not self.running:
            return True
        return self._kv_bound([*self.running.values(), request]) <= self.kv_capacity_tokens

    def num_kept(self, request: Request, tokens: list[int]) -> int:
        """How many of `tokens` (new for a running request) it keeps: up to the first that ends it (EOS, a
        stop token, max_tokens, the model's length). Changes nothing; `update` appends them."""
        for n, token in enumerate(tokens, 1):
            if self._check_stop(request, token, request.num_output_tokens + n) is not None:
                return n
        return len(tokens)

    def update(self, new_tokens: dict[str, int | list[int]], stopped: frozenset[str] | set[str] = frozenset(),
               ) -> list[Request]:
        """Appends each request's new tokens (one, or several from a speculative step); returns the
        requests they finished. Tokens after the one that finished a request (EOS, max_tokens) are
        dropped. `stopped`: requests whose last new token completed a stop string (found in their text,
        outside the scheduler), which ends them there. The one place requests finish."""
        finished = []
        for request_id, tokens in new_tokens.items():
            request = self.running.get(request_id)
            if request is None:  # finished or aborted while its token was in flight
                continue
            if request.sampling.max_tokens == 0:  # a prefill only (POST /v1/cache/prefill): done once prefilled
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                finished.append(request)
                continue
            status, start = None, request.num_tokens
            for token in [tokens] if isinstance(tokens, int) else tokens:
                request.output_token_ids.append(token)
                status = self._check_stop(request, token, request.num_output_tokens)
                if status is not None:
                    break
            if status is None and request_id in stopped:
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                self._finish(request, status)
                finished.append(request)
            elif self.prefix is not None and (request.num_tokens // self.prefix.block_size
                                              > start // self.prefix.block_size
                                              or start == request.num_prefill_tokens):
                # A block filled while decoding (by this step's token or tokens): cache it now, so a long
                # generation is reusable (and survives an abort) without waiting for the request to end.
                # The prompt's blocks are cached as soon as it is prefilled, so requests sharing it (n > 1,
                # a burst with one system prompt) find them while this one still runs.
                self._at_boundary.append(request)
        return finished

    def fail(self, request_id: str) -> None:
        """Ends a request whose step failed: aborted, and none of its KV is cached (it may be bad)."""
        request = self.running.get(request_id)
        if request is None:
            self.abort(request_id)
            return
        request.status = RequestStatus.FINISHED_ABORTED
        del self.running[request_id]
        self.priority.forget(request_id)
        self._finished_ids.append(request_id)
        self._leave(request)  # none of its KV is stored: waiters compute it themselves

    def _check_stop(self, request: Request, token: int, num_output_tokens: int) -> RequestStatus | None:
        """Whether `token`, as the request's `num_output_tokens`-th output token, ends it."""
        sp = request.sampling
        if not sp.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in sp.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_prompt_tokens + num_output_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def reset_after_failure(self) -> None:
        """After a failed step: every request was aborted; drop the bookkeeping for them."""
        self._finished_ids = []
        self._at_boundary = []
        for request in self._finished:
            self._leave(request)
        if self.prefix is not None:
            self.prefix.finish_stores()
            self.prefix.clear()
        self._finished = []
        self.inflight.clear()
        self._next_store_block.clear()

    def _plan_stores(self, out: SchedulerOutput) -> None:
        self.prefix.finish_stores()  # the last step's planned copies were made
        self.inflight.copied()
        for rid in [rid for rid in self._settling if not self._holds[rid].loading]:
            self._settling.remove(rid)  # its hit's loads and check came back in the last step
            self._use_hit(self.running[rid])
        for request in self.running.values():
            if not request.is_prefill_done:
                # The chunks prefilled so far: their full blocks are stored now, not when the prompt ends,
                # so an aborted or timed-out prefill still warms the retry (and waiters get them early).
                self._keep(out, request, self._prefill_ops(request))
        for request in self._at_boundary:
            if request.status is RequestStatus.RUNNING:
                self._keep(out, request, self._ops(request), prompt_done=True)
        self._at_boundary = []
        for request in self._finished:
            # A request that got its first token has a decode row holding KV for its prompt and
            # every output token (each emitted token was fed in the step that emitted it); one aborted
            # in its prefill has the prefill cache of the chunks it computed.
            ops = self._ops(request) if request.num_output_tokens > 0 else self._prefill_ops(request)
            self._keep(out, request, ops, prompt_done=True)
            self._leave(request)
            if request.cache_ttl_s:  # its prompt's blocks (stored now or before) stay ahead of plain LRU eviction
                self.prefix.keep(self.prefix.hashes(request.prompt_token_ids, request.block_key_spans,
                                                    request.block_hashes), request.cache_ttl_s)
        self._finished = []

    def _ops(self, request: Request) -> list[StoreOp]:
        return self.prefix.plan_store(request.prompt_token_ids + request.output_token_ids, request.block_key_spans,
                                      request.block_hashes)

    def _prefill_ops(self, request: Request) -> list[StoreOp]:
        first = self._next_store_block.get(request.request_id, 0)
        if request.num_computed_tokens // self.prefix.block_size <= first:
            return []
        ops, self._next_store_block[request.request_id] = self.prefix.plan_store_from(
            request.prefill_token_ids[: request.num_computed_tokens], request.block_key_spans, request.block_hashes,
            first)
        return ops

    def _keep(self, out: SchedulerOutput, request: Request, ops: list[StoreOp], prompt_done: bool = False) -> None:
        if ops:  # added to what this step planned for it already (a block filled while decoding)
            out.store_ops.setdefault(request.request_id, []).extend(ops)
            self.inflight.planned(op.block_hash for op in ops)
        if prompt_done:  # every prompt block it could store is planned: it computes no more of them
            hold = self._holds.get(request.request_id)
            if hold is not None:
                hold.release_claim()
            self._next_store_block.pop(request.request_id, None)

    def _leave(self, request: Request) -> None:
        """The one place a request's hold on the prefix cache goes: finished or aborted (at the next schedule,
        once its stores are planned), failed (at once: nothing of it is stored) or preempted."""
        rid = request.request_id
        hold = self._holds.pop(rid, None)
        if hold is not None:
            hold.release()
        self._next_store_block.pop(rid, None)
        if rid in self._settling:
            self._settling.remove(rid)
        if request in self._at_boundary:
            self._at_boundary.remove(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        del self.running[request.request_id]
        self.priority.forget(request.request_id)
        self._finished_ids.append(request.request_id)
        self._finished.append(request)

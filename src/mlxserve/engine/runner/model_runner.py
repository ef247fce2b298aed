"""All MLX work of a step: chunked prefill, the batched decode forward and sampling.

The decode batch's `tokens` are the last sampled token of each row, still lazy. A step launches the
next decode on them with `mx.async_eval` and only then reads them back, so Python's bookkeeping for
step N overlaps the device computing step N+1 (the pipelining mlx-lm's `generate_step` uses). A
request that finished at step N therefore costs one wasted row in step N+1, and is dropped at the
start of the step after.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxserve.kv.kinds.block_io import read_prefill_window, read_state
from mlxserve.kv.store.kv_store import KVBlockStore
from mlxserve.engine.runner.batch import DecodeBatch
from mlxserve.engine.runner.batch_prefill import pick_rows, prefill_rows, why_not_batched
from mlxserve.engine.runner.block_copy import copy_blocks
from mlxserve.engine.runner.mm_prefill import MultimodalPrefill
from mlxserve.engine.request import Request, SamplingParams, TokenLogprob
from mlxserve.engine.grammar import GrammarSource
from mlxserve.engine.runner.sampling import RowSampler, gather_logprobs, pending_arrays, sample_batch, to_logprob
from mlxserve.engine.scheduler import PrefillChunk, SchedulerOutput
from mlxserve.engine.spec.decoder import SpeculativeDecoder
from mlxserve.lora.manager import AdapterSet
from mlxserve.platform.backend import is_cuda

log = logging.getLogger(__name__)

# Filler rows of a bucketed batch sample greedily; their tokens are never read.
_FILLER = RowSampler.make(SamplingParams(max_tokens=1, temperature=0.0), [])


@dataclass
class StepTokens:
    """Tokens that became known this step, one per live decoding row, in row order."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # A request may get several tokens in one step (speculative decoding): consecutive entries above,
    # and one logprob per token here.
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # Requests this step failed for (request id -> why); the runner already dropped their state.
    failed: dict[str, str] = field(default_factory=dict)
    # Prefix-cache blocks planned this step whose copy failed: their hashes must not be found.
    failed_block_ids: list[int] = field(default_factory=list)


# On CUDA a last chunk whose logits (tokens x vocab) stay under this many runs as one forward, not two:
# there a forward of a few tokens is bound by launching its kernels, so a prefix hit's suffix costs one
# forward. Elsewhere, and for longer chunks, the last token runs alone so the LM head never runs over the
# chunk, which there costs more than a second forward (docs/BENCHMARKS.md, "Prefill forwards and kernel
# launches").
_ONE_FORWARD_LOGITS = 1 << 25
_PREFILL_PAD_TO = 32


class ModelRunner:
    def __init__(
        self,
        model: Any,
        buckets: list[int] | None = None,
        store: KVBlockStore | None = None,
        block_size: int = 0,
        vision_cache: Any = None,
        kv_prealloc_tokens: int = 0,
        grammar: "GrammarSource | None" = None,
        make_cache: Callable[[Any], list[Any]] = make_prompt_cache,
        spec: "SpeculativeDecoder | None" = None,
        batch_prefill: bool = True,
        logits_width: int = 0,
        lora: AdapterSet | None = None,
    ) -> None:
        self.model = model
        # LoRA adapters on this model (lora/): each forward runs inside `lora.rows(...)`, one id per row.
        self.lora = lora if lora is not None else AdapterSet(model)
        self.logits_width = logits_width  # the LM head's width (vocab); 0: unknown, taken as 1M
        self.one_forward_logits = _ONE_FORWARD_LOGITS if is_cuda() else 0
        # Batched prefill's first pass padded to a multiple of this many tokens on MLX-CUDA, so the server
        # meets few distinct forward shapes: with `--cudnn-attention on` every new attention shape costs a
        # graph (platform/cudnn_attention.py); its own effect was not measured apart (docs/BENCHMARKS.md,
        # "cuDNN attention"). Elsewhere shapes cost nothing, padding would.
        self.prefill_pad_to = _PREFILL_PAD_TO if is_cuda() else 1
        self.make_cache = make_cache  # a request's fresh caches (quantized layers under --kv-bits)
        self.grammar = grammar
        self.spec = spec  # speculative decoding (engine/spec/decoder.py); None: off
        self.buckets = buckets
        self.store = store
        self.block_size = block_size
        self._prefill_caches: dict[str, list[Any]] = {}
        self._samplers: dict[str, RowSampler] = {}
        self._batch = DecodeBatch(buckets, kv_prealloc_tokens)
        # Vision-language models: multimodal prefill, and decode positions carried per row.
        self.mm = MultimodalPrefill(model, vision_cache) if getattr(model, "is_vlm", False) else None
        self._deltas: dict[str, int] = {}
        # Per request that asked for logprobs: lazy (chosen logprob, top ids, top logprobs) of its
        # next token to feed, read back when that token is emitted.
        self._pending_lp: dict[str, tuple] = {}
        # Prefix data only a prefill can give (see `_capture`), kept per request until its blocks are
        # stored: sliding-window KV by block start, and the recurrent state at the prompt's last block
        # boundary (where `_snap_at` says the prefill must stop for it).
        self._captured: dict[str, dict[int, mx.array]] = {}
        self._snap_at: dict[str, int] = {}
        self._prefill_snaps: dict[str, tuple[int, list]] = {}
        self._joined_last_step: list[str] = []
        # Prompts prefilled together in one forward where the model's caches take padding.
        self._batch_prefill = batch_prefill and why_not_batched(model, make_cache) is None
        # Where the last step's time went, for the slow-step log line and MLXSERVE_STEP_TRACE.
        self.last_prefill_s = self.last_store_s = self.last_join_s = self.last_decode_s = 0.0
        # MLXSERVE_STEP_SYNC (diagnosis only, slows every step): wait for the device after the stores, the
        # prefill and the join, so those columns of the step trace hold their device time too.
        self.sync_phases = False

    @property
    def num_rows(self) -> int:
        return len(self._batch)

    def execute(self, sched: SchedulerOutput, requests: dict[str, Request]) -> StepTokens:
        """Runs one step. A failure that belongs to one request (its prefill, its blocks' copy) fails
        only that request; a failed decode forward fails the rows of the decode batch, which share
        it. Either way the other requests and the prefix cache carry on."""
        out = StepTokens()
        began = time.perf_counter()
        if self.store is not None and self.store.ssd is not None:
            self.store.spill_pending()
        if sched.store_ops:
            self._store_blocks(sched.store_ops, out)
        self._sync_phase()
        self.last_store_s = time.perf_counter() - began
        # Prompts that joined last step had their blocks planned for this step (or all cached already):
        # what their prefill captured is no longer needed.
        for rid in self._joined_last_step:
            self._captured.pop(rid, None)
            self._prefill_snaps.pop(rid, None)
        self._drop(sched.finished_request_ids)
        joined: list[tuple[str, list[Any], mx.array]] = []
        started = time.perf_counter()
        together = [c for c in sched.prefill_chunks if self._can_prefill_together(requests[c.request_id])]
        together = [together[i] for i in pick_rows([c.start + c.num_tokens for c in together])]
        for chunk in sched.prefill_chunks:
            done = None if chunk in together else self._prefill_or_fail(chunk, requests[chunk.request_id], out)
            if done is not None:
                joined.append(done)
        if together:
            joined.extend(self._prefill_together(together, requests, out))
        if joined:
            self._sync_phase(*(j[2] for j in joined))
        self.last_prefill_s = time.perf_counter() - started  # for the slow-step log line
        self.last_join_s = 0.0
        try:
            self._joined_last_step = [j[0] for j in joined]
            if joined:
                rids, caches, tokens = zip(*joined)
                # The prefills start on the device now, while the host builds the decode step's graph:
                # their first tokens, read back in `_decode`, come that much sooner (docs/BENCHMARKS.md).
                mx.async_eval(*tokens)
                positions = None
                if self.mm is not None:
                    positions = mx.array([requests[r].num_prompt_tokens + self._deltas.pop(r, 0) for r in rids])
                draft = None
                if self.spec is not None and self.spec.draft is not None:
                    draft = [self.spec.draft.prefill(r, requests[r].prompt_token_ids) for r in rids]
                self._batch.join(list(rids), list(caches), mx.concatenate(tokens), positions, draft)
                self._sync_phase(self._batch.tokens, [c.state for c in self._batch.cache])
            decoding = time.perf_counter()
            self.last_join_s = decoding - started - self.last_prefill_s
            with self.lora.rows(self.lora.rows_of(self._batch.row_ids, requests)):
                if self.spec is None or not self._batch.num_live or not self.spec.step(self, requests, out):
                    self._decode(out)
            self.last_decode_s = time.perf_counter() - decoding
        except Exception as exc:
            log.exception("decode step failed")
            rows = {rid for rid in self._batch.row_ids if rid is not None} | {j[0] for j in joined}
            out.failed.update({rid: f"decode step failed: {exc}" for rid in rows})
            # The batch caches may be half-written: start an empty batch before dropping the rest.
            self._batch = DecodeBatch(self.buckets, self._batch.kv_prealloc_tokens)
            self._drop(list(rows))
            reseed_after_failure()
            out.request_ids, out.token_ids, out.logprobs = [], [], {}
        return out

    def _sync_phase(self, *arrays) -> None:
        if self.sync_phases:
            mx.eval(*arrays)
            mx.synchronize()

    def _drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._prefill_caches.pop(rid, None)
            self._samplers.pop(rid, None)
            self._pending_lp.pop(rid, None)
            self._captured.pop(rid, None)
            self._snap_at.pop(rid, None)
            self._prefill_snaps.pop(rid, None)
            if self.spec is not None:
                self.spec.drop([rid])
            if self.mm is not None:
                self.mm.finish(rid)
                self._deltas.pop(rid, None)
        if request_ids:
            self._batch.drop(set(request_ids))

    def _store_blocks(self, store_ops: dict, out: StepTokens) -> None:
        """Copies planned blocks into the prefix cache: from a decoding row, or from a prompt's prefill cache
        (the chunks it prefilled so far), before finished requests are dropped."""
        new = []
        for rid, ops in store_ops.items():
            batched, prefilling = rid in self._batch.row_ids, rid in self._prefill_caches
            if not (batched or prefilling):
                out.failed_block_ids.extend(op.block_id for op in ops)  # nothing to copy them from
                continue
            try:
                if batched:
                    row = self._batch.row_ids.index(rid)
                    new.extend(copy_blocks(self.store, ops, self._batch.cache, row, self._batch.left_padding(row),
                                           self._captured.pop(rid, {}), self._prefill_snaps.pop(rid, None)))
                else:  # the prefill goes on: what it captured may serve its later blocks too
                    new.extend(copy_blocks(self.store, ops, self._prefill_caches[rid], None, 0,
                                           self._captured.get(rid, {}), self._prefill_snaps.get(rid)))
            except Exception:
                # Only the cache loses these blocks; the request itself is fine.
                log.exception("caching the blocks of request %s failed", rid)
                for op in ops:
                    self.store.drop(op.block_id)
                out.failed_block_ids.extend(op.block_id for op in ops)
        mx.async_eval(new)

    def _capture(self, rid: str, cache: list[Any], start: int, stop: int, num_cached: int) -> list[mx.array]:
        """After a prefill forward over [start, stop): copies what only the prefill has. The sliding
        layers' KV of blocks still inside their window (a rotating cache keeps only the last window,
        so by store time it would be gone), and the recurrent state if `stop` is the boundary chosen
        for a snapshot. Returns the new arrays."""
        captured = self._captured.get(rid)
        if captured is None:
            return []
        layout, bs, new = self.store.layout, self.block_size, []
        if layout.swa_layers and stop - start > 1:
            window = read_prefill_window(cache, layout)
            if window is not None:
                lowest = max(num_cached, window.offset - window.kv.shape[2])
                for b in range(-(-lowest // bs) * bs, stop - bs + 1, bs):
                    block = window.block(b, bs) if b not in captured else None
                    if block is not None:
                        captured[b] = block
                        new.append(block)
        if self._snap_at.get(rid) == stop:
            snap = read_state(cache, layout)
            self._prefill_snaps[rid] = (stop, snap)
            new.extend(a for arrays in snap for a in arrays)
        return new

    # -- prefill -------------------------------------------------------------------------------
    def _begin_prefill(self, request: Request) -> list[Any]:
        """The request's prefill cache, made (and its sampler set up) at its first chunk."""
        rid = request.request_id
        cache = self._prefill_caches.get(rid)
        if cache is None:
            self.lora.check(request.adapter)
            cache = self.make_cache(self.model)
            if request.cached_block_ids:
                # Timed on its own (a synced restore) only where it delays nothing: no rows decoding.
                self.store.make_cache(request.cached_block_ids, cache, sync=not self._batch.num_live)
            self._prefill_caches[rid] = cache
            self._start_captures(request)
            sampler = RowSampler.make(request.sampling, request.prompt_token_ids)
            if request.sampling.constraint is not None:
                sampler.matcher = self.grammar.compiler.compile(request.sampling.constraint)
            self._samplers[rid] = sampler
            if request.media:
                self._deltas[rid] = self.mm.start(request)
        return cache

    def _prefill(self, chunk: PrefillChunk, request: Request):
        rid = request.request_id
        cache = self._begin_prefill(request)
        if request.media:
            def forward(start: int, end: int):
                return self.mm.forward(request, start, end, cache)
        else:
            def forward(start: int, end: int):
                return self.model(mx.array(request.prompt_token_ids[start:end])[None], cache=cache)
        if rid in self._captured:
            model_forward = forward

            def forward(start: int, end: int):
                # Stop at the snapshot boundary if it falls inside, so the state there can be copied.
                at = self._snap_at.get(rid)
                if at is not None and start < at < end:
                    model_forward(start, at)
                    self._capture(rid, cache, start, at, request.num_cached_tokens)
                    start = at
                out = model_forward(start, end)
                self._capture(rid, cache, start, end, request.num_cached_tokens)
                return out
        start, end = chunk.start, chunk.start + chunk.num_tokens
        if not chunk.is_last:
            forward(start, end)
            # Bound the lazy graph: a chunk is evaluated before the next is built. Only the cache is
            # evaluated, so the LM head never runs on these positions.
            self._bound([c.state for c in cache], self._captured_arrays(rid))
            return None
        if end - start > 1 and (end - start) * (self.logits_width or 1 << 20) > self.one_forward_logits:
            # Same reason: the last position alone gets logits (what mlx-lm's generate_step does).
            forward(start, end - 1)
            start = end - 1
        logits = forward(start, end)
        return self._first_token(rid, cache, logits[:, -1, :])

    def _first_token(self, rid: str, cache: list[Any], logits: mx.array):
        """Samples a finished prompt's first token from its last position's logits [1, vocab]."""
        del self._prefill_caches[rid]
        self._snap_at.pop(rid, None)
        if self.mm is not None:
            self.mm.finish(rid)
        sampler = self._samplers[rid]
        if sampler.matcher is not None:
            logits = self.grammar.mask(logits, [(0, sampler.matcher)])
        tokens, logprobs = sample_batch(logits, [sampler])
        self._keep_logprobs([rid], [sampler], tokens, logprobs)
        return rid, cache, tokens

    def _can_prefill_together(self, request: Request) -> bool:
        # A request whose prefill captures prefix-cache data (sliding windows, recurrent snapshots) runs
        # its own forwards (`_capture` reads batch-1 caches); those families never batch anyway.
        return self._batch_prefill and not request.media and request.request_id not in self._captured

    def _prefill_together(self, chunks: list[PrefillChunk], requests: dict[str, Request], out: StepTokens):
        """Several requests' chunks in one forward (batch_prefill.py). Returns the prompts it finished, as
        `_prefill` does; a request whose prefill fails, fails alone."""
        rows = []
        for chunk in chunks:
            try:
                rows.append((chunk, self._begin_prefill(requests[chunk.request_id])))
            except Exception as exc:  # e.g. a grammar that does not compile: this request only
                self._fail_prefill(chunk.request_id, exc, out)
        if not rows:
            return []
        try:
            with self.lora.rows([requests[c.request_id].adapter for c, _ in rows]):
                logits, grown = prefill_rows(self.model, [cache for _, cache in rows], [
                    requests[c.request_id].prompt_token_ids[c.start : c.start + c.num_tokens] for c, _ in rows],
                    bound=self._bound, pad_to=self.prefill_pad_to, joining=[c.is_last for c, _ in rows])
            going_on = [layers for (c, _), layers in zip(rows, grown) if not c.is_last]
            if going_on:  # bound the lazy graph, as `_prefill` does between chunks
                self._bound([c.state for layers in going_on for c in layers])
        except Exception:
            # The rows' own caches are untouched: run them one by one, so a request that cannot be
            # prefilled fails alone.
            log.warning("batched prefill of requests %s failed; prefilling them one at a time",
                        ", ".join(c.request_id for c, _ in rows), exc_info=True)
            reseed_after_failure()
            grown = None
        joined = []
        for i, (chunk, cache) in enumerate(rows):
            if grown is None:
                done = self._prefill_or_fail(chunk, requests[chunk.request_id], out)
            elif chunk.is_last:
                cache[:] = grown[i]
                try:
                    done = self._first_token(chunk.request_id, cache, logits[i : i + 1])
                except Exception as exc:
                    done = self._fail_prefill(chunk.request_id, exc, out)
            else:
                cache[:], done = grown[i], None
            if done is not None:
                joined.append(done)
        return joined

    def _bound(self, *arrays) -> None:
        """Ends a lazy graph at `arrays` (a prefill chunk's caches). While rows decode, the arrays are only
        launched: the decode's read-back at the end of the step waits for them anyway, and waiting here
        would leave the device idle while the host builds the rest of the step (the join, the decode
        graph). With no decode rows nothing else would bound the work queued, so it is waited for."""
        if self._batch.num_live:
            mx.async_eval(*arrays)
        else:
            mx.eval(*arrays)

    def _prefill_or_fail(self, chunk: PrefillChunk, request: Request, out: StepTokens):
        """`_prefill`; if it raises, only this request fails."""
        try:
            with self.lora.rows([request.adapter]):
                return self._prefill(chunk, request)
        except Exception as exc:
            return self._fail_prefill(chunk.request_id, exc, out)

    def _fail_prefill(self, rid: str, exc: Exception, out: StepTokens) -> None:
        log.error("prefill of request %s failed", rid, exc_info=exc)
        out.failed[rid] = f"prefill failed: {exc}"
        self._drop([rid])
        reseed_after_failure()

    def _start_captures(self, request: Request) -> None:
        store = self.store
        if store is None or not (store.layout.swa_layers or store.wants_snapshots):
            return
        rid = request.request_id
        self._captured[rid] = {}
        if store.wants_snapshots:
            # The deepest boundary a later lookup of this prompt can resume at (one token is always
            # left to compute); deeper ones are snapshotted while decoding.
            at = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
            if at > request.num_cached_tokens:
                self._snap_at[rid] = at

    def _captured_arrays(self, rid: str) -> list[mx.array]:
        snap = self._prefill_snaps.get(rid)
        return [*self._captured.get(rid, {}).values(), *(a for arrays in (snap[1] if snap else []) for a in arrays)]

    # -- decode --------------------------------------------------------------------------------
    def _keep_logprobs(self, rids, rows: list[RowSampler], tokens: mx.array, logprobs: mx.array) -> None:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs]
        if not wanted:
            return
        k = max(rows[i].params.top_logprobs for i in wanted)
        chosen, top_ids, top_vals = gather_logprobs(tokens, logprobs, k)
        for i in wanted:
            top = (top_ids[i], top_vals[i]) if top_ids is not None else None
            self._pending_lp[rids[i]] = (chosen[i], top)

    def _decode(self, out: StepTokens) -> None:
        batch = self._batch
        if not batch.num_live:
            return
        rids = list(batch.row_ids)
        fed = batch.tokens
        fed_lp = {rid: self._pending_lp.pop(rid) for rid in rids if rid in self._pending_lp}
        rows = [self._samplers[rid] if rid is not None else _FILLER for rid in rids]

        if batch.positions is not None:
            logits = self.model(fed[:, None], cache=batch.cache, positions=batch.positions[:, None])
            batch.positions = batch.positions + 1
        else:
            logits = self.model(fed[:, None], cache=batch.cache)
        logits = logits[:, -1, :]
        constrained = [(i, self._samplers[rid].matcher) for i, rid in enumerate(rids)
                       if rid is not None and self._samplers[rid].matcher is not None]
        if constrained:
            # The device runs the forward while the CPU advances each grammar by the token it is
            # fed and computes the next mask; rows without a grammar pay nothing of this.
            mx.async_eval(logits)
            fed_ids = fed.tolist()
            rejected = self.grammar.advance(constrained, fed_ids)
            for i, why in rejected.items():
                out.failed[rids[i]] = why
            logits = self.grammar.mask(logits, [c for c in constrained if c[0] not in rejected])
        else:
            fed_ids = None
        nxt, logprobs = sample_batch(logits, rows)
        self._keep_logprobs(rids, rows, nxt, logprobs)
        batch.tokens = nxt
        mx.async_eval(nxt, *(a for v in self._pending_lp.values() for a in pending_arrays(v)))

        for rid, token in zip(rids, fed_ids if fed_ids is not None else fed.tolist()):
            if rid is not None and rid not in out.failed:
                out.request_ids.append(rid)
                out.token_ids.append(token)
        for rid, pending in fed_lp.items():
            if rid in out.failed:
                continue
            token = out.token_ids[out.request_ids.index(rid)]
            out.logprobs[rid] = [to_logprob(token, pending, self._samplers[rid].params.top_logprobs)]


def reseed_after_failure() -> None:
    """mlx-lm's samplers are mx.compile'd over mx.random.state; one that raised mid-trace leaves a
    placeholder array there and every later unseeded sample would fail. Start a fresh key."""
    mx.random.seed(time.time_ns() % 2**32)


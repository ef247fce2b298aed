"""All MLX work of a step: block stores, chunked prefill (its `Prefiller`, prefill.py), the join, and the one
decode step, plain or speculative (spec/ only plans drafts and follows what was accepted).

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

from mlxhost.engine.grammar import GrammarSource
from mlxhost.engine.request import Request, SamplingParams, TokenLogprob
from mlxhost.engine.runner.batch import DecodeBatch
from mlxhost.engine.runner.batch_prefill import why_not_batched
from mlxhost.engine.runner.block_copy import copy_blocks
from mlxhost.engine.runner.mm_prefill import MultimodalPrefill
from mlxhost.engine.runner.prefill import Prefiller
from mlxhost.engine.runner.sampling import (
    RowSampler,
    gather_emitted,
    keep_logprobs,
    pending_arrays,
    reseed_after_failure,
    sample_batch,
    to_logprob,
    verify_batch,
)
from mlxhost.engine.runner.state import RowTable
from mlxhost.engine.scheduler import SchedulerOutput
from mlxhost.kv.store.kv_store import KVBlockStore
from mlxhost.kv.store.ops import run_cache_ops
from mlxhost.lora.manager import AdapterSet
from mlxhost.platform.backend import is_cuda

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
    # Prompts that asked for their own logprobs and got their first token this step: their entries.
    prompt_logprobs: dict[str, list] = field(default_factory=dict)


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
        spec: Any = None,
        batch_prefill: bool = True,
        logits_width: int = 0,
        lora: AdapterSet | None = None,
    ) -> None:
        self._model = model
        # LoRA adapters on this model (lora/): each forward runs inside `lora.rows(...)`, one id per row.
        self._lora = lora if lora is not None else AdapterSet(model)
        self.make_cache = make_cache  # a request's fresh caches (quantized layers under --kv-bits)
        self.grammar = grammar
        self.spec = spec  # speculative decoding (spec/decoder.py SpeculativeDecoder); None: off
        self.buckets = buckets
        self.store = store
        self.block_size = block_size
        self.kv_prealloc_tokens = kv_prealloc_tokens
        # Vision-language models: multimodal prefill, and decode positions carried per row.
        self.mm = MultimodalPrefill(model, vision_cache) if getattr(model, "is_vlm", False) else None
        self.rows = RowTable()  # request id -> RowState: everything kept per request (state.py)
        self.prefiller = Prefiller(
            model, self.rows, make_cache=make_cache, store=store, block_size=block_size, grammar=grammar,
            lora=self._lora, mm=self.mm, batch_prefill=batch_prefill and why_not_batched(model, make_cache) is None,
            logits_width=logits_width, one_forward_logits=_ONE_FORWARD_LOGITS if is_cuda() else 0,
            # On MLX-CUDA the server meets few distinct forward shapes: with `--cudnn-attention on` every new
            # attention shape costs a graph (platform/cudnn_attention.py). Elsewhere padding would cost.
            pad_to=_PREFILL_PAD_TO if is_cuda() else 1)
        # Where the last step's time went, for the slow-step log line and MLXHOST_STEP_TRACE.
        self.last_prefill_s = self.last_store_s = self.last_join_s = self.last_decode_s = 0.0
        # Inside a plain decode: the sampling graph, its async_eval, the read-back of the tokens fed.
        self.last_sample_s = self.last_launch_s = self.last_readback_s = 0.0
        # MLXHOST_STEP_SYNC (diagnosis only, slows every step): wait for the device after the stores, the
        # prefill and the join, so those columns of the step trace hold their device time too.
        self.sync_phases = False
        self.reset()

    def reset(self) -> None:
        """Forgets every request and starts an empty decode batch: at start-up, and after a step failed
        in a way no request could be blamed for (its caches may be half-written)."""
        self.rows.clear()  # the same table: the prefiller starts rows in it
        self.batch = DecodeBatch(self.buckets, self.kv_prealloc_tokens)
        self._joined_last_step: list[str] = []

    @property
    def model(self) -> Any:
        return self._model

    @model.setter
    def model(self, model: Any) -> None:
        # A model wrapped after start-up (a distributed rank's) prefills too.
        self._model = self.prefiller.model = model

    @property
    def lora(self) -> AdapterSet:
        return self._lora

    @lora.setter
    def lora(self, lora: AdapterSet) -> None:
        self._lora = self.prefiller.lora = lora

    @property
    def num_rows(self) -> int:
        return len(self.batch)

    def execute(self, sched: SchedulerOutput, requests: dict[str, Request]) -> StepTokens:
        """Runs one step. A failure that belongs to one request (its prefill, its blocks' copy) fails
        only that request; a failed decode forward fails the rows of the decode batch, which share
        it. Either way the other requests and the prefix cache carry on."""
        out = StepTokens()
        began = time.perf_counter()
        # The plan's cache work first (drops, SSD loads, resume checks), on every rank: the core reads the results.
        self.cache_results = run_cache_ops(self.store, sched.cache_ops)
        if self.store is not None and self.store.ssd is not None:
            self.store.spill_pending()
        if sched.store_ops:
            self._store_blocks(sched.store_ops, out)
        self._sync_phase()
        self.last_store_s = time.perf_counter() - began
        # Prompts that joined last step had their blocks planned for this step (or all cached already):
        # what their prefill captured is no longer needed.
        for rid in self._joined_last_step:
            row = self.rows.get(rid)
            if row is not None:
                row.captured = row.prefill_snap = None
        self._free(sched.finished_request_ids)
        started = time.perf_counter()
        joined = self.prefiller.run(sched.prefill_chunks, requests, out, decoding=bool(self.batch.num_live))
        if joined:
            self._sync_phase(*(j[2] for j in joined))
            joined = self.prefiller.take_prompt_scores(joined, requests, out)
        # For the slow-step log line and `--speculative auto`'s step clock, which takes no step after a prefill as a
        # cost sample: 0 exactly when no prompt prefilled (the clock once saw this step's few microseconds as one).
        self.last_prefill_s = time.perf_counter() - started if sched.prefill_chunks else 0.0
        self.last_join_s = self.last_sample_s = self.last_launch_s = self.last_readback_s = 0.0
        try:
            self._joined_last_step = [j[0] for j in joined]
            if joined:
                self._join(joined, requests)
            decoding = time.perf_counter()
            self.last_join_s = decoding - started - self.last_prefill_s
            if self.batch.num_live:
                with self.lora.rows(self.lora.rows_of(self.batch.row_ids, requests)):
                    self._decode(out, self.spec.plan(self, requests) if self.spec is not None else None)
            self.last_decode_s = time.perf_counter() - decoding
        except Exception as exc:
            log.exception("decode step failed")
            rows = {rid for rid in self.batch.row_ids if rid is not None} | {j[0] for j in joined}
            out.failed.update({rid: f"decode step failed: {exc}" for rid in rows})
            # The batch caches may be half-written: start an empty batch before dropping the rest.
            self.batch = DecodeBatch(self.buckets, self.kv_prealloc_tokens)
            self._free(list(rows))
            reseed_after_failure()
            out.request_ids, out.token_ids, out.logprobs = [], [], {}
        return out

    def _join(self, joined: list[tuple[str, list[Any], mx.array]], requests: dict[str, Request]) -> None:
        """Prompts whose prefill finished join the decode batch with their first tokens."""
        rids, caches, tokens = zip(*joined)
        # The prefills start on the device now, while the host builds the decode step's graph: their
        # first tokens, read back in `_decode`, come that much sooner (docs/BENCHMARKS.md).
        mx.async_eval(*tokens)
        positions = None
        if self.mm is not None:
            positions = mx.array([requests[r].num_prompt_tokens + self.rows[r].position_delta for r in rids])
        beside = None  # a proposer's own caches (a draft model's), row for row beside the target's
        if self.spec is not None and self.spec.proposer.keeps_cache:
            beside = [self.spec.proposer.join(self.rows[r], requests[r]) for r in rids]
        self.batch.join(list(rids), list(caches), mx.concatenate(tokens), positions, beside)
        self._sync_phase(self.batch.tokens, [c.state for c in self.batch.cache])

    def _sync_phase(self, *arrays) -> None:
        if self.sync_phases:
            mx.eval(*arrays)
            mx.synchronize()

    def _free(self, request_ids: list[str]) -> None:
        """The one place a request's runner state goes (finished, aborted or failed): its row state and
        its row of the decode batch."""
        if request_ids:
            self.rows.free(request_ids)
            self.batch.drop(set(request_ids))

    def _store_blocks(self, store_ops: dict, out: StepTokens) -> None:
        """Copies planned blocks into the prefix cache: from a decoding row, or from a prompt's prefill cache
        (the chunks it prefilled so far), before finished requests are dropped."""
        new = []
        for rid, ops in store_ops.items():
            row = self.rows.get(rid)
            batched, prefilling = rid in self.batch.row_ids, row is not None and row.prefill_cache is not None
            if not (batched or prefilling):
                out.failed_block_ids.extend(op.block_id for op in ops)  # nothing to copy them from
                continue
            try:
                if batched:
                    i = self.batch.row_ids.index(rid)
                    captured, snap = row.captured or {}, row.prefill_snap
                    row.captured = row.prefill_snap = None
                    new.extend(copy_blocks(self.store, ops, self.batch.cache, i, self.batch.left_padding(i),
                                           captured, snap))
                else:  # the prefill goes on: what it captured may serve its later blocks too
                    new.extend(copy_blocks(self.store, ops, row.prefill_cache, None, 0, row.captured or {},
                                           row.prefill_snap))
            except Exception:
                # Only the cache loses these blocks; the request itself is fine.
                log.exception("caching the blocks of request %s failed", rid)
                for op in ops:
                    self.store.drop(op.block_id)
                out.failed_block_ids.extend(op.block_id for op in ops)
        mx.async_eval(new)

    # -- decode: the one step, plain or speculative ---------------------------------------------
    def _decode(self, out: StepTokens, drafts: Any = None) -> None:
        """One decode step of the batch: the forward, grammar masks, sampling, logprobs and the batch's
        advance. With `drafts` (spec/decoder.py `Drafts`) the same step feeds each row its drafts too and
        verifies them instead of sampling (`verify_batch`); it then waits for the accepted counts, where a
        plain step only launches its work and reads back the tokens it fed."""
        batch = self.batch
        rids = list(batch.row_ids)
        table, samplers, fed_lp = self.rows, [], {}
        for rid in rids:
            if rid is None:
                samplers.append(_FILLER)
                continue
            row = table[rid]
            samplers.append(row.sampler)
            if row.pending_logprob is not None:
                fed_lp[rid], row.pending_logprob = row.pending_logprob, None

        last = batch.tokens
        if drafts is None:
            fed, tap = last[:, None], self.spec.plain_tap(self) if self.spec is not None else None
        else:
            fed, tap = drafts.fed, drafts.tap
        if batch.positions is not None:  # vision-language models: each row's positions carry its rope delta
            positions = batch.positions[:, None]
            if drafts is not None:
                positions = positions + mx.arange(fed.shape[1])
            logits, hidden = self.model(fed, cache=batch.cache, positions=positions), None
        elif tap is not None:  # the same forward, keeping the hidden states a draft head drafts from
            logits, hidden = tap(fed, batch.cache)
        else:
            logits, hidden = self.model(fed, cache=batch.cache), None
        if drafts is None:
            logits = logits[:, -1, :]
        constrained = [(i, s.matcher) for i, s in enumerate(samplers) if s.matcher is not None]
        fed_ids = None
        if constrained:
            # The device runs the forward while the CPU advances each grammar by the token it is fed and
            # computes the next masks; rows without a grammar pay nothing of this.
            mx.async_eval(logits)
            fed_ids = fed.tolist()
            logits = self._constrain(logits, constrained, fed_ids, drafts, rids, out)

        if drafts is not None:
            self._verify(out, rids, samplers, fed, logits, hidden, drafts, fed_lp, constrained)
            return
        sampling = time.perf_counter()
        nxt, logprobs = sample_batch(logits, samplers)
        kept = keep_logprobs(table, rids, samplers, nxt, logprobs)
        if hidden is not None:
            kept += self.spec.observe(self, hidden, nxt)
        batch.advance(nxt)
        launching = time.perf_counter()
        mx.async_eval(nxt, *kept)
        reading = time.perf_counter()

        for rid, token in zip(rids, [f[0] for f in fed_ids] if fed_ids is not None else last.tolist()):
            if rid is not None and rid not in out.failed:
                out.request_ids.append(rid)
                out.token_ids.append(token)
        for rid, pending in fed_lp.items():
            if rid in out.failed:
                continue
            token = out.token_ids[out.request_ids.index(rid)]
            out.logprobs[rid] = [to_logprob(token, pending, table[rid].sampler.params.top_logprobs)]
        self.last_sample_s, self.last_launch_s = launching - sampling, reading - launching
        self.last_readback_s = time.perf_counter() - reading

    def _constrain(self, logits: mx.array, constrained: list, fed_ids: list, drafts: Any, rids: list,
                   out: StepTokens) -> mx.array:
        """Each grammar takes its row's fed token (a row it refuses fails); then the logits are masked: a
        plain step's [B, V], a speculative step's [B, 1 + K, V] at every position of each row's draft, which
        its grammar cuts at the first token it rejects (`drafts.lengths`, in place)."""
        grammar = self.grammar
        rejected = grammar.advance(constrained, [f[0] for f in fed_ids])
        for i, why in rejected.items():
            out.failed[rids[i]] = why
        rows = [c for c in constrained if c[0] not in rejected]
        if drafts is None:
            return grammar.mask(logits, rows)
        lengths = drafts.lengths
        for i in rejected:
            lengths[i] = 0
        walks = [(i, m, fed_ids[i][1 : 1 + lengths[i]]) for i, m in rows]
        logits, kept = grammar.mask_drafts(logits, walks)
        for (i, _, _), n in zip(walks, kept):
            lengths[i] = n
        return logits

    def _verify(self, out: StepTokens, rids: list, samplers: list[RowSampler], fed: mx.array, logits: mx.array,
                hidden: Any, drafts: Any, fed_lp: dict, constrained: list) -> None:
        """A speculative step's second half: verification, its one wait (accepted counts, fed tokens and
        drafts, every logprob to emit), the rewind, and what each row emits (its fed token and accepted
        drafts); a row's next token, and its logprob, stay pending until it is fed, as in a plain step."""
        table, num_k = self.rows, fed.shape[1] - 1
        accepted, final, logprobs = verify_batch(logits, samplers, fed[:, 1:], drafts.lengths)
        wanted = [i for i, s in enumerate(samplers) if s.params.logprobs]
        gathered = ()
        if wanted:
            k = max(samplers[i].params.top_logprobs for i in wanted)
            gathered = gather_emitted(logprobs, fed[:, 1:], accepted, final, wanted, k)
            gathered = tuple(a for a in gathered if a is not None)
        head = mx.concatenate([accepted[:, None].astype(fed.dtype), fed], axis=1)
        mx.eval(head, final, *gathered, *(a for v in fed_lp.values() for a in pending_arrays(v)))
        host = head.tolist()
        accepted_ids, fed_ids = [h[0] for h in host], [h[1:] for h in host]

        num_drop = [num_k - a for a in accepted_ids]
        self.batch.advance(final, accepted, num_drop)
        for i, matcher in constrained:
            if rids[i] not in out.failed:  # the next token is fed, and checked, next step
                for token in fed_ids[i][1 : 1 + accepted_ids[i]]:
                    self.grammar.feed(matcher, token)
        num_emitted = 0
        for i, rid in enumerate(rids):
            if rid is None or rid in out.failed:
                continue
            tokens = fed_ids[i][: 1 + accepted_ids[i]]
            out.request_ids.extend([rid] * len(tokens))
            out.token_ids.extend(tokens)
            num_emitted += len(tokens)
            if rid in fed_lp:
                out.logprobs[rid] = [to_logprob(tokens[0], fed_lp[rid], samplers[i].params.top_logprobs)]
        self.spec.verified(drafts, hidden, final, accepted_ids, num_drop, num_emitted)
        if not wanted:
            return
        chosen = gathered[0].tolist()
        top_ids, top_vals = (gathered[1].tolist(), gathered[2].tolist()) if len(gathered) == 3 else (None, None)
        t = num_k + 1
        for n, i in enumerate(wanted):
            rid, a = rids[i], accepted_ids[i]
            if rid in out.failed:
                continue
            k = samplers[i].params.top_logprobs
            entries = [(chosen[p], (top_ids[p], top_vals[p]) if top_ids is not None else None)
                       for p in range(n * t, n * t + a + 1)]
            out.logprobs.setdefault(rid, []).extend(to_logprob(fed_ids[i][1 + j], entries[j], k) for j in range(a))
            table[rid].pending_logprob = entries[a]

"""Speculative decode steps: every row of the batch drafts, all rows verify in one forward.

Row i is fed `[last, d1 .. dK]` (K: the longest draft this step; shorter drafts are padded and their
padding is never accepted), keeps its accepted prefix and one more token from the target, and its KV
is rewound past what it rejected (`verify.rewind`). Emitted this step: `last` and the accepted
drafts, all of which the row's KV now holds (the invariant the prefix cache relies on); the extra
token is fed, and emitted, next step, as in plain decoding.

Constrained rows draft too: their grammar, advanced by `last`, cuts each draft at the first token it
rejects and masks the logits at every position, so verification compares against the constrained
target (`GrammarSource.mask_drafts`); after verification it advances by the accepted drafts. Rows
with processors (penalties, logit bias) still ride in the same forward with no draft. The drafts come
from the proposer the registry names (registry.py); one that finds nothing to draft (prompt lookup
with no row inside a span its history already holds, judged before waiting for `last`) makes the
step return False and the runner decodes as usual, pipelined. Drafts are point masses (copied
tokens, a draft model's argmax, unconstrained: the grammar cuts them), also for sampled rows:
`verify.verify_group` keeps their distribution exact.

A speculative step waits for its verification (the rewind needs the accepted counts), so it gives up
the overlap of scheduling with the device that plain steps have; it reads everything it needs (the
accepted counts, the tokens, the logprobs of emitted tokens) in one evaluation. Batches over
`--spec-max-batch` requests and rows whose drafts keep failing do not speculate, and with `--speculative
auto` neither do steps whose expected gain does not cover the measured cost of verifying (policy.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.runner.sampling import gather_logprobs, pending_arrays, sample_batch, to_logprob
from mlxhost.engine.spec.policy import AutoPolicy, DraftLength, can_speculate, expected_gain
from mlxhost.engine.spec.proposer import DraftStep, Proposer
from mlxhost.engine.spec.verify import can_rewind, rewind, verify_group

log = logging.getLogger(__name__)

_FILLER = SamplingParams(max_tokens=1, temperature=0.0)  # filler rows of a bucketed batch verify greedily


@dataclass
class SpecStats:
    num_steps: int = 0  # speculative forwards
    num_drafted: int = 0  # draft tokens proposed to the target (padding not counted)
    num_accepted: int = 0
    num_emitted: int = 0  # tokens emitted by speculative steps (accepted drafts and the fed token)
    # Decode steps that did not speculate: the batch was over --spec-max-batch (counted in both), or
    # no row drafted (paused rows, prompt lookup finding nothing).
    num_plain_steps: int = 0
    num_big_batch_steps: int = 0
    num_row_pauses: int = 0  # times a row stopped drafting because its drafts kept failing
    # Plain steps of a batch small enough to speculate whose head was not run: no row drafts next step.
    num_head_skips: int = 0
    num_declined_steps: int = 0  # --speculative auto: steps that could draft and decoded plainly (no gain)

    def as_dict(self) -> dict:
        rate = self.num_accepted / self.num_drafted if self.num_drafted else 0.0
        return {**self.__dict__, "acceptance_rate": rate}


class SpeculativeDecoder:
    """The speculative step over the runner's batch, with drafts from `proposer`. Its per-row state (a
    row's draft length, the proposer's own) lives on the runner's row states."""

    def __init__(self, num_draft_tokens: int, proposer: Proposer, max_batch: int = 4, auto: bool = False) -> None:
        self.max_k = num_draft_tokens
        self.max_batch = max_batch  # --spec-max-batch
        self.proposer = proposer
        self.stats = SpecStats()
        self.auto = AutoPolicy() if auto else None  # --speculative auto: measured costs decide each step
        self._clock = 0  # decode steps seen, plain ones included: what rows' pauses count in
        self._hidden = None  # a plain step's hidden states, from `forward` to `observe`
        self._last = None  # auto: (start, rows, speculated) of the step before, to time it

    @property
    def mode(self) -> str:
        return self.proposer.name

    # -- the step ------------------------------------------------------------------------------
    def step(self, runner: Any, requests: dict[str, Request], out: Any) -> bool:
        """One speculative decode step of the runner's batch; False: this step decodes plainly."""
        if self.auto is None:
            return self._step(runner, requests, out)
        # A step's time is from its start to the next one's, less the next one's prefill: with plain steps
        # pipelined that is what the device took. Samples across a change of rows are dropped.
        started, rows = time.perf_counter(), tuple(runner.batch.row_ids)
        if self._last is not None and self._last[1] == rows:
            self.auto.costs.record(self._last[2], runner.batch.num_live,
                                   started - self._last[0] - runner.last_prefill_s)
        speculated = self._step(runner, requests, out)
        self._last = (started, rows, speculated)
        return speculated

    def _step(self, runner: Any, requests: dict[str, Request], out: Any) -> bool:
        batch = runner.batch
        self._clock += 1
        if not can_rewind(batch.cache):
            return False
        if not can_speculate(batch.num_live, self.max_batch):
            self.stats.num_plain_steps += 1
            self.stats.num_big_batch_steps += 1
            return False
        rids = list(batch.row_ids)
        states = [runner.rows[rid] if rid is not None else None for rid in rids]
        samplers = [row.sampler if row is not None else None for row in states]
        # Processors see the tokens before the position they score: verifying K drafts would take K runs
        # of them over K histories, so these rows ride along without a draft.
        special = [i for i, s in enumerate(samplers) if s is not None and s.has_processors]
        plain = [i for i, s in enumerate(samplers) if s is not None and i not in special]
        # Each row's draft budget: its adapted length (0 while paused); emitted this step are `last`
        # and the accepted drafts, and max_tokens bounds how many can count.
        budget = {}
        for i in plain:
            row, request = states[i], requests[rids[i]]
            if not request.sampling.speculative:  # the request asked to decode without drafts
                continue
            if row.draft_length is None:
                row.draft_length = DraftLength(self.max_k)
            self.proposer.prepare(row, request)
            k = min(row.draft_length.length(self._clock), request.sampling.max_tokens - request.num_output_tokens - 1)
            if k > 0:
                budget[i] = k
        draft_step = DraftStep(batch, rids, states, requests, budget, self._clock)
        proposal = (self.proposer.propose(draft_step)
                    if budget and self.proposer.can_draft(draft_step) and self._pays(batch, states, budget) else None)
        if proposal is None:
            # No row drafts (with prompt lookup: none is inside a span its history already holds, judged
            # without `last`, which is still being computed): decode plainly, pipelined.
            self.stats.num_plain_steps += 1
            return False
        fed, lengths = proposal
        num_k = fed.shape[1] - 1
        last, last_ids = batch.tokens, None
        drafts = fed[:, 1:]
        if batch.positions is not None:  # vision-language models: each row's positions carry its rope delta
            logits = runner.model(fed, cache=batch.cache, positions=batch.positions[:, None] + mx.arange(num_k + 1))
        elif self.proposer.tap is not None:  # the same forward, keeping the hidden states the proposer drafts from
            logits, draft_step.hidden = self.proposer.tap(fed, batch.cache)
        else:
            logits = runner.model(fed, cache=batch.cache)

        proposed = list(lengths)  # before grammars cut drafts: what the rows' draft lengths adapt to
        grammar_rows = [i for i in plain if samplers[i].matcher is not None]
        if grammar_rows:
            logits = self._constrain(runner, logits, fed, grammar_rows, samplers, rids, lengths, out)

        # Rows without a draft that need their own treatment take the first position's logits.
        accepted_parts, final_parts, order = [], [], []
        lp_special = None
        if special:
            first = logits[mx.array(special), 0, :]
            constrained = [(j, samplers[i].matcher) for j, i in enumerate(special) if samplers[i].matcher is not None]
            if constrained:
                if last_ids is None:
                    last_ids = last.tolist()  # the grammars advance on the host
                fed_ids = [last_ids[i] for i in special]
                rejected = runner.grammar.advance(constrained, fed_ids)
                for j, why in rejected.items():
                    out.failed[rids[special[j]]] = why
                first = runner.grammar.mask(first, [c for c in constrained if c[0] not in rejected])
            tokens, lp_special = sample_batch(first, [samplers[i] for i in special])
            accepted_parts.append(mx.zeros((len(special),), dtype=mx.int32))
            final_parts.append(tokens)
            order.extend(special)

        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        num_draft = mx.array(lengths)
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(samplers):
            if i in special:
                continue
            if s is None or s.params.is_greedy:
                groups.setdefault(("greedy",), []).append(i)
            elif s.key is not None:
                groups[("seed", i)] = [i]
            else:
                groups.setdefault((s.params.temperature, s.params.top_p, s.params.top_k, s.params.min_p), []).append(i)
        for idx in groups.values():
            sel = mx.array(idx) if len(idx) < len(rids) else None
            pick = (lambda a: a[sel]) if sel is not None else (lambda a: a)
            s = samplers[idx[0]]
            params = s.params if s is not None else _FILLER
            acc, fin = verify_group(pick(logprobs), pick(drafts), pick(num_draft), params,
                                    s.next_key() if s is not None and len(idx) == 1 else None)
            accepted_parts.append(acc.astype(mx.int32))
            final_parts.append(fin.astype(last.dtype))
            order.extend(idx)
        inverse = [0] * len(order)
        for pos, i in enumerate(order):
            inverse[i] = pos
        inv = mx.array(inverse)
        accepted = mx.concatenate(accepted_parts)[inv]
        final = mx.concatenate([f.astype(last.dtype) for f in final_parts])[inv]
        # Logprobs: the fed tokens' (pending from the step before), then the next tokens' of rows
        # without a draft (sampled their own way), and lazily those of the other rows' emitted tokens.
        fed_lps = runner.take_fed_logprobs(rids)
        kept = []
        if special and lp_special is not None:
            kept = runner.keep_logprobs([rids[i] for i in special], [samplers[i] for i in special],
                                        final[mx.array(special)], lp_special)
        wanted = [i for i in plain if samplers[i].params.logprobs]
        gathered = self._gather_logprobs(samplers, wanted, logprobs, drafts, accepted, final)

        # The one wait of the step: accepted counts, fed tokens and drafts, and every logprob to emit.
        head = mx.concatenate([accepted[:, None].astype(fed.dtype), fed], axis=1)
        mx.eval(head, final, *gathered, *kept, *(a for v in fed_lps.values() for a in pending_arrays(v)))
        host = head.tolist()
        accepted_ids = [h[0] for h in host]
        last_ids, draft_ids = [h[1] for h in host], [h[2:] for h in host]

        # Rewind every row past what it rejected (fillers and rows without a draft: all K).
        num_drop = [num_k - a for a in accepted_ids]
        rewind(batch.cache, num_drop)
        batch.padding_changed()
        for i in grammar_rows:
            if rids[i] not in out.failed:  # the final token is fed, and checked, next step
                for token in draft_ids[i][: accepted_ids[i]]:
                    runner.grammar.feed(samplers[i].matcher, token)
        draft_step.fed, draft_step.next_tokens = fed, final
        self.proposer.accept(draft_step, accepted_ids, num_drop)
        batch.tokens = final
        if batch.positions is not None:
            batch.positions = batch.positions + 1 + accepted

        self._emit(rids, last_ids, draft_ids, accepted_ids, out)
        self._emit_logprobs(states, fed_lps, wanted, rids, last_ids, draft_ids, accepted_ids, num_k, gathered, out)
        self._adapt(states, plain, proposed, lengths, accepted_ids)
        return True

    def _pays(self, batch: Any, states: list, budget: dict[int, int]) -> bool:
        """--speculative auto: the drafting rows' expected gain against the measured cost of verifying."""
        if self.auto is None:
            return True
        gains = [expected_gain(states[i].draft_length.acceptance, k) for i, k in budget.items()]
        if self.auto.pays(batch.num_live, gains):
            return True
        self.stats.num_declined_steps += 1
        return False

    # -- plain steps, for proposers fed hidden states ------------------------------------------------
    def forward(self, runner: Any, inputs: mx.array) -> mx.array:
        """A plain step's forward. Through the proposer's tap while the batch is small enough to speculate
        and a row may draft next step, so its head has a seed then; the model's own call for proposers
        without a head, for larger batches and while every row is paused (their heads miss those steps)."""
        batch = runner.batch
        if self.proposer.tap is None or not can_speculate(batch.num_live, self.max_batch):
            return runner.model(inputs, cache=batch.cache)
        if not self._head_wanted(runner):
            self.stats.num_head_skips += 1
            return runner.model(inputs, cache=batch.cache)
        logits, self._hidden = self.proposer.tap(inputs, batch.cache)
        return logits

    def _head_wanted(self, runner: Any) -> bool:
        """Whether a row may draft next step, so needs this step's seed. Paused rows (and rows that never
        draft) cost no head work; the head's KV then misses those steps, which makes a resumed row's drafts
        worse, never wrong."""
        rows, nxt = runner.rows, self._clock + 1
        if self.auto is not None and self.auto.declining(runner.batch.num_live):
            return False
        for rid in runner.batch.row_ids:
            length = rows[rid].draft_length if rid is not None else None
            if length is not None and length.length(nxt) > 0:
                return True
        return False

    def observe(self, runner: Any, next_tokens: mx.array) -> list:
        """After a plain step's sampling: the head takes (hidden, next token) for every row. Returns the
        arrays to launch with the step's."""
        hidden, self._hidden = self._hidden, None
        if hidden is None:
            return []
        batch = runner.batch
        rids = list(batch.row_ids)
        step = DraftStep(batch, rids, [runner.rows[r] if r is not None else None for r in rids], {}, {},
                         self._clock)
        return self.proposer.observe(step, hidden, next_tokens)

    @staticmethod
    def _constrain(runner, logits, fed, constrained, samplers, rids, lengths, out) -> mx.array:
        """Constrained drafting rows: each grammar takes the fed token, cuts the row's draft (`lengths`,
        in place) and masks every position. The host work overlaps the forward."""
        mx.async_eval(logits)
        fed_ids = fed.tolist()
        grammar = runner.grammar
        rows = [(i, samplers[i].matcher) for i in constrained]
        rejected = grammar.advance(rows, [f[0] for f in fed_ids])
        for i, why in rejected.items():
            out.failed[rids[i]] = why
            lengths[i] = 0
        walks = [(i, m, fed_ids[i][1 : 1 + lengths[i]]) for i, m in rows if i not in rejected]
        logits, kept = grammar.mask_drafts(logits, walks)
        for (i, _, _), n in zip(walks, kept):
            lengths[i] = n
        return logits

    @staticmethod
    def _gather_logprobs(samplers, wanted, logprobs, drafts, accepted, final) -> tuple:
        """Lazily, for the drafting rows that asked for logprobs: at every position 0..K the logprob
        of the token emitted there if that many drafts are accepted (the draft, or at the row's
        accepted count its next token), and the top alternatives. Which positions count is read back
        with the accepted counts, in the same evaluation."""
        if not wanted:
            return ()
        t = drafts.shape[1] + 1
        at = mx.arange(t)[None, :] == accepted[:, None]
        emitted = mx.where(at, final[:, None], mx.pad(drafts, [(0, 0), (0, 1)]))  # [B, K+1]
        w = mx.array(wanted)
        k = max(samplers[i].params.top_logprobs for i in wanted)
        lp = logprobs[w].reshape(len(wanted) * t, logprobs.shape[-1])
        return tuple(a for a in gather_logprobs(emitted[w].reshape(-1), lp, k) if a is not None)

    def _emit(self, rids, last_ids, draft_ids, accepted_ids, out) -> None:
        stats = self.stats
        stats.num_steps += 1
        for i, rid in enumerate(rids):
            if rid is None or rid in out.failed:
                continue
            tokens = [last_ids[i], *draft_ids[i][: accepted_ids[i]]]
            out.request_ids.extend([rid] * len(tokens))
            out.token_ids.extend(tokens)
            stats.num_emitted += len(tokens)

    @staticmethod
    def _emit_logprobs(states, fed_lps, wanted, rids, last_ids, draft_ids, accepted_ids, num_k, gathered,
                       out) -> None:
        """Logprobs of the fed tokens and of the accepted drafts; a drafting row's next token's stay
        pending until it is fed (rows without a draft: the runner's `keep_logprobs` set theirs)."""
        for i, rid in enumerate(rids):
            fed_lp = fed_lps.get(rid)
            if fed_lp is not None and rid not in out.failed:
                out.logprobs[rid] = [to_logprob(last_ids[i], fed_lp, states[i].sampler.params.top_logprobs)]
        if not wanted:
            return
        chosen = gathered[0].tolist()
        top_ids, top_vals = (gathered[1].tolist(), gathered[2].tolist()) if len(gathered) == 3 else (None, None)
        t = num_k + 1
        for n, i in enumerate(wanted):
            rid, a = rids[i], accepted_ids[i]
            if rid in out.failed:
                continue
            k = states[i].sampler.params.top_logprobs
            entries = [(chosen[p], (top_ids[p], top_vals[p]) if top_ids is not None else None)
                       for p in range(n * t, n * t + a + 1)]
            out.logprobs.setdefault(rid, []).extend(to_logprob(draft_ids[i][j], entries[j], k) for j in range(a))
            states[i].pending_logprob = entries[a]

    def _adapt(self, states, plain, proposed, lengths, accepted_ids) -> None:
        """Stats count the drafts the target verified; a row's draft length adapts to what it proposed
        (a draft its grammar cut is a draft that failed there)."""
        stats = self.stats
        for i in plain:
            n, a = lengths[i], accepted_ids[i]
            stats.num_drafted += n
            stats.num_accepted += a
            if proposed[i] and states[i].draft_length.update(self._clock, proposed[i], a):
                stats.num_row_pauses += 1


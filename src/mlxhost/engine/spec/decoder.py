"""Speculative decode steps: every row of the batch drafts, all rows verify in one forward.

The decoder decides which rows draft and how far, and asks the proposer for the drafts (`plan`); the
runner's one decode step (runner/model_runner.py `_decode`) runs the forward, the grammar masks, the
verification (runner/sampling.py `verify_batch`, the counterpart of plain sampling), the logprobs and
the batch's rewind, and hands back what was accepted (`verified`).

Row i is fed `[last, d1 .. dK]` (K: the longest draft this step; shorter drafts are padded and their
padding is never accepted), keeps its accepted prefix and one more token from the target, and its KV
is rewound past what it rejected (`DecodeBatch.advance`). Emitted this step: `last` and the accepted
drafts, all of which the row's KV now holds (the invariant the prefix cache relies on); the extra
token is fed, and emitted, next step, as in plain decoding.

Constrained rows draft too: their grammar, advanced by `last`, cuts each draft at the first token it
rejects and masks the logits at every position, so verification compares against the constrained
target (`GrammarSource.mask_drafts`); after verification it advances by the accepted drafts. Rows
with processors (penalties, logit bias) still ride in the same forward with no draft. The drafts come
from the proposer the registry names (registry.py); one that finds nothing to draft (prompt lookup
with no row inside a span its history already holds, judged before waiting for `last`) makes the
step plan nothing and the runner decodes as usual, pipelined. Drafts are point masses (copied
tokens, a draft model's argmax, unconstrained: the grammar cuts them), also for sampled rows:
`verify_group` keeps their distribution exact.

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

from mlxhost.engine.request import Request
from mlxhost.engine.spec.policy import (
    SPEC,
    TAP,
    AutoPolicy,
    DraftLength,
    StepClock,
    can_speculate,
    expected_gain,
)
from mlxhost.engine.spec.proposer import DraftStep, Proposer
from mlxhost.engine.spec.verify import can_rewind

log = logging.getLogger(__name__)


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
    # --speculative auto: steps that could draft (or could have, had the policy fed the head the step
    # before) and decoded plainly by the policy's choice: no gain, and also its plain probes and the plain
    # steps that first measure a batch size.
    num_declined_steps: int = 0
    # --speculative auto: the drafts the policy expected accepted in the steps it chose to speculate, against
    # which num_accepted shows whether rows' acceptance estimates run high.
    expected_accepted: float = 0.0

    def as_dict(self) -> dict:
        rate = self.num_accepted / self.num_drafted if self.num_drafted else 0.0
        return {**self.__dict__, "acceptance_rate": rate}


@dataclass
class Drafts:
    """A speculative step's drafts, for the runner's decode step to verify."""

    step: DraftStep
    fed: mx.array  # [B, 1 + K]: each row's token to feed, then its drafts (padded to the longest)
    lengths: list[int]  # each row's drafts; a row's grammar cuts them (in place) before verification
    proposed: list[int]  # the lengths before any cut: what the rows' draft lengths adapt to
    tap: Any = None  # the proposer's forward that keeps the hidden states it drafts from


class SpeculativeDecoder:
    """Plans the speculative steps of the runner's batch, with drafts from `proposer`. Its per-row state (a
    row's draft length, the proposer's own) lives on the runner's row states."""

    def __init__(self, num_draft_tokens: int, proposer: Proposer, max_batch: int = 4, auto: bool = False) -> None:
        self.max_k = num_draft_tokens
        self.max_batch = max_batch  # --spec-max-batch
        self.proposer = proposer
        self.stats = SpecStats()
        self.auto = AutoPolicy() if auto else None  # --speculative auto: measured costs decide each step
        self._clock = 0  # decode steps seen, plain ones included: what rows' pauses count in
        self._timing = StepClock() if auto else None  # auto: which step intervals are cost samples
        self._seed_declined = None  # auto: (step, rows) whose head the policy left without a seed

    @property
    def mode(self) -> str:
        return self.proposer.name

    # -- before the step -----------------------------------------------------------------------
    def plan(self, runner: Any, requests: dict[str, Request]) -> Drafts | None:
        """This decode step's drafts; None: it decodes plainly (pipelined)."""
        if self.auto is None:
            return self._plan(runner, requests)
        # A step's time is from its start to the next one's; the clock keeps only steady-state intervals
        # (policy.py `StepClock`). The step is plain until it drafts or runs a tap.
        sample = self._timing.start(time.perf_counter(), tuple(runner.batch.row_ids), runner.last_prefill_s)
        if sample is not None:
            self.auto.costs.record(sample[0], runner.batch.num_live, sample[1])
        drafts = self._plan(runner, requests)
        if drafts is not None:
            self._timing.mark(SPEC)
        return drafts

    def _plan(self, runner: Any, requests: dict[str, Request]) -> Drafts | None:
        batch = runner.batch
        self._clock += 1
        if not can_rewind(batch.cache):
            return None
        if not can_speculate(batch.num_live, self.max_batch):
            self.stats.num_plain_steps += 1
            self.stats.num_big_batch_steps += 1
            return None
        rids = list(batch.row_ids)
        states = [runner.rows[rid] if rid is not None else None for rid in rids]
        # Each row's draft budget: its adapted length (0 while paused); emitted this step are `last`
        # and the accepted drafts, and max_tokens bounds how many can count. Processors see the tokens
        # before the position they score: verifying K drafts would take K runs of them over K histories,
        # so those rows ride along without a draft.
        budget = {}
        for i, row in enumerate(states):
            if row is None or row.sampler.has_processors:
                continue
            request = requests[rids[i]]
            if not request.sampling.speculative:  # the request asked to decode without drafts
                continue
            if row.draft_length is None:
                row.draft_length = DraftLength(self.max_k)
            self.proposer.prepare(row, request)
            k = min(row.draft_length.length(self._clock), request.sampling.max_tokens - request.num_output_tokens - 1)
            if k > 0:
                budget[i] = k
        step = DraftStep(batch, rids, states, requests, budget, self._clock)
        drafting = bool(budget) and self.proposer.can_draft(step)
        # A head the policy gave no seed last step cannot draft: the policy decides this step all the same
        # (it foresaw it plain), so it keeps counting decisions and its probes come.
        unseeded = bool(budget) and self._seed_declined == (self._clock, batch.num_live)
        decided = (drafting or unseeded) and self._pays(batch, states, budget, unseeded)
        proposal = self.proposer.propose(step) if decided and drafting else None
        if proposal is None:
            # No row drafts (with prompt lookup: none is inside a span its history already holds, judged
            # without `last`, which is still being computed): decode plainly, pipelined.
            self.stats.num_plain_steps += 1
            return None
        fed, lengths = proposal
        if self.auto is not None:  # by the drafts the rows really proposed (prompt lookup may skip rows)
            self.stats.expected_accepted += sum(expected_gain(states[i].draft_length.acceptance, n)
                                                for i, n in enumerate(lengths) if n)
        return Drafts(step, fed, list(lengths), list(lengths), self.proposer.tap)

    def _pays(self, batch: Any, states: list, budget: dict[int, int], foreseen: bool = False) -> bool:
        """--speculative auto: the drafting rows' expected gain against the measured cost of verifying."""
        if self.auto is None:
            return True
        gains = [expected_gain(states[i].draft_length.acceptance, k) for i, k in budget.items()]
        if self.auto.pays(batch.num_live, gains, foreseen):
            return True
        self.stats.num_declined_steps += 1
        return False

    # -- after the step ------------------------------------------------------------------------
    def verified(self, drafts: Drafts, hidden: Any, next_tokens: mx.array, num_accepted: list[int],
                 num_drop: list[int], num_emitted: int) -> None:
        """The runner verified `drafts`: row i kept `num_accepted[i]` drafts, its KV dropped `num_drop[i]`
        positions. The proposer follows; stats count the drafts the target verified, and a row's draft length
        adapts to what it proposed (a draft its grammar cut is a draft that failed there)."""
        step = drafts.step
        step.fed, step.next_tokens, step.hidden = drafts.fed, next_tokens, hidden
        self.proposer.accept(step, num_accepted, num_drop)
        stats = self.stats
        stats.num_steps += 1
        stats.num_emitted += num_emitted
        for i, row in enumerate(step.rows):
            if row is None:
                continue
            n, a = drafts.lengths[i], num_accepted[i]
            stats.num_drafted += n
            stats.num_accepted += a
            if drafts.proposed[i] and row.draft_length.update(self._clock, drafts.proposed[i], a):
                stats.num_row_pauses += 1

    # -- plain steps, for proposers fed hidden states ------------------------------------------------
    def plain_tap(self, runner: Any) -> Any:
        """A plain step's forward: the proposer's tap while the batch is small enough to speculate and a row
        may draft next step, so its head has a seed then; None (the model's own call) for proposers without
        a head, for larger batches and while every row is paused (their heads miss those steps)."""
        if self.proposer.tap is None or not can_speculate(runner.batch.num_live, self.max_batch):
            return None
        if not self._head_wanted(runner):
            self.stats.num_head_skips += 1
            return None
        if self._timing is not None:
            self._timing.mark(TAP)  # dearer than a plain step: not a plain cost sample
        return self.proposer.tap

    def _head_wanted(self, runner: Any) -> bool:
        """Whether a row may draft next step, so needs this step's seed. Paused rows (and rows that never
        draft) cost no head work; the head's KV then misses those steps, which makes a resumed row's drafts
        worse, never wrong."""
        rows, nxt = runner.rows, self._clock + 1
        if self.auto is not None and self.auto.declining(runner.batch.num_live):
            self._seed_declined = (nxt, runner.batch.num_live)
            return False
        for rid in runner.batch.row_ids:
            length = rows[rid].draft_length if rid is not None else None
            if length is not None and length.length(nxt) > 0:
                return True
        return False

    def observe(self, runner: Any, hidden: mx.array, next_tokens: mx.array) -> list:
        """After a plain step through the tap: the head takes (hidden, next token) for every row. Returns
        the arrays to launch with the step's."""
        batch = runner.batch
        rids = list(batch.row_ids)
        step = DraftStep(batch, rids, [runner.rows[r] if r is not None else None for r in rids], {}, {},
                         self._clock)
        return self.proposer.observe(step, hidden, next_tokens)

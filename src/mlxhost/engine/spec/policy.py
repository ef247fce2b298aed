"""When speculation pays, in plain Python (no tensor library): tested without a model.

Verifying K drafts costs K + 1 positions per row in the forward. While decode is memory-bound (few
rows: the weights' read dominates) the extra positions are nearly free; in a large batch they are
compute, and 16 speculating rows decoded slower than plain ones (docs/BENCHMARKS.md). So only small
batches speculate (`can_speculate`), and a row whose drafts keep failing stops drafting for a while
(`DraftLength`), so a useless draft costs little.

`--speculative auto` adds a measured trade (`AutoPolicy`): a step speculates only where the tokens the
drafting rows are expected to gain (each row's acceptance, `DraftLength.acceptance`, over its draft length)
make up for the measured cost of a verification step over a plain one at that batch size (`StepCosts`).

The costs come from steady-state intervals only (`StepClock`). A step is timed from its start to the next
one's, and plain steps are pipelined: a plain step launches its forward and then reads back the previous
step's token, so its interval mostly waits on the step before it, while a speculative step waits for its own
verification. The first plain step after a speculative one thus measures host time alone (far too cheap), and
a speculative step after a plain one also pays the tail of that plain step (too dear). A plain step that runs
a head's tap costs more than a plain one. So an interval counts only where the step and the one before it are
of the same kind (both speculative, or both plain with no tap) over the same rows, and each cost is the median
of its last few samples, which a kernel compile on a new shape does not move.

Each kind is measured where it is not chosen too (two-way probing): at a batch size where one kind has had
no fresh sample for `PROBE_EVERY` decisions, a run of `PROBE_LEN` steps of it is forced, long enough for a
steady-state interval; a plain probe's steps run no tap but the last, which seeds the head where speculation
follows. Otherwise, once speculation pays, plain steps would never be measured again there (and the other way
round).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Drafted steps in a row with nothing accepted before a row stops drafting.
PATIENCE = 4
# Decode steps of the first pause; each failed retry doubles it, up to the last.
FIRST_PAUSE = 8
MAX_PAUSE = 256
# A row's acceptance counts decay by this per drafted step, so it follows the text the row is in.
ACCEPTANCE_DECAY = 0.8
# At a batch size, a kind of step (plain or speculative) with no fresh sample for this many decisions there
# gets a probe: a run of PROBE_LEN steps of it, so its cost (and rows' acceptance) stays current. Three
# steps: the first one's interval follows a step of the other kind, the second is steady, and the third
# is free to feed a head (plain probe) or gives a second sample (speculative probe).
PROBE_EVERY = 64
PROBE_LEN = 3
# Samples kept per kind and batch size: their median is the cost.
COST_SAMPLES = 9

# A decode step's kind, for `StepClock`: speculative, plain, plain running the head's tap.
SPEC, PLAIN, TAP = "spec", "plain", "tap"


def can_speculate(num_rows: int, max_batch: int) -> bool:
    """Whether a decode step over `num_rows` running requests speculates (`--spec-max-batch`)."""
    return 0 < num_rows <= max_batch


@dataclass
class DraftLength:
    """One row's draft length: grows after a fully accepted draft, shrinks to just past what was
    accepted otherwise, and is 0 (no drafting) for a pause after `PATIENCE` drafts with nothing
    accepted. After the pause one draft of length 1 tries again; if it fails too the next pause is
    twice as long. Steps are the decoder's step count, plain steps included."""

    max_k: int
    k: int = field(init=False)
    num_misses: int = 0  # drafts in a row with nothing accepted
    pause: int = FIRST_PAUSE  # length of the next pause
    resume_at: int = 0  # the step from which the row drafts again
    # Decayed counts of drafts accepted and of drafts the target judged (the first rejected one included:
    # the ones after it were never tried). The prior, one of two, lets a new row try.
    num_accepted: float = 1.0
    num_tried: float = 2.0

    def __post_init__(self) -> None:
        self.k = self.max_k

    @property
    def acceptance(self) -> float:
        """The chance that the row's next draft token is accepted, given the ones before it were."""
        return self.num_accepted / self.num_tried

    def length(self, step: int) -> int:
        return 0 if step < self.resume_at else self.k

    def update(self, step: int, num_drafted: int, num_accepted: int) -> bool:
        """After step `step`, where the row drafted `num_drafted` tokens (0: no draft, nothing learnt)
        and the target accepted `num_accepted` of them. True: the row pauses from now."""
        if num_drafted == 0:
            return False
        self.num_accepted = ACCEPTANCE_DECAY * self.num_accepted + num_accepted
        self.num_tried = ACCEPTANCE_DECAY * self.num_tried + num_accepted + (num_accepted < num_drafted)
        if num_accepted:
            self.num_misses, self.pause = 0, FIRST_PAUSE
            self.k = min(self.max_k, self.k + 1) if num_accepted == num_drafted else num_accepted + 1
            return False
        self.num_misses += 1
        self.k = 1
        if self.num_misses < PATIENCE:
            return False
        # A retry after a pause that fails too starts the next, longer one at once.
        self.resume_at = step + 1 + self.pause
        self.pause = min(MAX_PAUSE, 2 * self.pause)
        return True


def expected_gain(acceptance: float, k: int) -> float:
    """Tokens beyond the one plain decoding gives that a row emits from a step with `k` drafts, each
    accepted with probability `acceptance` once the ones before it were: a + a^2 + ... + a^k."""
    return sum(acceptance ** j for j in range(1, k + 1))


@dataclass
class StepCosts:
    """A decode step's seconds by batch size (running requests), plain and speculative: the median of the
    last `COST_SAMPLES` samples, so one outlier (a kernel compile on a new shape, a stall of the host) does
    not set the cost for many steps the way a moving average's first sample did."""

    samples: dict[tuple[bool, int], deque] = field(default_factory=dict)  # (speculative, rows) -> seconds
    counts: dict[tuple[bool, int], int] = field(default_factory=dict)  # samples ever recorded: their freshness

    def record(self, speculative: bool, num_rows: int, seconds: float) -> None:
        key = (speculative, num_rows)
        self.samples.setdefault(key, deque(maxlen=COST_SAMPLES)).append(seconds)
        self.counts[key] = self.counts.get(key, 0) + 1

    def count(self, speculative: bool, num_rows: int) -> int:
        return self.counts.get((speculative, num_rows), 0)

    def cost(self, speculative: bool, num_rows: int) -> float | None:
        """The median sample (None: none yet). Of an even count the lower middle one: outliers only ever
        make a steady-state step slower."""
        got = self.samples.get((speculative, num_rows))
        return sorted(got)[(len(got) - 1) // 2] if got else None

    def ratio(self, num_rows: int) -> float | None:
        """A speculative step's cost in plain steps at this batch size (None: not both measured)."""
        plain, spec = self.cost(False, num_rows), self.cost(True, num_rows)
        return spec / plain if plain and spec is not None else None

    def nearest_ratio(self, num_rows: int) -> float | None:
        """`ratio` at this batch size, or else at the nearest one where both kinds are measured (of two as near,
        the larger: verifying costs more there). Rows finish one by one, so a batch passes through many sizes;
        learning each from nothing spent a dozen steps per size speculating and probing (None: none measured)."""
        sizes = {n for _, n in self.samples}
        for n in sorted(sizes, key=lambda n: (abs(n - num_rows), -n)):
            ratio = self.ratio(n)
            if ratio is not None:
                return ratio
        return None


class StepClock:
    """Which step intervals measure a steady-state step. Each decode step `start`s (its time, its rows, the
    prefill that ran before it) and is `mark`ed with its kind once known (`SPEC`, `PLAIN`, `TAP`; unmarked it
    is plain). Starting step N closes step N-1's interval, a sample only where N-1 and N-2 are of the same
    kind and neither ran a tap (module docstring: with pipelining the interval of a plain step mostly waits on
    the one before it), the rows of N-2, N-1 and N are the same (a join or a finish changes the work), and no
    prompt prefilled before N-1 or N. A prefill does not simply add its own time: on MLX-CUDA a prefill chunk
    that dequantizes evaluates mid-forward (platform/quantized_rows.py) and so waits for the decode forward
    launched before it, which would leave a plain step's interval with host time alone."""

    def __init__(self) -> None:
        self._before: tuple | None = None  # (rows, kind) of the step before the current one
        self._current: list | None = None  # [start, rows, kind, a prefill ran before it] of the current step

    def start(self, now: float, rows: tuple, prefill_s: float = 0.0) -> tuple[bool, float] | None:
        """A step starts at `now` over `rows`: (speculative, seconds) of the step before it, if steady."""
        before, current = self._before, self._current
        self._before = None if current is None else (current[1], current[2])
        self._current = [now, rows, PLAIN, prefill_s > 0]
        if before is None or current is None:
            return None
        started, timed_rows, kind, prefilled = current
        if kind == TAP or before != (timed_rows, kind) or rows != timed_rows or prefilled or prefill_s > 0:
            return None
        seconds = now - started
        return (kind == SPEC, seconds) if seconds > 0 else None

    def mark(self, kind: str) -> None:
        if self._current is not None:
            self._current[2] = kind


@dataclass
class _Size:
    """`AutoPolicy`'s state at one batch size."""

    decisions: int = 0
    seen: list[int] = field(default_factory=lambda: [0, 0])  # samples of [plain, spec] seen so far
    # The decision count when each kind [plain, spec] last had a fresh sample or began a probe.
    fresh: list[int] = field(default_factory=lambda: [0, 0])
    run: list[bool] = field(default_factory=list)  # the rest of a forced run: speculate or not, step by step
    gains: list[float] = field(default_factory=list)  # the last decision's, to foresee the next one
    speculated: int = 0  # decisions to speculate (probes included; the proposer may still find nothing)
    # (decision, run, probe) of a decision `declining` foresaw as plain: it stays plain, its head had no seed.
    promised: tuple | None = None


@dataclass
class AutoPolicy:
    """`--speculative auto`: whether a step whose rows may draft speculates. It does when the drafting
    rows' expected extra tokens cover what the verification costs beyond a plain step: speculating
    emits B + sum(gains) tokens in `ratio` plain steps' time, plain decoding B per step, so it pays when
    sum(gains) >= B * (ratio - 1). A batch size without both costs measured goes by the nearest size that has
    them; until any has, it speculates until a speculative sample exists, then runs plain steps (a plain probe,
    again until a sample exists). Each kind is probed where it went `PROBE_EVERY` decisions at a size without a
    fresh sample there, which measures the size's own costs."""

    costs: StepCosts = field(default_factory=StepCosts)
    sizes: dict[int, _Size] = field(default_factory=dict)
    last_rows: int | None = None  # the batch size of the last decision

    def pays(self, num_rows: int, gains: list[float], foreseen: bool = False) -> bool:
        """Whether this step speculates. `foreseen`: the step before asked `declining` here, and was told
        plain; that decision stands."""
        left = self.sizes.get(self.last_rows)
        if self.last_rows != num_rows and left is not None:
            left.run, left.promised = [], None  # a run cut short by a join or a finish is not resumed later
        self.last_rows = num_rows
        size = self._size(num_rows)
        size.decisions += 1
        size.gains = list(gains)
        promised, size.promised = size.promised, None
        if foreseen and promised is not None and promised[0] == size.decisions:
            speculate, (size.run, probe) = False, promised[1:]
        else:
            speculate, size.run, probe = self._next(size, num_rows, gains, size.decisions)
        if probe:  # a probe that yields no sample (the rows changed) is not retried at once
            size.fresh[speculate] = size.decisions
        size.speculated += speculate
        return speculate

    def summary(self) -> dict:
        """For /v1/status, per batch size: the measured step costs (ms; None: not measured there), their ratio,
        the decisions made and how many speculated."""
        out = {}
        for rows, size in sorted(self.sizes.items()):
            plain, spec = self.costs.cost(False, rows), self.costs.cost(True, rows)
            out[str(rows)] = {"plain_ms": None if plain is None else round(plain * 1e3, 3),
                              "spec_ms": None if spec is None else round(spec * 1e3, 3),
                              "ratio": None if plain is None or spec is None else round(spec / plain, 3),
                              "decisions": size.decisions, "speculated": size.speculated}
        return out

    def declining(self, num_rows: int) -> bool:
        """Whether the next step at this batch size will decode plainly, so a head need not prepare drafts
        for it (no tap: a plain probe's steps but the last stay steady-state samples). Foreseen from the
        forced run in progress, or by the formula with the last decision's gains; a plain one is kept to
        (the decoder then asks `pays` though the head cannot draft, so decisions and probes go on)."""
        size = self._size(num_rows)
        speculate, run, probe = self._next(size, num_rows, size.gains, size.decisions + 1)
        # Kept to: without the head's seed the next step cannot draft, and it still counts as a decision.
        size.promised = None if speculate else (size.decisions + 1, run, probe)
        return not speculate

    def _size(self, num_rows: int) -> _Size:
        """The batch size's state, its freshness brought up to the samples recorded since it was last seen."""
        size = self.sizes.setdefault(num_rows, _Size())
        for kind in (False, True):
            n = self.costs.count(kind, num_rows)
            if n != size.seen[kind]:
                size.seen[kind], size.fresh[kind] = n, size.decisions
        return size

    def _next(self, size: _Size, num_rows: int, gains: list[float], decision: int) -> tuple[bool, list[bool], bool]:
        """Decision number `decision` at this batch size, without changing any state: (speculate, the forced
        run left after it, whether it starts a probe)."""
        if size.run:
            return size.run[0], size.run[1:], False
        ratio = self.costs.nearest_ratio(num_rows)
        if ratio is None:  # nothing measured at any size yet
            if not size.seen[True]:
                return True, [], False  # speculate until a steady-state sample exists (two steps in a row at least)
            if not size.seen[False]:
                return False, [False] * (PROBE_LEN - 1), False  # then a plain run, again until a sample exists
        chosen = ratio is None or sum(gains) >= num_rows * (ratio - 1)
        other = not chosen
        if decision - size.fresh[other] >= PROBE_EVERY:
            return other, [other] * (PROBE_LEN - 1), True
        return chosen, [], False

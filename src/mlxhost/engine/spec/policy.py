"""When speculation pays, in plain Python (no tensor library): tested without a model.

Verifying K drafts costs K + 1 positions per row in the forward. While decode is memory-bound (few
rows: the weights' read dominates) the extra positions are nearly free; in a large batch they are
compute, and 16 speculating rows decoded slower than plain ones (docs/BENCHMARKS.md). So only small
batches speculate (`can_speculate`), and a row whose drafts keep failing stops drafting for a while
(`DraftLength`), so a useless draft costs little.

`--speculative auto` adds a measured trade (`AutoPolicy`): a step speculates only where the tokens the
drafting rows are expected to gain (each row's acceptance, `DraftLength.acceptance`, over its draft length)
make up for the measured cost of a verification step over a plain one at that batch size (`StepCosts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Drafted steps in a row with nothing accepted before a row stops drafting.
PATIENCE = 4
# Decode steps of the first pause; each failed retry doubles it, up to the last.
FIRST_PAUSE = 8
MAX_PAUSE = 256
# A row's acceptance counts decay by this per drafted step, so it follows the text the row is in.
ACCEPTANCE_DECAY = 0.8
# While speculation does not pay at a batch size, one step in this many speculates anyway (and the step
# before it feeds a head), so the costs and rows' acceptance it is judged by stay current.
PROBE_EVERY = 32
# Weight of a new step-time sample in its moving average.
COST_EMA = 0.2


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
    """Moving averages of a decode step's seconds by batch size (running requests), plain and speculative."""

    plain: dict[int, float] = field(default_factory=dict)
    spec: dict[int, float] = field(default_factory=dict)

    def record(self, speculative: bool, num_rows: int, seconds: float) -> None:
        table = self.spec if speculative else self.plain
        old = table.get(num_rows)
        table[num_rows] = seconds if old is None else old + COST_EMA * (seconds - old)

    def ratio(self, num_rows: int) -> float | None:
        """A speculative step's cost in plain steps at this batch size (None: not both measured)."""
        plain, spec = self.plain.get(num_rows), self.spec.get(num_rows)
        return spec / plain if plain and spec is not None else None


@dataclass
class AutoPolicy:
    """`--speculative auto`: whether a step whose rows may draft speculates. It does when the drafting
    rows' expected extra tokens cover what the verification costs beyond a plain step: speculating
    emits B + sum(gains) tokens in `ratio` plain steps' time, plain decoding B per step, so it pays when
    sum(gains) >= B * (ratio - 1). Until both costs are measured at a batch size, it tries speculation
    and then one plain step."""

    costs: StepCosts = field(default_factory=StepCosts)
    declined: dict[int, int] = field(default_factory=dict)  # batch size -> steps declined in a row

    def pays(self, num_rows: int, gains: list[float]) -> bool:
        if num_rows in self.costs.spec and num_rows not in self.costs.plain:
            return False  # one plain step to measure against
        ratio = self.costs.ratio(num_rows)
        if ratio is None or sum(gains) >= num_rows * (ratio - 1):
            self.declined[num_rows] = 0
            return True
        n = self.declined.get(num_rows, 0) + 1
        self.declined[num_rows] = n
        return n % PROBE_EVERY == 0

    def declining(self, num_rows: int) -> bool:
        """Whether the next step at this batch size will decode plainly (its last one was declined and
        the next is no probe): a head need not prepare drafts for it."""
        n = self.declined.get(num_rows, 0)
        return n > 0 and (n + 1) % PROBE_EVERY != 0

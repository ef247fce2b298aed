"""When speculation pays, in plain Python (no tensor library): tested without a model.

Verifying K drafts costs K + 1 positions per row in the forward. While decode is memory-bound (few
rows: the weights' read dominates) the extra positions are nearly free; in a large batch they are
compute, and 16 speculating rows decoded slower than plain ones (docs/BENCHMARKS.md). So only small
batches speculate (`can_speculate`), and a row whose drafts keep failing stops drafting for a while
(`DraftLength`), so a useless draft costs little.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Drafted steps in a row with nothing accepted before a row stops drafting.
PATIENCE = 4
# Decode steps of the first pause; each failed retry doubles it, up to the last.
FIRST_PAUSE = 8
MAX_PAUSE = 256


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

    def __post_init__(self) -> None:
        self.k = self.max_k

    def length(self, step: int) -> int:
        return 0 if step < self.resume_at else self.k

    def update(self, step: int, num_drafted: int, num_accepted: int) -> bool:
        """After step `step`, where the row drafted `num_drafted` tokens (0: no draft, nothing learnt)
        and the target accepted `num_accepted` of them. True: the row pauses from now."""
        if num_drafted == 0:
            return False
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

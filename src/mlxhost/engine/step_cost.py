"""What an engine step costs, as plain data: the scheduler sizes a prompt's prefill chunk by it so that the
requests already decoding wait no longer than `max_decode_gap_s` for their next token. Imports no tensor library.

The engine core feeds it each step's measured seconds (`observe`); the scheduler asks it how many prompt
tokens fit beside the decode rows (`prefill_budget`). A step is modeled as one decode forward plus a cost per
prefilled token. Per-token cost falls as chunks grow (a forward has a fixed part), so a model learned on big
chunks is optimistic for small ones; each step re-measures the chunk it sized, and the chunk settles where
the modeled cost meets the target.
"""

from __future__ import annotations

from dataclasses import dataclass

# The share of the target the plan fills: a prompt's later chunks attend over more context, so each costs a
# little more per token than the one measured before it.
HEADROOM = 0.9
# Weight of the newest measurement: a prompt's cost per token drifts as its context grows, and a step whose
# rows changed (a request joined or left) must move the estimate within a few steps.
SMOOTHING = 0.5


@dataclass
class StepCostModel:
    max_decode_gap_s: float  # the target; 0: no bound (whole chunks beside the decode rows)
    # Seconds per prompt token of prefill and per decode forward (all rows), as measured lately; None: not yet.
    prefill_s_per_token: float | None = None
    decode_step_s: float | None = None
    # The least a prompt gets per step, so it still advances when the decode forward alone fills the target.
    min_prefill_tokens: int = 16

    def observe(self, num_prefill_tokens: int, num_decode_rows: int, seconds: float) -> None:
        """One step's cost: `seconds` for a forward over `num_decode_rows` decoding rows (if any) and
        `num_prefill_tokens` prompt tokens."""
        if num_prefill_tokens <= 0:
            if num_decode_rows > 0:
                self.decode_step_s = _mix(self.decode_step_s, seconds)
            return
        decode = (self.decode_step_s or 0.0) if num_decode_rows > 0 else 0.0
        self.prefill_s_per_token = _mix(self.prefill_s_per_token, max(seconds - decode, 0.0) / num_prefill_tokens)

    def prefill_budget(self, budget: int, has_decode_rows: bool) -> int:
        """Prompt tokens this step may prefill, at most `budget` (--prefill-step-size): all of it while no
        row decodes (a lone prompt prefills as fast as it can), else what keeps the step under the target."""
        if not has_decode_rows or not self.max_decode_gap_s:
            return budget
        if self.prefill_s_per_token is None:  # nothing measured yet (a lone prompt's chunks measure it first)
            return budget
        room = self.max_decode_gap_s * HEADROOM - (self.decode_step_s or 0.0)
        fits = int(room / self.prefill_s_per_token) if self.prefill_s_per_token > 0 else budget
        if room <= 0:
            # The decode forward alone fills the target (a large model on a CPU): no chunk meets it, and 16 tokens
            # a step would stretch a 4k-token prompt over ~250 steps. An eighth of a chunk keeps it moving.
            return min(max(self.min_prefill_tokens, budget // 8), budget)
        return max(min(self.min_prefill_tokens, budget), min(budget, fits))

    def modeled_step_s(self, num_prefill_tokens: int, has_decode_rows: bool) -> float:
        """What the model says a step of this shape costs."""
        decode = (self.decode_step_s or 0.0) if has_decode_rows else 0.0
        return decode + num_prefill_tokens * (self.prefill_s_per_token or 0.0)

    def as_dict(self) -> dict:
        return {"max_decode_gap_s": self.max_decode_gap_s, "prefill_s_per_token": self.prefill_s_per_token,
                "decode_step_s": self.decode_step_s}


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new

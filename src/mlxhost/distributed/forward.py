"""The model as every rank's runner calls it: each forward's input shape is logged, so the ranks can
check they issued the same collectives (same forwards, same shapes, same order) step by step; a
pipeline stage also evaluates each forward before the next is built.

Mismatched collectives do not fail loudly: NCCL waits forever for a peer's call that never comes, or
pairs two different calls. Comparing the forwards each rank ran (rank 0 gets the others' with their
step reports) names the step and the shapes where the ranks parted, instead of a silent stall.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


class RankForward:
    """Wraps the model: records `(shape of the input ids)` per forward into `calls`; `staged` (pipeline
    parallel) evaluates each forward's output and caches before returning.

    Why staged: a pipeline stage's forward holds a recv (from the stage before) or a send, then an
    all-gather. Two forwards left lazy together (a prompt's last two chunks, two prompts finishing in
    one step, a prefill next to the decode) have no data dependency between their transfers, so each
    rank may run them in another order and the ranks deadlock. Evaluating each forward's output whole
    (the LM head of a prefill chunk too: a few percent of the chunk's work) keeps every rank's
    transfers in call order. The price is the decode's CPU/device overlap (the forward is awaited)."""

    def __init__(self, model: Any, staged: bool) -> None:
        self.model = model
        self.staged = staged
        self.calls: list[tuple] = []

    def __call__(self, *args, cache=None, **kwargs):
        first = args[0] if args else kwargs.get("inputs")
        self.calls.append(tuple(getattr(first, "shape", ())))
        out = self.model(*args, cache=cache, **kwargs)
        if self.staged:
            mx.eval(out, [c.state for c in cache] if cache is not None else [])
        return out

    def take_calls(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls

    def __getattr__(self, name: str) -> Any:  # make_prompt_cache, layers, is_vlm, ...
        return getattr(self.model, name)


def wrap(model: Any, staged: bool) -> RankForward:
    """The model wrapped once (a runner rebuilt after a failure gets the wrapped model back)."""
    if isinstance(model, RankForward):
        return model
    return RankForward(model, staged)

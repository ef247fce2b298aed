"""Which batches speculation can rewind. Verification itself is sampling (`runner/sampling.py`:
`verify_batch`, `verify_group`) and the rewind is the batch's (`runner/batch.py`: `rewind`), so the runner's
one decode step does both for plain and speculative steps alike; proposers rewind their own caches with it."""

from __future__ import annotations

from typing import Any

from mlxhost.engine.runner.batch import rewind
from mlxhost.kv.kinds import KINDS

__all__ = ["can_rewind", "rewind"]


def can_rewind(cache: list[Any]) -> bool:
    """Whether every layer's kind can be rewound (kv/kinds): plain KV, a batch one or mlx-lm's `KVCache` of a
    lone row's lean path (its `trim` drops that row's tail). Sliding windows and recurrent state cannot: a
    rotating buffer overwrote what a rejected draft displaced, a state has no history."""
    return KINDS.can_rewind(cache)

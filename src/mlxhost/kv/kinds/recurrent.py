"""The recurrent kind, mlx-lm's `ArraysCache` (linear attention, SSM and conv state of Mamba, GatedDeltaNet
and other hybrids; the batch cache is the same class), and the block I/O of "state" layers.

The state has a fixed size whatever the sequence's length and keeps no history: it is stored as snapshots
at block boundaries, never per position, and a rejected draft cannot be rewound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from mlxhost.kv.kinds.registry import STATE, CacheKind, LayerSpec, state_cost

if TYPE_CHECKING:
    from mlxhost.kv.kinds.layout import KVLayout

Snapshot = list[list[mx.array]]  # per recurrent layer, its ArraysCache arrays (batch 1)


def _spec(c: Any) -> LayerSpec | None:
    return LayerSpec(STATE) if getattr(type(c), "merge", None) is not None else None


RECURRENT = CacheKind("recurrent", (ArraysCache,), subclasses=True, can_batch=True, can_store=True, spec=_spec,
                      cost=state_cost)


def read_state(cache: list[Any], layout: KVLayout, row: int | None = None) -> Snapshot:
    """Copies of the recurrent layers' arrays (of one batch row, or of a batch-1 cache)."""
    def take(a: mx.array) -> mx.array:
        return mx.contiguous(a if row is None else a[row : row + 1])

    return [[take(a) for a in cache[i].cache] for i in layout.state_layers]


def fill_state(cache: list[Any], layout: KVLayout, snapshot: Snapshot | None) -> None:
    """The recurrent layers of a fresh per-request cache, from the snapshot taken where it resumes."""
    for j, i in enumerate(layout.state_layers):
        cache[i].cache = list(snapshot[j])

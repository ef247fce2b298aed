"""The recurrent kind, mlx-lm's `ArraysCache` (linear attention, SSM and conv state of Mamba, GatedDeltaNet
and other hybrids; the batch cache is the same class). Its layers take the "state" role (kv/roles/state.py).

The state has a fixed size whatever the sequence's length and keeps no history: it is stored as snapshots
at block boundaries, never per position, and a rejected draft cannot be rewound.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import ArraysCache

from mlxhost.kv.kinds.registry import STATE, CacheKind, LayerSpec, state_cost


def _spec(c: Any) -> LayerSpec | None:
    return LayerSpec(STATE) if getattr(type(c), "merge", None) is not None else None


RECURRENT = CacheKind("recurrent", (ArraysCache,), subclasses=True, can_batch=True, can_store=True, spec=_spec,
                      cost=state_cost)

"""The sliding-window kind, mlx-lm's `RotatingKVCache` (`BatchRotatingKVCache` in the decode batch). Its
layers take the "swa" role in a block (kv/roles/swa.py).

A rotating cache that keeps its first tokens (`keep` > 0) cannot be rebuilt from blocks. Nor can a rejected
draft be rewound: the ring has overwritten what the draft displaced.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from mlxhost.kv.kinds.registry import SWA, CacheKind, LayerSpec


def _spec(c: Any) -> LayerSpec | None:
    if c.keep != 0 or c.keys is None or c.keys.shape[1] != c.values.shape[1]:
        return None
    return LayerSpec(SWA, (c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype), window=c.max_size)


SLIDING = CacheKind("sliding", (RotatingKVCache,), (BatchRotatingKVCache,), can_batch=True, can_store=True,
                    spec=_spec)

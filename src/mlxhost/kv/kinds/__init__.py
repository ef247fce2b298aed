"""Layer cache kinds: what the server may do with each (batch, pad, rewind, store, quantize, reserve) and
which role its layers take in a block (kv/roles/ reads and writes them). `KINDS` is the one registry;
registry.py says how it answers.

Adding a kind is one `CacheKind` in the list below (its classes, its answers, what a block holds of it);
every check the engine, the prefix cache and the memory probe make goes through `KINDS`.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import CacheList

from mlxhost.kv.kinds.plain import PLAIN
from mlxhost.kv.kinds.quantized import QUANTIZED
from mlxhost.kv.kinds.recurrent import RECURRENT
from mlxhost.kv.kinds.registry import CacheKind, KindRegistry
from mlxhost.kv.kinds.sliding import SLIDING


def _list_cost(c: Any) -> tuple[int, int]:
    costs = [KINDS.layer_cost(sub) for sub in c.caches]
    return sum(t for t, _ in costs), sum(s for _, s in costs)


# mlx-lm's CacheList: several caches in one layer (e.g. a model's attention beside its indexer). It
# batches (mlx-lm merges each part); the prefix cache and speculative decoding leave it alone.
CACHE_LIST = CacheKind("list", (CacheList,), subclasses=True, can_batch=True, cost=_list_cost)

KINDS = KindRegistry([PLAIN, QUANTIZED, SLIDING, RECURRENT, CACHE_LIST])

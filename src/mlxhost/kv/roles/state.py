"""The "state" role: recurrent layers (mlx-lm's `ArraysCache`), kept as snapshots at block boundaries.

The state has a fixed size whatever the sequence's length and keeps no history: it exists only where a
forward stopped, so the prefill stops at the prompt's deepest block boundary and copies it there, and a
decode row's is copied where its KV ends. On the SSD tier snapshots have their own files (the "states"
folder), one tensor per array: "s{layer}.{index}.{dtype}".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxhost.kv.kinds.registry import STATE
from mlxhost.kv.roles.base import CacheRole, Tensors, from_bytes

if TYPE_CHECKING:
    from mlxhost.kv.kinds.layout import KVLayout

Snapshot = list[list[mx.array]]  # per recurrent layer, its ArraysCache arrays (batch 1)


class StateRole(CacheRole):
    name = STATE
    per_block = False
    optional = True
    captures = True
    ssd_folder, ssd_stats = "states", "snapshots"

    def read_snapshot(self, cache: list[Any], layout: KVLayout, row: int | None = None) -> Snapshot:
        def take(a: mx.array) -> mx.array:
            return mx.contiguous(a if row is None else a[row : row + 1])

        return [[take(a) for a in cache[i].cache] for i in self.layers(layout)]

    def fill(self, cache: list[Any], layout: KVLayout, parts: list[Snapshot], num_tokens: int) -> None:
        (snapshot,) = parts
        for j, i in enumerate(self.layers(layout)):
            cache[i].cache = list(snapshot[j])

    def arrays(self, part: Snapshot | None) -> list[mx.array]:
        return [] if part is None else [a for arrays in part for a in arrays]

    def to_tensors(self, part: Snapshot) -> dict[str, mx.array]:
        return {f"s{j}.{k}.{str(a.dtype).rsplit('.', 1)[-1]}": a for j, arrays in enumerate(part)
                for k, a in enumerate(arrays)}

    def from_tensors(self, tensors: Tensors, layout: KVLayout, dtype: mx.Dtype) -> Snapshot:
        snapshot: Snapshot = [[] for _ in self.layers(layout)]
        try:
            for name, (raw, shape) in tensors.items():
                layer, index, dt = name[1:].split(".")
                layer, index = int(layer), int(index)
                if index != len(snapshot[layer]):
                    raise ValueError(f"tensor {name} out of order")
                snapshot[layer].append(from_bytes(raw, shape, getattr(mx, dt)))
        except (IndexError, AttributeError) as exc:  # a layer or a dtype this model has not
            raise ValueError(str(exc)) from None
        if any(not arrays for arrays in snapshot):
            raise ValueError("a layer's state is missing")
        return snapshot

    def ssd_share(self, layout: KVLayout, left: int) -> int:
        return left // 4  # a quarter of the cap


STATE_ROLE = StateRole()

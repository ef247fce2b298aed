"""Which layers of a model the prefix cache stores, and how (this module may touch MLX).

Each layer has a role in a block (kv/roles/): "kv" (plain attention, MLA and quantized KV: keys and values per
position), "swa" (a sliding window's keys and values per position while in the window), "state" (recurrent
state, snapshots at block boundaries). Each layer's kind says its role and shapes (`LayerSpec`); a model whose
caches some kind cannot store, or whose attention layers disagree on their shapes (one block array holds them
all), has no layout and no prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from mlxhost.kv.kinds import KINDS
from mlxhost.kv.kinds.quantized import quantized_widths
from mlxhost.kv.kinds.registry import KV, STATE, SWA
from mlxhost.kv.roles import ROLES, CacheRole


@dataclass(frozen=True)
class KVLayout:
    kinds: tuple[str, ...]  # per layer: its role's name (KV, SWA, STATE or a registered role's)
    key_width: int = 0  # last-axis width of the attention layers' keys (their values follow it)
    window: int = 0  # the sliding layers' window (their caches' max_size), 0 without any
    kv_bits: int = 0  # the "kv" layers' quantization (0: float KV)
    kv_group_size: int = 0

    def key_widths(self) -> tuple[int, ...]:
        """Last-axis width of the keys' part of a "kv" block array (one per array of the block)."""
        if not self.kv_bits:
            return (self.key_width,)
        return quantized_widths(self.key_width, self.kv_bits, self.kv_group_size)

    def layers_of(self, role: str) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.kinds) if k == role)

    @cached_property
    def roles(self) -> tuple[CacheRole, ...]:
        """The roles of this model's layers, in the registry's order."""
        return tuple(r for r in ROLES if r.name in self.kinds)

    @cached_property
    def snapshot_roles(self) -> tuple[CacheRole, ...]:
        return tuple(r for r in self.roles if not r.per_block)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return self.layers_of(KV)

    @property
    def swa_layers(self) -> tuple[int, ...]:
        return self.layers_of(SWA)

    @property
    def state_layers(self) -> tuple[int, ...]:
        return self.layers_of(STATE)


def read_layout(cache: list[Any]) -> KVLayout | None:
    """The layout of a request's caches after a one-token forward, or None when the prefix cache cannot
    store it."""
    specs = [KINDS.layer_spec(c) for c in cache]
    names = {r.name for r in ROLES}
    if any(s is None or s.role not in names for s in specs):
        return None
    shapes = {s.shape for s in specs if s.shape is not None}
    windows = {s.window for s in specs if s.role == SWA}
    quant = {s.quant for s in specs if s.quant is not None}
    if len(shapes) > 1 or len(windows) > 1 or len(quant) > 1:
        return None
    key_width = next(iter(shapes))[1] if shapes else 0
    bits, group_size = next(iter(quant), (0, 0))
    return KVLayout(tuple(s.role for s in specs), key_width, next(iter(windows), 0), bits, group_size)

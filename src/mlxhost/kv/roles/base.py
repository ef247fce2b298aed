"""What a cache role is: how a prefix-cache block holds the layers of one role, and everything done with them.

A model's layers each have a role (their kind's `LayerSpec.role`): "kv" (attention keys and values of every
position), "swa" (a sliding window's, while in the window) or "state" (recurrent state at block boundaries).
A `CacheRole` is one stateless object per role that owns its layers' share of a block: reading it out of a
request's cache (a decode-batch row or a prefill cache), what a prefill must copy while it still can, filling
a fresh cache from it, and its tensors on the SSD tier. The runner and the block store loop over
`KVLayout.roles`; adding a role is one module and one line in `roles/__init__.py`.

A part is whatever the role keeps of its layers for one block (or one boundary): its arrays, opaque to
the store, which only counts their bytes (`arrays`) and spills its tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

import mlx.core as mx
import numpy as np

from mlxhost.kv.kinds.registry import CacheKind, KindRegistry

if TYPE_CHECKING:
    from mlxhost.kv.kinds.layout import KVLayout

# A role's share of one block (or, for a snapshot role, of one boundary): its arrays, in its own shape.
Part = Any
# What the SSD tier hands back: tensor name -> (raw little-endian bytes, shape).
Tensors = dict[str, tuple[bytes, tuple[int, ...]]]


class CacheRole:
    """One role's block I/O. Per-block roles keep a part in every block (`per_block`); snapshot roles keep
    one at block boundaries, under the snapshot budget, pinned by the request that resumes from it."""

    name: str = ""  # the layers' tag in KVLayout.kinds (LayerSpec.role)
    kinds: tuple[CacheKind, ...] = ()  # cache kinds this role brings (registered with it)
    per_block: bool = True
    # A block may be stored without this role's part (a window it had left, a boundary with no snapshot):
    # admission asks whether a hit has it where it resumes.
    optional: bool = False
    # The prefill copies this role's data while its forwards run (`capture_blocks`, or a snapshot at the
    # boundary the prefill stops at): later it may be gone.
    captures: bool = False
    # Its own SSD folder, and the name its stats go by ("": its tensors stay inside the block file). A per-block
    # role with a folder leaves `ssd_mark` in the block file, which is then a miss without its folder's file.
    ssd_folder: str = ""
    ssd_stats: str = ""
    ssd_mark: str = ""

    def layers(self, layout: KVLayout) -> tuple[int, ...]:
        return layout.layers_of(self.name)

    def first_needed(self, layout: KVLayout, num_tokens: int) -> int:
        """The first position whose part a request resumed after `num_tokens` tokens reads (per-block roles)."""
        return 0

    # -- runner: out of a request's cache, into a fresh one ---------------------------------------
    def read_blocks(self, cache: list[Any], layout: KVLayout, row: int | None, pad: int, starts: Sequence[int],
                    block_size: int) -> list[Part | None]:
        """Per-block roles: own copies of the parts of the blocks at `starts` (None where the cache no longer
        holds one). `cache` is a decode batch (`row`, `pad` its left padding) or a batch-1 prefill cache
        (`row` None)."""
        raise NotImplementedError

    def capture_blocks(self, cache: list[Any], layout: KVLayout, start: int, stop: int, num_cached: int,
                       block_size: int) -> dict[int, Part]:
        """After a prefill forward over [start, stop) of a batch-1 cache: the parts, by block start, that the
        cache holds now but may not hold when the blocks are stored."""
        return {}

    def read_snapshot(self, cache: list[Any], layout: KVLayout, row: int | None = None) -> Part:
        """Snapshot roles: a copy of the layers' state where the cache ends (one batch row, or a batch-1 cache)."""
        raise NotImplementedError

    def fill(self, cache: list[Any], layout: KVLayout, parts: list[Part], num_tokens: int) -> None:
        """The role's layers of a fresh per-request cache, to resume after `num_tokens` tokens: from the parts of
        the blocks from `first_needed` on (per-block roles), or from the one snapshot there."""
        raise NotImplementedError

    # -- store: bytes and the SSD tier ------------------------------------------------------------
    def arrays(self, part: Part | None) -> list[mx.array]:
        return [] if part is None else [part]

    def to_tensors(self, part: Part) -> dict[str, mx.array]:
        raise NotImplementedError

    def from_tensors(self, tensors: Tensors, layout: KVLayout, dtype: mx.Dtype) -> Part | None:
        """The part a file holds; None when an optional part is not there. Raises KeyError, ValueError or
        TypeError for data that does not fit this layout (a miss)."""
        raise NotImplementedError

    def ssd_share(self, layout: KVLayout, left: int) -> int:
        """Bytes of the SSD cap its own folder takes, out of what the folders before it left."""
        return 0


def from_bytes(raw: bytes, shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
    # bfloat16 has no numpy dtype: arrays travel as raw bytes, the shape and (in the header) the dtype.
    return mx.array(np.frombuffer(raw, dtype=np.uint8)).view(dtype).reshape(shape)


def check_rows(a: mx.array | None, num_layers: int) -> None:
    if a is not None and (a.ndim != 4 or a.shape[0] != num_layers):
        raise ValueError(f"shape {a.shape} does not hold {num_layers} layers")


class RoleRegistry:
    """Cache roles by name, in the order of the SSD layout (the folders are carved from the disk cap in this
    order, a block file's tensors are written in it). Registering a role registers its kinds in `kinds`."""

    def __init__(self, roles: Iterable[CacheRole] = (), kinds: KindRegistry | None = None) -> None:
        self._roles: dict[str, CacheRole] = {}
        self._kinds = kinds
        for role in roles:
            self.register(role)

    def __iter__(self):
        return iter(self._roles.values())

    def __getitem__(self, name: str) -> CacheRole:
        return self._roles[name]

    def register(self, role: CacheRole) -> CacheRole:
        if role.name in self._roles:
            raise ValueError(f"cache role {role.name!r} already registered")
        if self._kinds is not None:
            for kind in role.kinds:
                self._kinds.register(kind)
        self._roles[role.name] = role
        return role

    def unregister(self, role: CacheRole) -> None:
        del self._roles[role.name]
        if self._kinds is not None:
            for kind in role.kinds:
                self._kinds.unregister(kind)

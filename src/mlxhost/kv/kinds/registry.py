"""The registry of layer cache kinds: one entry per kind says what the server may do with a layer's cache.

A model's prompt cache is a list of per-layer caches (mlx-lm's classes, or ours under --kv-bits). Whether
rows decode in one batch, prompts prefill together, a rejected draft can be rewound, the prefix cache and
SSD tier can keep a layer, --kv-bits can quantize it, or the decode batch can widen it up front is the
layer's kind's answer, asked here rather than through class checks spread over the engine. Adding a kind
is one `CacheKind` in `kinds/__init__.py`; a kind whose layers take a new role comes with that role (kv/roles/).

Kinds are matched by exact class (a model's own subclass of a known cache is not assumed to behave like
it), except where an entry says `subclasses`. A class no entry names answers no to everything, except that
it batches when it has mlx-lm's `merge`, as mlx-lm's own batch generator decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

# The roles' names (kv/roles/): how a prefix-cache block holds a layer. Attention KV per position, a sliding
# window's KV per position while it is in the window, or recurrent state as snapshots at block boundaries.
KV, SWA, STATE = "kv", "swa", "state"


@dataclass(frozen=True)
class LayerSpec:
    """What a block holds of one layer, read off its cache after a one-token forward."""

    role: str  # a registered role's name: KV, SWA, STATE, ...
    shape: tuple | None = None  # (kv_heads, key_width, value_width, dtype): one block array holds them all
    window: int = 0  # a sliding layer's window (its cache's max_size)
    quant: tuple[int, int] | None = None  # a KV layer's (bits, group_size); (0, 0) for float KV


def attention_cost(c: Any) -> tuple[int, int]:
    """(bytes per token, bytes per sequence) of a cache that keeps keys and values per position."""
    keys, values = getattr(c, "keys", None), getattr(c, "values", None)
    if keys is None:
        # A cache we cannot read per position: charge its whole size once per sequence rather than guess.
        return 0, c.nbytes
    # Quantized caches keep (packed, scales, biases) tuples; their buffers grow in steps, so divide by
    # the buffer's width, not by the one token written.
    parts = [*keys, *values] if isinstance(keys, (tuple, list)) else [keys, values]
    width = parts[0].shape[2]
    return sum(p.nbytes for p in parts) // width, 0


def state_cost(c: Any) -> tuple[int, int]:
    """A fixed-size state (linear attention, SSM, conv): paid once per running sequence."""
    return 0, c.nbytes


def _no_spec(c: Any) -> LayerSpec | None:
    return None


@dataclass(frozen=True)
class CacheKind:
    name: str
    classes: tuple[type, ...]  # a request's own cache (batch 1)
    batch_classes: tuple[type, ...] = ()  # the decode batch's version of it
    subclasses: bool = False  # subclasses of `classes` are this kind too
    can_batch: bool = False  # rows decode together in one batch cache (mlx-lm's `merge`)
    can_pad: bool = False  # prompts of several lengths prefill together in one padded forward
    can_rewind: bool = False  # a rejected draft's positions can be trimmed off the end
    can_store: bool = False  # the prefix cache and the SSD tier keep it (`spec` says how)
    can_quantize: bool = False  # --kv-bits swaps it for a quantized cache
    can_reserve: bool = False  # its batch version's buffer can be widened up front (kv_prealloc)
    # What a block holds of a layer of this kind; None when this instance cannot be stored (e.g. no
    # forward yet, or a rotating cache that keeps its first tokens).
    spec: Callable[[Any], LayerSpec | None] = _no_spec
    cost: Callable[[Any], tuple[int, int]] = attention_cost  # (bytes per token, bytes per sequence)


# The answer for a class no entry names.
OTHER = CacheKind("other", ())


class KindRegistry:
    """Cache kinds by class; answers for one layer's cache or for a model's whole prompt cache."""

    def __init__(self, kinds: Iterable[CacheKind] = ()) -> None:
        self._kinds: list[CacheKind] = []
        self._by_class: dict[type, CacheKind] = {}
        for kind in kinds:
            self.register(kind)

    def __iter__(self):
        return iter(self._kinds)

    def register(self, kind: CacheKind) -> CacheKind:
        taken = [cls.__name__ for cls in (*kind.classes, *kind.batch_classes) if cls in self._by_class]
        if taken or any(k.name == kind.name for k in self._kinds):
            raise ValueError(f"cache kind {kind.name!r}: {', '.join(taken) or 'the name'} already registered")
        self._kinds.append(kind)
        for cls in (*kind.classes, *kind.batch_classes):
            self._by_class[cls] = kind
        return kind

    def unregister(self, kind: CacheKind) -> None:
        self._kinds.remove(kind)
        self._by_class = {cls: k for cls, k in self._by_class.items() if k is not kind}

    def kind_of(self, c: Any) -> CacheKind:
        kind = self._by_class.get(type(c))
        if kind is not None:
            return kind
        return next((k for k in self._kinds if k.subclasses and isinstance(c, k.classes)), OTHER)

    # -- one layer ---------------------------------------------------------------------------------
    def batches(self, c: Any) -> bool:
        kind = self.kind_of(c)
        return kind.can_batch if kind is not OTHER else getattr(type(c), "merge", None) is not None

    def can_quantize(self, c: Any) -> bool:
        return self.kind_of(c).can_quantize

    def can_reserve(self, c: Any) -> bool:
        """A decode batch's buffer that kv_prealloc may widen: a batch class of a kind that allows it,
        holding keys already."""
        kind = self.kind_of(c)
        return kind.can_reserve and type(c) in kind.batch_classes and c.keys is not None

    def layer_spec(self, c: Any) -> LayerSpec | None:
        """What a prefix block holds of this request cache's layer, or None if it cannot be stored."""
        kind = self.kind_of(c)
        if not kind.can_store or type(c) in kind.batch_classes:
            return None
        return kind.spec(c)

    def layer_cost(self, c: Any) -> tuple[int, int]:
        return self.kind_of(c).cost(c)

    # -- a whole prompt cache (one entry per layer) -----------------------------------------------
    def can_batch(self, cache: Sequence[Any]) -> bool:
        return all(self.batches(c) for c in cache)

    def can_pad(self, cache: Sequence[Any]) -> bool:
        return bool(cache) and all(self.kind_of(c).can_pad for c in cache)

    def can_rewind(self, cache: Sequence[Any]) -> bool:
        return bool(cache) and all(self.kind_of(c).can_rewind for c in cache)

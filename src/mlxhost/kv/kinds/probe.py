"""What a model's caches cost and how the prefix cache could store them, read off one forward (touches MLX)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlxhost.kv.kinds import KINDS
from mlxhost.kv.kinds.layout import KVLayout, read_layout


@dataclass(frozen=True)
class KVProbe:
    """What one sequence's caches cost, read off a one-token forward through mlx-lm's own caches."""

    bytes_per_token: int  # keys and values of every layer whose cache grows with the sequence
    bytes_per_seq: int  # fixed-size state (linear attention, SSM, conv): paid once per running sequence
    dtype: Any  # what the model really writes, whatever its weights
    num_layers: int
    layer_kinds: tuple[str, ...]  # the cache class of each layer, for logs
    shareable: bool  # a layout the prefix cache can store (see kv/kinds/layout.py)
    logits_width: int = 0  # the model's output vocabulary (may exceed the tokenizer's)
    layout: KVLayout | None = None  # None: the prefix cache cannot store these caches
    why_unshareable: str = ""  # for the log, when not shareable

    @property
    def budget_bytes_per_token(self) -> int:
        # A pure recurrent model's memory does not grow per token; 1 byte keeps the token arithmetic
        # of admission and pressure defined (its sequences are bounded by max_num_seqs instead).
        return max(self.bytes_per_token, 1)


def probe_kv(model: Any, make_cache: Callable[[Any], list[Any]] = make_prompt_cache) -> KVProbe:
    """`make_cache` makes the caches requests really get (quantized layers under --kv-bits)."""
    cache = make_cache(model)
    logits = model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    costs = [KINDS.layer_cost(c) for c in cache]
    layout = read_layout(cache)
    kinds = tuple(type(c).__name__ for c in cache)
    why = "" if layout is not None else f"this model's caches are {sorted(set(kinds))}, a layout it cannot store"
    if layout is not None and getattr(model, "is_vlm", False) and layout.snapshot_roles:
        # No served vision family has recurrent layers, so snapshots have never run with images.
        layout, why = None, "a vision model with recurrent layers (snapshots never run with images)"
    # Quantized layers keep (data, scales, biases): the scales carry the model's float dtype.
    dtype = next((k.dtype if isinstance(k, mx.array) else k[1].dtype
                  for k in (getattr(c, "keys", None) for c in cache) if isinstance(k, (mx.array, tuple))), None)
    if dtype is None:  # recurrent-only models: the state's dtype
        dtype = next((a.dtype for c in cache for a in _arrays(c)), mx.float32)
    return KVProbe(
        bytes_per_token=sum(t for t, _ in costs),
        bytes_per_seq=sum(s for _, s in costs),
        dtype=dtype,
        num_layers=len(cache),
        layer_kinds=kinds,
        shareable=layout is not None,
        logits_width=logits.shape[-1],
        layout=layout,
        why_unshareable=why,
    )


def _arrays(c: Any) -> list:
    return [a for _, a in tree_flatten(c.state)]

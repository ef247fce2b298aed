"""The target's forward with its hidden states: what EAGLE-3 and MTP heads draft from.

mlx-lm's models return logits only. `HiddenTap` runs the same forward itself, layer by layer over the
model's own modules (`model.model.embed_tokens`, `.layers`, `.norm`, the LM head), for the families
whose `__call__` is exactly that loop, and keeps the outputs a head asks for: several layers' (EAGLE-3,
concatenated on the last axis) or the final normed hidden state (MTP). Nothing is copied: the kept
arrays are the forward's own intermediates. Only the speculative decoder calls it, and only while its
proposer wants hidden states; every other forward stays `model(...)`.

A family outside the list, a VLM, or a model whose tapped logits differ from its own (checked once,
bit for bit, at start-up) gets no tap: the proposer is unavailable and the reason is logged.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

# model_type -> families whose inner model's `__call__` is embed -> layers (one mask) -> norm, and whose
# outer one is the LM head or the tied embedding. A sliding-window Llama has two masks: refused below.
_STANDARD = frozenset({"llama", "qwen2", "qwen3", "mistral"})

FINAL = -1  # a layer id meaning the final normed hidden state (the LM head's input)


class HiddenTap:
    """`tap(inputs, cache) -> (logits, hidden)`: hidden [B, L, len(layer_ids) * D]."""

    def __init__(self, model: Any, layer_ids: tuple[int, ...]) -> None:
        self.model = model
        self.inner = model.model
        self.layer_ids = tuple(layer_ids)
        self._want: dict[int, list[int]] = {}  # layer -> where its output goes (a layer may be asked twice)
        for n, i in enumerate(self.layer_ids):
            if i != FINAL:
                self._want.setdefault(i, []).append(n)
        self.tied = bool(getattr(model.args, "tie_word_embeddings", False)) or not hasattr(model, "lm_head")

    def __call__(self, inputs: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        inner = self.inner
        h = inner.embed_tokens(inputs)
        mask = create_attention_mask(h, cache[0])
        kept: list[Any] = [None] * len(self.layer_ids)
        for i, (layer, c) in enumerate(zip(inner.layers, cache)):
            h = layer(h, mask, c)
            for n in self._want.get(i, ()):
                kept[n] = h
        out = inner.norm(h)
        for n, i in enumerate(self.layer_ids):
            if i == FINAL:
                kept[n] = out
        logits = inner.embed_tokens.as_linear(out) if self.tied else self.model.lm_head(out)
        if len(kept) <= 1:
            return logits, kept[0] if kept else None
        return logits, mx.concatenate(kept, axis=-1)


def why_no_tap(model: Any, layer_ids: tuple[int, ...]) -> str | None:
    """Why `HiddenTap` cannot serve this model (None: it can)."""
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    if getattr(model, "is_vlm", False):
        return "vision-language models take positions and embeddings the tap does not pass"
    if model_type not in _STANDARD:
        return f"model type {model_type!r} is not one whose layers the tap walks ({', '.join(sorted(_STANDARD))})"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        return "the model has no model.embed_tokens / layers / norm"
    if getattr(inner, "swa_idx", None) is not None:
        return "sliding-window layers take a second mask"
    n = len(inner.layers)
    bad = [i for i in layer_ids if i != FINAL and not 0 <= i < n]
    if bad:
        return f"the head asks for layers {bad} of a {n}-layer model"
    return _self_check(model, layer_ids)


def _self_check(model: Any, layer_ids: tuple[int, ...]) -> str | None:
    """The tapped forward must give the model's own logits exactly: speculative greedy output must be
    plain decoding's. Four tokens through fresh caches, both ways."""
    tokens = mx.array([[1, 2, 3, 4]])
    want = model(tokens, cache=make_prompt_cache(model))
    got, _ = HiddenTap(model, layer_ids)(tokens, make_prompt_cache(model))
    if not bool(mx.array_equal(want, got)):
        return "the tapped forward's logits differ from the model's own"
    return None

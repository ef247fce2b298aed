"""Prefill of prompts with images or videos: the engine-thread half of multimodal serving.

A chunk's input embeddings are the token embeddings with the vision features written over the
placeholder positions the chunk covers. Features come from the vision cache by content hash, so a
repeated image skips the tower; a prompt whose image lies inside prefix-cache blocks needs no
features at all (those positions are never recomputed). The tower runs whole in the step of the
first chunk that reaches the image: running streams wait for it (a large image on a slow machine can
take longer than a prefill chunk; splitting a tower across steps is not done).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxhost.config import MediaConfig
from mlxhost.engine.request import MediaItem, Request
from mlxhost.models.vlm import VisionFeatures, VisionLanguageModel
from mlxhost.multimodal.media import decode_image
from mlxhost.multimodal.vision_cache import VisionCacheEntry


@dataclass
class MediaPlan:
    """One prompt's multimodal prefill, kept on its row state while it prefills: positions [3, 1, L] of
    the whole prompt, and the features it uses, held so an eviction from the vision cache between two
    chunks cannot cost a re-encode."""

    positions: mx.array
    features: dict[str, VisionFeatures] = field(default_factory=dict)


class MultimodalPrefill:
    def __init__(self, model: VisionLanguageModel, vision_cache: Any) -> None:
        self.model = model
        self.vision_cache = vision_cache  # VisionCache or None (off); engine thread only
        self.num_encoded = 0
        self.num_cache_hits = 0

    def start(self, request: Request) -> tuple[MediaPlan, int]:
        """Plans a request's prefill; returns the plan and its decode position delta."""
        positions, delta = self.model.rope_index(request.prompt_token_ids, request.media)
        return MediaPlan(positions), delta

    def forward(self, request: Request, plan: MediaPlan, start: int, end: int, cache: list[Any]) -> mx.array:
        """Runs prompt positions [start, end) through the language model; returns the logits."""
        ids = mx.array(request.prompt_token_ids[start:end])[None]
        embeds, visual_mask, deepstack = self._embed(request, plan, start, end, ids)
        positions = plan.positions[:, :, start:end]
        return self.model.forward(ids, cache, positions, embeds, visual_mask, deepstack)

    # -- embeddings --------------------------------------------------------------------------------
    def _embed(self, request: Request, plan: MediaPlan, start: int, end: int, ids: mx.array):
        text = self.model.embed_tokens(ids)[0]  # [L, H]
        pieces, deep_pieces, cursor = [], [], start
        mask = None
        for item in request.media:
            offset = 0  # feature rows of this item before the current span
            for span_start, span_len in item.spans:
                lo, hi = max(span_start, start), min(span_start + span_len, end)
                if lo < hi:
                    feats = self._get(plan, item)
                    if lo > cursor:
                        pieces.append(text[cursor - start : lo - start])
                    rows = slice(offset + lo - span_start, offset + hi - span_start)
                    pieces.append(feats.features[rows].astype(text.dtype))
                    if feats.deepstack:
                        deep_pieces.append([d[rows] for d in feats.deepstack])
                        if mask is None:
                            mask = [False] * (end - start)
                        mask[lo - start : hi - start] = [True] * (hi - lo)
                    cursor = hi
                offset += span_len
        if not pieces:
            return text[None], None, None
        if cursor < end:
            pieces.append(text[cursor - start :])
        embeds = mx.concatenate(pieces, axis=0)[None]
        if not deep_pieces:
            return embeds, None, None
        # One [rows in this chunk, H] per deepstack layer, rows in position order (what the model's
        # deepstack step expects next to the mask).
        deepstack = [mx.concatenate(layer, axis=0) for layer in zip(*deep_pieces)]
        return embeds, mx.array(mask)[None], deepstack

    def _get(self, plan: MediaPlan, item: MediaItem) -> VisionFeatures:
        held = plan.features
        feats = held.get(item.content_hash)
        if feats is not None:
            return feats
        entry = self.vision_cache.get(item.content_hash) if self.vision_cache is not None else None
        if entry is not None:
            feats = VisionFeatures(entry.arrays["features"], tuple(entry.arrays.get("deepstack", ())))
            self.num_cache_hits += 1
        else:
            pixels, grid = item.pixel_values, item.grid_thw
            if pixels is None:  # the HTTP side relied on a cached entry that is gone now
                pixels, grid = _preprocess(self.model, item)
            feats = self.model.encode(pixels, grid)
            if feats.features.shape[0] != item.num_tokens:
                raise ValueError(f"the vision tower gave {feats.features.shape[0]} features for "
                                 f"{item.num_tokens} placeholder tokens")
            mx.eval(feats.features, *feats.deepstack)
            self.num_encoded += 1
            if self.vision_cache is not None:
                arrays = {"features": feats.features, "deepstack": list(feats.deepstack)}
                self.vision_cache.put(item.content_hash, VisionCacheEntry(arrays, {"grid_thw": item.grid_thw}))
        held[item.content_hash] = feats
        return feats


def _preprocess(model: VisionLanguageModel, item: MediaItem):
    """Pixels of an image the HTTP side did not preprocess (it relied on the vision cache, which has
    dropped the features since): decoded again from the bytes it sent. Videos always carry pixels."""
    if item.image is not None:
        return model.preprocess_image(item.image)
    # These bytes passed the request's limits when first decoded; decoding them again needs none.
    return model.preprocess_image(decode_image(item.encoded, MediaConfig(max_image_pixels=1 << 62)))

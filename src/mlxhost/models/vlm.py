"""Vision-language models through mlx-vlm: detection, loading, and the calls the engine makes.

The engine drives the language model itself (its own batch caches, chunked prefill), so it needs
more than mlx-vlm's one-shot `generate`: the vision tower alone (features go to the vision cache),
the input embeddings of one prefill chunk, and positions it passes in explicitly. Qwen's language
models keep rope state on the module between calls (`_rope_deltas`); with many requests in one
batch that state belongs to none of them, so every call here passes `position_ids` and the state is
never read. Gemma 3 (`Gemma3Model`) differs in a few hooks: plain rope from the cache offsets,
features from its tower plus projector, sliding-window caches, and its own image markup.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Families whose language model takes 3-D multimodal rope positions and whose tower maps
# (pixel_values, grid_thw) to one feature row per placeholder token.
QWEN_VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
VLM_FAMILIES = QWEN_VL_FAMILIES + ("gemma3",)


def is_vlm_config(config: dict) -> bool:
    return "vision_config" in config and config.get("model_type") in VLM_FAMILIES


def read_config(source: str) -> dict | None:
    """config.json of a local folder, or of a hub id (one small download); None when there is none."""
    path = Path(source) / "config.json"
    if not Path(source).exists():
        try:
            from huggingface_hub import hf_hub_download  # lazy: huggingface_hub only when used

            path = Path(hf_hub_download(source, "config.json"))
        except Exception:  # offline, unknown id: mlx-lm's loader reports it properly
            return None
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


@dataclass(frozen=True)
class VisionFeatures:
    """The tower's output for one image or video, in placeholder order."""

    features: Any  # mx.array [num_tokens, hidden]
    deepstack: tuple = ()  # Qwen3-VL: one [num_tokens, hidden] per deepstack layer

    @property
    def nbytes(self) -> int:
        return self.features.nbytes + sum(d.nbytes for d in self.deepstack)


class VisionLanguageModel:
    """An mlx-vlm model seen the way the engine sees an mlx-lm one: `model(tokens, cache=...)` gives
    logits, plus `encode`, `embed` and `rope_index` for multimodal prefill."""

    is_vlm = True
    supports_video = True
    image_marker = "<|image_pad|>"  # what the chat template writes for one image

    def __init__(self, model: Any, processor: Any, config: dict) -> None:
        self.vlm = model
        self.lm = model.language_model
        self.processor = processor
        self.family = config["model_type"]
        self.image_token_id = int(config.get("image_token_id", config.get("image_token_index", -1)))
        self.video_token_id = int(config.get("video_token_id", config.get("video_token_index", -1)))

    # -- what mlx-lm's helpers (make_prompt_cache, the budget probes) look at ---------------------
    @property
    def layers(self):
        return self.lm.layers

    def parameters(self):
        return self.vlm.parameters()

    def make_cache(self) -> list:
        """mlx-lm's caches (what its batch caches merge and extend), one per language-model layer."""
        from mlx_lm.models.cache import KVCache  # lazy: mlx_lm only when used

        return [KVCache() for _ in self.layers]

    # -- text ------------------------------------------------------------------------------------
    def __call__(self, inputs, cache=None, positions=None):
        """Logits for token ids [B, L]. `positions` [B, L] (rope delta included) is required for a
        batch whose rows sit at different positions; a single sequence can take them from its cache."""
        import mlx.core as mx  # lazy: mlx only when used

        batch, length = inputs.shape
        if positions is None:
            offset = cache[0].offset if cache else 0
            positions = mx.broadcast_to(mx.arange(offset, offset + length)[None], (batch, length))
        return self.forward(inputs, cache, _mrope(positions))

    def forward(self, inputs, cache, position_ids, embeds=None, visual_mask=None, deepstack=None):
        """One language-model call; `position_ids` [3, B, L]."""
        kwargs = {}
        if deepstack is not None:
            kwargs = {"visual_pos_masks": visual_mask, "deepstack_visual_embeds": list(deepstack)}
        return self.lm(inputs, inputs_embeds=embeds, cache=cache, position_ids=position_ids, **kwargs).logits

    def embed_tokens(self, token_ids):
        return self.lm.model.embed_tokens(token_ids)

    # -- vision ----------------------------------------------------------------------------------
    def encode(self, pixel_values, grid_thw: tuple[int, int, int]) -> VisionFeatures:
        import mlx.core as mx  # lazy: mlx only when used

        tower = self.vlm.vision_tower
        pixels = mx.array(pixel_values).astype(tower.patch_embed.proj.weight.dtype)
        grid = mx.array([list(grid_thw)])
        if self.family == "qwen3_vl":
            features, deepstack = tower(pixels, grid)
            return VisionFeatures(features, tuple(deepstack))
        return VisionFeatures(tower(pixels, grid, output_hidden_states=False))

    def rope_index(self, prompt_ids: list[int], media) -> tuple[Any, int]:
        """Positions [3, 1, L] of a whole prompt and the delta that decode positions carry
        (position = tokens so far + delta), from the model's own `get_rope_index`."""
        import mlx.core as mx  # lazy: mlx only when used

        images = [list(m.grid_thw) for m in media if m.kind == "image"]
        videos = [list(m.grid_thw) for m in media if m.kind == "video"]
        positions, deltas = self.lm.get_rope_index(
            mx.array([prompt_ids]),
            mx.array(images) if images else None,
            mx.array(videos) if videos else None,
        )
        if positions.ndim == 2:  # text only: [B, L]
            positions = mx.broadcast_to(positions[None], (3, *positions.shape))
        return positions, int(mx.array(deltas).reshape(-1)[0].item())

    def preprocess_image(self, image) -> tuple[Any, tuple[int, int, int]]:
        """(pixel_values, grid_thw) of one decoded image, through the model's image processor."""
        out = self.processor.image_processor(images=[image])
        return _numpy(out["pixel_values"]), tuple(int(x) for x in _numpy(out["image_grid_thw"])[0])

    def preprocess_video(self, frames) -> tuple[Any, tuple[int, int, int]]:
        """(pixel_values, grid_thw) of sampled RGB frames, through the model's video processor."""
        import numpy as np  # lazy: numpy only when used

        out = self.processor.video_processor(videos=[np.stack([np.asarray(f) for f in frames])])
        return _numpy(out["pixel_values_videos"]), tuple(int(x) for x in _numpy(out["video_grid_thw"])[0])

    @property
    def merge_size(self) -> int:
        return int(self.processor.image_processor.merge_size)

    def expand_image(self, num_tokens: int) -> str:
        """The text one image marker becomes: one placeholder token per feature row."""
        return self.image_marker * num_tokens


class Gemma3Model(VisionLanguageModel):
    """Gemma 3: rope positions are the cache offsets (no multimodal rope, delta 0), so `positions`
    are not passed on; a fixed-size image gives mm_tokens_per_image features (tower, then the
    projector's pooling), reported as the grid (1, side, side) with merge size 1. mlx-vlm's own
    forward uses the plain causal mask over image tokens too, so nothing bidirectional here."""

    supports_video = False

    def __init__(self, model: Any, processor: Any, config: dict) -> None:
        super().__init__(model, processor, config)
        self.image_marker = processor.boi_token
        self._side = round(model.config.text_config.mm_tokens_per_image**0.5)

    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache, RotatingKVCache  # lazy: mlx_lm only when used

        # The layout of mlx-vlm's `make_cache`, in mlx-lm's classes: a global layer ends each pattern.
        text = self.lm.config
        pattern = text.sliding_window_pattern
        return [KVCache() if i % pattern == pattern - 1 else RotatingKVCache(max_size=text.sliding_window, keep=0)
                for i in range(text.num_hidden_layers)]

    def __call__(self, inputs, cache=None, positions=None):
        return self.lm(inputs, cache=cache).logits

    def forward(self, inputs, cache, position_ids, embeds=None, visual_mask=None, deepstack=None):
        return self.lm(inputs, inputs_embeds=embeds, cache=cache).logits

    def encode(self, pixel_values, grid_thw: tuple[int, int, int]) -> VisionFeatures:
        import mlx.core as mx  # lazy: mlx only when used

        embed = self.lm.model.embed_tokens
        # The token embeddings' dtype, as mlx-vlm casts the pixels (a quantized table: its scales').
        dtype = getattr(embed, "scales", embed.weight).dtype
        pixels = mx.array(pixel_values).transpose(0, 2, 3, 1).astype(dtype)  # NCHW -> NHWC
        hidden, _, _ = self.vlm.vision_tower(pixels, output_hidden_states=True)
        # Divided by sqrt(hidden_size) as mlx-vlm does: its language model scales every input
        # embedding up by that, and image features must come out unscaled.
        features = self.vlm.multi_modal_projector(hidden) / (self.vlm.config.hidden_size**0.5)
        return VisionFeatures(features[0])

    def rope_index(self, prompt_ids: list[int], media) -> tuple[Any, int]:
        import mlx.core as mx  # lazy: mlx only when used

        return _mrope(mx.arange(len(prompt_ids))[None]), 0

    def preprocess_image(self, image) -> tuple[Any, tuple[int, int, int]]:
        # Pan-and-scan crops would add images to the prompt; served images are always one crop.
        out = self.processor.image_processor(images=[image], do_pan_and_scan=False)
        return _numpy(out["pixel_values"]), (1, self._side, self._side)

    def preprocess_video(self, frames):
        raise ValueError("Gemma 3 takes no video")

    @property
    def merge_size(self) -> int:
        return 1

    def expand_image(self, num_tokens: int) -> str:
        # Gemma3Processor's full_image_sequence, for num_tokens soft tokens.
        tokenizer = self.processor.tokenizer
        return f"\n\n{tokenizer.boi_token}{tokenizer.image_token * num_tokens}{tokenizer.eoi_token}\n\n"


def _mrope(positions):
    import mlx.core as mx  # lazy: mlx only when used

    return mx.broadcast_to(positions[None], (3, *positions.shape))


def _numpy(x):
    import numpy as np  # lazy: numpy only when used

    return np.asarray(x)


def load_vlm(source: str, config: dict):
    """(VisionLanguageModel, tokenizer) through mlx-vlm's `load`; the tokenizer is mlx-lm's wrapper
    over the same folder, so detokenizing and stop tokens work as for text models."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer  # lazy: mlx_lm only when used

    from mlxhost.models.extras import require_vision  # cycle: models.extras imports this module

    require_vision(source)  # mlx-vlm is the optional `vision` extra
    from mlx_vlm import load
    from mlx_vlm.utils import get_model_path

    start = time.perf_counter()
    model, processor = load(source)
    path = get_model_path(source)
    eos = config.get("eos_token_id")
    tokenizer = load_tokenizer(Path(path), eos_token_ids=[eos] if isinstance(eos, int) else eos)
    log.info("loaded vision-language model %s (%s) in %.2f s", source, config["model_type"],
             time.perf_counter() - start)
    adapter = Gemma3Model if config["model_type"] == "gemma3" else VisionLanguageModel
    return adapter(model, processor, config), tokenizer

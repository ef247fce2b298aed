"""Offline builder of tiny random-weight vision-language model folders (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Gemma 3; Gemma's own parts live in testing/vlm_demo_gemma3.py).

The folders load with `mlx_vlm.load(path)` and no network: config.json written the way mlx-vlm 0.7.10
reads it, random weights saved from mlx-vlm's own Model class (so they load back exactly), the text
demo's byte-level BPE plus the Qwen vision tokens, a Qwen-style chat template and the image/video
processor settings. Used by tests as fixtures and by `mlxhost demo-model --shape qwen2.5-vl-tiny`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer

from mlxhost.testing import demo, vlm_demo_gemma3 as gemma3

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"

_ARCHITECTURES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}
_PROCESSOR_CLASSES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                      "qwen3_vl": "Qwen3VLProcessor"}
# OpenAI content-part types and the bare ones mlx-vlm's prompt_utils emits.
_IMAGE_PARTS = ("image", "image_url", "input_image")
_VIDEO_PARTS = ("video", "video_url", "input_video")

# ChatML with Qwen's vision markers: each image part becomes <|vision_start|><|image_pad|><|vision_end|>
# and the processor expands the single <|image_pad|> to one token per merged patch.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    f"{{%- if part['type'] in {list(_IMAGE_PARTS)} -%}}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    f"{{%- elif part['type'] in {list(_VIDEO_PARTS)} -%}}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class VlmDemoConfig:
    family: str = "qwen2_5_vl"
    # Text model: the same tiny shape as the text demo (testing/demo.py).
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    mrope_section: tuple = (4, 6, 6)  # sums to head_dim / 2
    tie_word_embeddings: bool = True
    vocab_size: int | None = None  # None: the tokenizer's size
    # Vision tower.
    vision_depth: int = 2
    vision_hidden_size: int = 64
    vision_num_heads: int = 4
    vision_intermediate_size: int = 128
    patch_size: int = 14
    fullatt_block_indexes: tuple = (1,)  # Qwen2.5-VL: the rest use window attention
    deepstack_visual_indexes: tuple = ()  # Qwen3-VL: vision blocks whose output feeds text layers 0, 1, ...
    num_position_embeddings: int = 2304  # Qwen3-VL: learned 48x48 position grid
    # Gemma 3: a fixed square input, average-pooled to mm_tokens_per_image features; its text model
    # alternates sliding_window_pattern - 1 sliding-window layers with one global layer.
    image_size: int = 112
    mm_tokens_per_image: int = 16
    sliding_window: int = 32
    sliding_window_pattern: int = 2
    # Processor (pixels are totals: height * width for images, frames * height * width for videos).
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 16384
    video_min_pixels: int = 4096
    video_max_pixels: int = 25_165_824
    image_mean: tuple = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple = (0.26862954, 0.26130258, 0.27577711)
    dtype: str = "float32"
    init_std: float = 0.1  # std 0.1 gives varied output (0.02 repeats one token)
    seed: int = 0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim / 2 = {self.head_dim // 2}")
        if self.family != "qwen3_vl" and self.hidden_size != self.num_attention_heads * self.head_dim:
            raise ValueError("Qwen2(.5)-VL derive head_dim from hidden_size / num_attention_heads")
        if self.vision_hidden_size % self.vision_num_heads or (self.vision_hidden_size // self.vision_num_heads) % 4:
            raise ValueError("vision head_dim must be an integer multiple of 4 (2-D rotary embedding)")
        if self.family == "qwen2_vl" and self.vision_intermediate_size % self.vision_hidden_size:
            raise ValueError("Qwen2-VL's vision MLP width is an integer mlp_ratio times its hidden size")
        if len(self.deepstack_visual_indexes) > self.num_hidden_layers:
            raise ValueError("each deepstack level feeds one text layer: too many deepstack_visual_indexes")
        side, per_side = self.image_size // self.patch_size, round(self.mm_tokens_per_image**0.5)
        if self.family == "gemma3" and (per_side**2 != self.mm_tokens_per_image or side % per_side):
            raise ValueError("Gemma 3 pools the patch grid to a square of mm_tokens_per_image: its side must "
                             "divide image_size // patch_size")

    @property
    def merge_size(self) -> int:
        return 2


_GEMMA3_TINY = dict(family="gemma3", image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))


_QWEN3_VL_TINY = dict(family="qwen3_vl", patch_size=16, mrope_section=(6, 5, 5), vision_depth=3,
                      deepstack_visual_indexes=(0, 1), fullatt_block_indexes=(), min_pixels=65536,
                      max_pixels=16_777_216, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))

# (family, shape) -> config. The big ones copy real checkpoints' dimensions for GPU benchmarks.
VLM_SHAPES = {
    ("qwen2_5_vl", "tiny"): VlmDemoConfig(),
    ("qwen2_vl", "tiny"): VlmDemoConfig(family="qwen2_vl", fullatt_block_indexes=()),
    ("qwen3_vl", "tiny"): VlmDemoConfig(**_QWEN3_VL_TINY),
    # A 32-token window: test prompts (about 40 tokens) wrap the sliding-window layers' caches.
    ("gemma3", "tiny"): VlmDemoConfig(**_GEMMA3_TINY),
    ("qwen2_5_vl", "3b"): VlmDemoConfig(
        hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
        intermediate_size=11008, max_position_embeddings=128000, mrope_section=(16, 24, 24), vocab_size=151936,
        vision_depth=32, vision_hidden_size=1280, vision_num_heads=16, vision_intermediate_size=3420,
        fullatt_block_indexes=(7, 15, 23, 31), dtype="bfloat16", init_std=0.02),
    ("qwen3_vl", "2b"): VlmDemoConfig(**{
        **_QWEN3_VL_TINY, "hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144, "max_position_embeddings": 262144,
        "mrope_section": (24, 20, 20), "vocab_size": 151936, "vision_depth": 24, "vision_hidden_size": 1024,
        "vision_num_heads": 16, "vision_intermediate_size": 4096, "deepstack_visual_indexes": (5, 11, 17),
        "dtype": "bfloat16", "init_std": 0.02}),
}

# `mlxhost demo-model --shape NAME` names.
CLI_SHAPES = {
    "qwen2-vl-tiny": ("qwen2_vl", "tiny"),
    "qwen2.5-vl-tiny": ("qwen2_5_vl", "tiny"),
    "qwen3-vl-tiny": ("qwen3_vl", "tiny"),
    "gemma3-tiny": ("gemma3", "tiny"),
    "qwen2.5-vl-3b": ("qwen2_5_vl", "3b"),
    "qwen3-vl-2b": ("qwen3_vl", "2b"),
}


# ---------------------------------------------------------------------------------------------------
# Tokenizer


def _build_tokenizer(out: pathlib.Path, config: VlmDemoConfig, extra_tokens: tuple = VISION_TOKENS,
                     chat_template: str = CHAT_TEMPLATE, overrides: dict | None = None) -> dict:
    """The text demo's tokenizer (same ids for the same text) plus `extra_tokens` (special) after its
    vocabulary; `overrides` go into tokenizer_config.json. Returns {token: id} for the special tokens."""
    demo.build_tokenizer(out)
    if config.vocab_size:
        # A benchmark-sized vocabulary: pad the text ids first, so the vision tokens come right after a
        # gapless vocabulary (the tokenizers library renumbers added tokens that sit after a gap).
        with open(out / "tokenizer.json", encoding="utf-8") as f:
            tokenizer_json = json.load(f)
        start, stop = demo._vocab_size(tokenizer_json), config.vocab_size - len(extra_tokens)
        if stop > start:
            demo._pad_vocab(out, tokenizer_json, start, stop)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_tokens])
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in demo.SPECIAL_TOKENS + tuple(extra_tokens)}
    vocab_size = max(tokenizer.get_vocab_size(), max(ids.values()) + 1)

    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    for token in extra_tokens:
        tokenizer_config["added_tokens_decoder"][str(ids[token])] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
    extra = tokenizer_config["additional_special_tokens"] + list(extra_tokens)
    tokenizer_config["additional_special_tokens"] = extra
    tokenizer_config.update(chat_template=chat_template, **(overrides or {}))
    demo._write_json(out / "tokenizer_config.json", tokenizer_config)
    special_tokens_map = json.loads((out / "special_tokens_map.json").read_text(encoding="utf-8"))
    special_tokens_map["additional_special_tokens"] = extra
    special_tokens_map.update({k: v for k, v in (overrides or {}).items() if k.endswith("_token")})
    demo._write_json(out / "special_tokens_map.json", special_tokens_map)
    return {"vocab_size": config.vocab_size or vocab_size, **ids}


# ---------------------------------------------------------------------------------------------------
# Configs


def _text_config(config: VlmDemoConfig, vocab_size: int) -> dict:
    if config.family == "qwen3_vl":
        rope_scaling = {"rope_type": "default", "mrope_section": list(config.mrope_section),
                        "mrope_interleaved": True}
    else:
        rope_scaling = {"type": "mrope", "rope_type": "default", "mrope_section": list(config.mrope_section)}
    return {
        **demo.text_shape(config),
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": config.family != "qwen3_vl",
        "attention_dropout": 0.0,
        "initializer_range": config.init_std,
        "vocab_size": vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "use_cache": True,
        "dtype": config.dtype,
    }


def _vision_config(config: VlmDemoConfig) -> dict:
    # model_type must name the family itself: mlx-vlm rejects transformers' "qwen2_5_vl_vision" etc.
    common = {"model_type": config.family, "depth": config.vision_depth, "num_heads": config.vision_num_heads,
              "in_channels": 3, "patch_size": config.patch_size, "spatial_patch_size": config.patch_size,
              "spatial_merge_size": config.merge_size, "temporal_patch_size": 2}
    if config.family == "qwen2_vl":
        # Qwen2-VL names the tower width embed_dim and its output width hidden_size.
        return {**common, "embed_dim": config.vision_hidden_size, "hidden_size": config.hidden_size,
                "mlp_ratio": config.vision_intermediate_size // config.vision_hidden_size, "hidden_act": "quick_gelu"}
    vision = {**common, "hidden_size": config.vision_hidden_size, "out_hidden_size": config.hidden_size,
              "intermediate_size": config.vision_intermediate_size}
    if config.family == "qwen2_5_vl":
        vision.update(hidden_act="silu", window_size=112, tokens_per_second=2,
                      fullatt_block_indexes=list(config.fullatt_block_indexes))
    else:
        vision.update(hidden_act="gelu_pytorch_tanh", num_position_embeddings=config.num_position_embeddings,
                      deepstack_visual_indexes=list(config.deepstack_visual_indexes))
    return vision


def make_hf_config(config: VlmDemoConfig, ids: dict) -> dict:
    """config.json for config; ids: {token: id} plus "vocab_size" (what the tokenizer step returns)."""
    text = _text_config(config, ids["vocab_size"])
    token_ids = {
        "image_token_id": ids[IMAGE_TOKEN],
        "video_token_id": ids[VIDEO_TOKEN],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_token_id": ids["<|vision_pad|>"],
        "bos_token_id": None,
        "eos_token_id": ids[demo.EOS_TOKEN],
        "pad_token_id": ids[demo.PAD_TOKEN],
    }
    hf = {"architectures": [_ARCHITECTURES[config.family]], "model_type": config.family, **token_ids,
          "text_config": {**text, "model_type": f"{config.family}_text", **token_ids},
          "vision_config": _vision_config(config),
          "tie_word_embeddings": config.tie_word_embeddings, "vocab_size": ids["vocab_size"],
          "dtype": config.dtype, "torch_dtype": config.dtype}
    if config.family != "qwen3_vl":
        # mlx-vlm's Qwen2(.5)-VL read the text settings from the top level only.
        hf.update(text)
    return hf


def _processor_files(config: VlmDemoConfig) -> dict:
    """File name -> JSON for the image and video processors (mlx-vlm's numpy ports read these)."""
    common = {"patch_size": config.patch_size, "temporal_patch_size": 2, "merge_size": config.merge_size,
              "image_mean": list(config.image_mean), "image_std": list(config.image_std),
              "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
              "do_resize": True}
    prefix = "Qwen3VL" if config.family == "qwen3_vl" else "Qwen2VL"
    processor_class = _PROCESSOR_CLASSES[config.family]
    image = {**common, "image_processor_type": f"{prefix}ImageProcessor", "processor_class": processor_class,
             "min_pixels": config.min_pixels, "max_pixels": config.max_pixels,
             "size": {"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels}}
    video = {**common, "video_processor_type": f"{prefix}VideoProcessor", "processor_class": processor_class,
             "fps": 2.0, "min_frames": 4, "max_frames": 768,
             "size": {"shortest_edge": config.video_min_pixels, "longest_edge": config.video_max_pixels}}
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video,
            # Present so the processor never asks the Hugging Face hub for it.
            "processor_config.json": {"processor_class": processor_class}}


# ---------------------------------------------------------------------------------------------------
# Weights


def make_vlm_model(hf_config: dict):
    """mlx-vlm's Model for a config.json dict, with mlx's default (lazy, never evaluated) initial weights."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs  # optional: the vision extra

    # The same steps as mlx_vlm.utils.load_model, minus the weights; from_dict edits its argument.
    params = copy.deepcopy(hf_config)
    arch, _ = get_model_and_args(params)
    model_config = arch.ModelConfig.from_dict(params)
    model_config = update_module_configs(model_config, arch, params, ["text", "vision"])
    return arch.Model(model_config)


def make_random_vlm(config: VlmDemoConfig, hf_config: dict):
    """mlx-vlm's Model for hf_config with seeded random weights (norm gains 1, norm biases 0)."""
    import mlx.core as mx  # lazy: mlx only when used
    from mlx.utils import tree_flatten, tree_unflatten  # lazy: mlx only when used

    model = make_vlm_model(hf_config)
    flat = tree_flatten(model.parameters())
    # One key per parameter, in the model's own stable order: a given seed always gives the same weights.
    keys = mx.random.split(mx.random.key(config.seed), len(flat))
    dtype = getattr(mx, config.dtype)
    new_params = []
    for i, (name, value) in enumerate(flat):
        is_norm = "norm" in name or ".ln_" in name
        if is_norm and name.endswith(".weight"):
            new_value = mx.ones(value.shape)  # random gains near 0 would flatten the activations
        elif is_norm and name.endswith(".bias"):
            new_value = mx.zeros(value.shape)
        else:
            new_value = config.init_std * mx.random.normal(value.shape, key=keys[i])
        new_value = new_value.astype(dtype)
        # One at a time, so a multi-GB benchmark shape never holds all its float32 temporaries at once.
        mx.eval(new_value)
        new_params.append((name, new_value))
    model.update(tree_unflatten(new_params))
    return model


# ---------------------------------------------------------------------------------------------------
# Folder


def vlm_config_for(family: str = "qwen2_5_vl", shape: str = "tiny", seed: int = 0,
                   dtype: str | None = None) -> VlmDemoConfig:
    """The VlmDemoConfig of a named shape; `shape` may also be a CLI name such as "qwen2.5-vl-3b"."""
    if shape in CLI_SHAPES:
        family, shape = CLI_SHAPES[shape]
    elif shape.startswith(f"{family}-"):
        shape = shape[len(family) + 1:]
    if (family, shape) not in VLM_SHAPES:
        raise ValueError(f"unknown VLM shape {family!r}/{shape!r}; known: {sorted(VLM_SHAPES)}")
    base = VLM_SHAPES[(family, shape)]
    return dataclasses.replace(base, seed=seed, dtype=dtype or base.dtype)


def build_vlm_folder(out_dir, family: str = "qwen2_5_vl", shape: str = "tiny", seed: int = 0,
                     dtype: str | None = None) -> pathlib.Path:
    """Build a random-weight VLM folder at out_dir (created if missing) that `mlx_vlm.load` reads
    offline; dtype None keeps the shape's own (float32 for "tiny", bfloat16 for the real-sized ones)."""
    return build_vlm_folder_from_config(out_dir, vlm_config_for(family, shape, seed, dtype))


def build_vlm_folder_from_config(out_dir, config: VlmDemoConfig) -> pathlib.Path:
    from mlx_vlm.utils import save_weights  # optional: the vision extra

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gemma = config.family == "gemma3"
    if gemma:
        ids = _build_tokenizer(out, config, gemma3.TOKENS, gemma3.CHAT_TEMPLATE, gemma3.TOKENIZER_OVERRIDES)
        hf_config, files = gemma3.make_hf_config(config, ids), gemma3.processor_files(config)
    else:
        ids = _build_tokenizer(out, config)
        hf_config, files = make_hf_config(config, ids), _processor_files(config)
    (out / "chat_template.jinja").write_text(gemma3.CHAT_TEMPLATE if gemma else CHAT_TEMPLATE, encoding="utf-8")
    model = make_random_vlm(config, hf_config)
    if gemma:  # mlx-vlm's Gemma 3 ties its LM head to the embeddings on load: save what will load
        model.language_model.lm_head.weight = model.language_model.model.embed_tokens.weight
    # Parameter names are already mlx-vlm's (what its sanitize() produces), so they load back as saved.
    save_weights(out, model)
    del model
    demo._write_json(out / "config.json", hf_config)
    for name, obj in files.items():
        demo._write_json(out / name, obj)
    eos_ids = [ids[demo.EOS_TOKEN], ids[demo.PAD_TOKEN]]  # like Qwen's: <|im_end|> and <|endoftext|>
    generation_config = gemma3.generation_config(ids) if gemma else {
        "bos_token_id": None, "eos_token_id": eos_ids, "pad_token_id": ids[demo.PAD_TOKEN], "do_sample": False}
    demo._write_json(out / "generation_config.json", generation_config)
    return out

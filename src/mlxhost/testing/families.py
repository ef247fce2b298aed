"""Tiny random-weight fixture folders, one per model family that mlx-lm 0.32 loads.

The engine, the caches and the memory budget meet very different layer stacks in practice: plain KV
attention, sliding windows (rotating caches), recurrent state (SSM / linear attention / short convolutions)
and MLA (keys and values of different widths). Each family here is small enough to build in about a
second on a CPU and to run through `mlx_lm.generate`, so tests can cover all of them.
The rope-scaled ones (llama3-rope, deepseek_v2/v3, ministral3) keep their scaling on purpose: mlx-lm builds
their rope frequency tables lazily on the loading thread's stream, a trap for servers that load on one
thread and run on another.
"""

from __future__ import annotations

import copy
import importlib
import json
import pathlib

from tokenizers import Tokenizer

from mlxhost.testing.demo import EOS_TOKEN, PAD_TOKEN, build_tokenizer

INIT_STD = 0.1  # std 0.1 gives varied output (std 0.02 repeats one token)
MAX_POSITION_EMBEDDINGS = 4096

# Shared by the attention families; each entry below overrides what its family needs.
_ATTENTION = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
}

# Llama 3.1's rope scaling: mlx-lm builds its frequency table lazily (Llama3RoPE._freqs).
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# DeepSeek's yarn rope (V2 and V3 alike): mlx-lm builds its frequency table lazily (YarnRoPE._freqs).
_DEEPSEEK_YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

# family -> config.json overrides. Names are fixture names; model_type is what mlx-lm dispatches on.
# tie_word_embeddings follows the family's real checkpoints where mlx-lm reads it; mlx-lm always ties lfm2
# and never ties gemma3_text (its lm_head is saved), gpt_oss, deepseek_v2/v3 and nemotron_h. Granite is
# untied on purpose: its embedding multiplier (12) makes a random tied model echo its input token forever.
FAMILIES: dict[str, dict] = {
    "llama": {**_ATTENTION, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "tie_word_embeddings": True},
    "llama3-rope": {**_ATTENTION, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
                    "tie_word_embeddings": True, "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE,
                    "max_position_embeddings": 131072},  # Llama 3.1's; transformers wants it > 8192
    "qwen3": {**_ATTENTION, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
              "tie_word_embeddings": True},
    "qwen3_moe": {**_ATTENTION, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                  "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 128,
                  "norm_topk_prob": True},
    "phi3": {**_ATTENTION, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
             "tie_word_embeddings": False, "num_key_value_heads": 4, "rms_norm_eps": 1e-5},
    # Pattern 2: layer 0 slides over 16 tokens, layer 1 is global; a short prompt plus 12 generated
    # tokens already wraps the rotating cache.
    "gemma3_text": {**_ATTENTION, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                    "tie_word_embeddings": False, "num_key_value_heads": 1, "query_pre_attn_scalar": 32,
                    "sliding_window": 16, "sliding_window_pattern": 2, "rope_local_base_freq": 10000.0,
                    "rope_theta": 1000000.0, "hidden_activation": "gelu_pytorch_tanh"},
    "gpt_oss": {**_ATTENTION, "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
                "tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
                "rms_norm_eps": 1e-5},
    # MLA: the cache holds the compressed latent (kv_lora_rank wide) as keys and the rope part as values.
    "deepseek_v2": {**_ATTENTION, "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
                    "tie_word_embeddings": False, "num_key_value_heads": 4, "moe_intermediate_size": 64,
                    "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "topk_method": "greedy", "first_k_dense_replace": 1, "kv_lora_rank": 32,
                    "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
                    "rope_scaling": _DEEPSEEK_YARN},
    "deepseek_v3": {**_ATTENTION, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                    "tie_word_embeddings": False, "num_key_value_heads": 4, "moe_intermediate_size": 64,
                    "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                    "topk_group": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
                    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                    "v_head_dim": 16, "rope_scaling": _DEEPSEEK_YARN},
    # Ministral 3 keeps its rope settings (yarn + Llama-4 attention scaling) under rope_parameters;
    # factor = max_position_embeddings / original, as transformers checks.
    "ministral3": {**_ATTENTION, "model_type": "ministral3", "architectures": ["Ministral3ForCausalLM"],
                   "tie_word_embeddings": True,
                   "rope_parameters": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                       "original_max_position_embeddings": 256, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                       "llama_4_scaling_beta": 0.1}},
    # full_attention_interval 2: layer 0 is a gated delta net (linear attention), layer 1 full attention.
    "qwen3_next": {**_ATTENTION, "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                   "tie_word_embeddings": False, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                   "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                   "shared_expert_intermediate_size": 128, "mlp_only_layers": [], "moe_intermediate_size": 64,
                   "norm_topk_prob": True, "partial_rotary_factor": 0.25, "full_attention_interval": 2},
    # mlx-lm reads a flat text config as Qwen3.5's text_config (qwen3_5.ModelArgs.from_dict).
    "qwen3_5": {**_ATTENTION, "model_type": "qwen3_5", "architectures": ["Qwen3_5ForCausalLM"],
                "tie_word_embeddings": False, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                "full_attention_interval": 2,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                    "partial_rotary_factor": 0.25}},
    # One block of each kind: Mamba-2 mixer, attention, MLP.
    "nemotron_h": {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
                   "tie_word_embeddings": False, "hidden_size": 64, "intermediate_size": 128,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False,
                   "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 16,
                   "conv_kernel": 4, "n_groups": 2, "mlp_bias": False, "layer_norm_epsilon": 1e-5,
                   "use_bias": False, "use_conv_bias": True, "hybrid_override_pattern": ["M", "*", "-"],
                   "mlp_hidden_act": "relu2"},
    "lfm2": {"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"], "tie_word_embeddings": True,
             "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 128,
             "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
             "rope_theta": 1000000.0, "layer_types": ["conv", "full_attention"]},
    # transformers checks mamba_n_heads * mamba_d_head == mamba_expand (2) * hidden_size.
    "granitemoehybrid": {"model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"],
                         "tie_word_embeddings": False, "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "attention_bias": False, "embedding_multiplier": 12.0, "attention_multiplier": 0.0625,
                         "logits_scaling": 4.0, "residual_multiplier": 0.25, "layer_types": ["mamba", "attention"],
                         "rms_norm_eps": 1e-5, "num_local_experts": 4, "num_experts_per_tok": 2,
                         "shared_intermediate_size": 64, "mamba_n_heads": 4, "mamba_d_head": 32,
                         "mamba_proj_bias": False, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1,
                         "mamba_conv_bias": True, "rope_theta": 10000.0},
    "mamba2": {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "tie_word_embeddings": True,
               "hidden_size": 64, "num_heads": 4, "head_dim": 32, "intermediate_size": 128, "state_size": 16,
               "num_hidden_layers": 2, "layer_norm_epsilon": 1e-5, "conv_kernel": 4, "n_groups": 1,
               "use_bias": False, "use_conv_bias": True, "time_step_limit": [0.001, 100.0],
               "time_step_rank": "auto"},
}

# Real models' dimensions over a family's fixture, in bfloat16, for GPU benchmarks (`bench prefix --shape`):
# name -> (family, overrides). The vocabulary stays the fixture tokenizer's (only the embedding and the LM
# head shrink), so a build takes seconds on a GPU and writes ~7 GB; far too big for the CPU tests.
FAMILY_SHAPES: dict[str, tuple[str, dict]] = {
    # Gemma 3 4B's text model: 29 sliding layers (window 1024) and 5 global ones (every 6th), linear rope
    # scaling on the global layers.
    "gemma3-4b": ("gemma3_text", {"hidden_size": 2560, "num_hidden_layers": 34, "num_attention_heads": 8,
                                  "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 10240,
                                  "query_pre_attn_scalar": 256, "sliding_window": 1024,
                                  "sliding_window_pattern": 6, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                  "max_position_embeddings": 131072, "dtype": "bfloat16"}),
    # Gemma 3 12B's text model: 40 sliding layers (window 1024) and 8 global ones. A size where the 4k
    # prefill, not per-forward overhead, is what a prefix hit saves (the 4B's hit is mostly kernel launches).
    "gemma3-12b": ("gemma3_text", {"hidden_size": 3840, "num_hidden_layers": 48, "num_attention_heads": 16,
                                   "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 15360,
                                   "query_pre_attn_scalar": 256, "sliding_window": 1024,
                                   "sliding_window_pattern": 6, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                   "max_position_embeddings": 131072, "dtype": "bfloat16"}),
    # Qwen3.5 4B's text model: 24 gated-delta (linear attention) layers, every 4th of 32 full attention.
    "qwen3.5-4b": ("qwen3_5", {"hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 16,
                               "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216,
                               "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                               "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                               "full_attention_interval": 4, "max_position_embeddings": 262144,
                               "dtype": "bfloat16"}),
}

# What mlx_lm.models.cache.make_prompt_cache gives each family: "kv" (KVCache only), "sliding" (some
# RotatingKVCache), "hybrid" (some ArraysCache: recurrent state), "mla" (KVCache whose keys and values
# differ in width).
FAMILY_CACHE_KIND: dict[str, str] = {
    "llama": "kv", "llama3-rope": "kv", "qwen3": "kv", "qwen3_moe": "kv", "phi3": "kv", "ministral3": "kv",
    "gemma3_text": "sliding", "gpt_oss": "sliding",
    "deepseek_v2": "mla", "deepseek_v3": "mla",
    "qwen3_next": "hybrid", "qwen3_5": "hybrid", "nemotron_h": "hybrid", "lfm2": "hybrid",
    "granitemoehybrid": "hybrid", "mamba2": "hybrid",
}

# 1-D parameters whose constructor values (constants, not random) are already sensible besides norm gains:
# SSM skips and step biases, attention sinks, router correction biases.
_KEEP_NAMES = ("D", "dt_bias", "sinks", "e_score_correction_bias")


def cache_kind(prompt_cache) -> str:
    """Classify a prompt cache from make_prompt_cache; MLA needs it filled by one forward first."""
    from mlxhost.kv.kinds import KINDS  # lazy: pulls in mlx_lm

    kinds = {KINDS.kind_of(c).name for c in prompt_cache}
    if "recurrent" in kinds:
        return "hybrid"
    if "sliding" in kinds:
        return "sliding"
    filled = [c for c in prompt_cache if getattr(c, "keys", None) is not None]
    if any(c.keys.shape[-1] != c.values.shape[-1] for c in filled):
        return "mla"
    return "kv"


def _require_family(family: str) -> None:
    if family not in FAMILIES and family not in FAMILY_SHAPES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join([*FAMILIES, *FAMILY_SHAPES])}")


def family_config(family: str, vocab_size: int, eos_token_id: int, pad_token_id: int,
                  overrides: dict | None = None) -> dict:
    """The full config.json of a family's fixture or of a FAMILY_SHAPES shape, `overrides` on top."""
    _require_family(family)
    base, shape = FAMILY_SHAPES.get(family, (family, {}))
    config = copy.deepcopy({**FAMILIES[base], **shape, **(overrides or {})})
    config.setdefault("max_position_embeddings", MAX_POSITION_EMBEDDINGS)
    dtype = config.pop("dtype", "float32")
    config.update({
        "vocab_size": vocab_size,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "initializer_range": INIT_STD,
        "use_cache": True,
        # Both names: transformers 5 reads "dtype", mlx-lm's converter reads "torch_dtype".
        "dtype": dtype,
        "torch_dtype": dtype,
    })
    return config


def make_model(config: dict):
    """mlx-lm's model of a config, its parameters still lazy (nothing is computed before an eval)."""
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return arch.Model(arch.ModelArgs.from_dict(config))


def _random_model(config: dict, seed: int):
    import mlx.core as mx  # lazy: mlx only when used
    from mlx.utils import tree_flatten, tree_unflatten  # lazy: mlx only when used

    model = make_model(config)
    dtype = getattr(mx, config.get("dtype", "float32"))
    params = tree_flatten(model.parameters())
    # One key per parameter, in the model's own (stable) order, so a given seed always gives the same weights.
    keys = mx.random.split(mx.random.key(seed), len(params))
    new_params = []
    for i, (name, value) in enumerate(params):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            # SSM / gated-delta decay rates A in [1, 16) as mlx-lm's own init draws them, but from our key
            # (qwen3_next's constructor draws them from the global generator).
            new_value = mx.log(mx.random.uniform(1.0, 16.0, value.shape, key=keys[i])).astype(dtype)
        elif leaf in _KEEP_NAMES or (value.ndim == 1 and leaf == "weight"):
            # Norm gains stay at mlx-lm's init of ones (Gemma's (1 + w) norms thus scale by 2, harmless):
            # random gains near 0 would flatten the activations. Step biases, skips, sinks and router
            # corrections keep their constant init.
            new_value = value.astype(dtype)
        else:
            # Drawn in the target dtype: a 4B model never holds a float32 copy of its weights.
            new_value = INIT_STD * mx.random.normal(value.shape, dtype=dtype, key=keys[i])
        new_params.append((name, new_value))
    model.update(tree_unflatten(new_params))
    mx.eval(model.parameters())
    return model


def build_family_folder(out_dir, family: str, seed: int = 0, overrides: dict | None = None) -> pathlib.Path:
    """Write a random-weight model folder of `family` (a FAMILIES or FAMILY_SHAPES key, `overrides` on its
    config) at out_dir and return its path."""
    from mlx_lm.utils import save_config, save_model  # lazy: mlx_lm only when used

    _require_family(family)  # before writing anything
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos_token_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_token_id = tokenizer.token_to_id(PAD_TOKEN)
    config = family_config(family, tokenizer.get_vocab_size(), eos_token_id, pad_token_id, overrides)
    model = _random_model(config, seed)
    save_model(out, model)
    save_config(config, config_path=out / "config.json")
    generation_config = {"bos_token_id": None, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
                         "do_sample": False}
    with open(out / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump(generation_config, f, indent=2)
        f.write("\n")
    return out

"""GGUF architectures -> Hugging Face configs and tensor names (the layout mlx-lm loads).

llama.cpp's converter changes some tensors on the way in; each change is undone here: Q/K rows of
llama models are permuted for its interleaved rotary embedding (`unpermute_rows`), and Gemma's norm
weights are stored with the +1 its RMSNorm adds (`GEMMA_NORM_SHIFT`).
"""

from __future__ import annotations

import logging
import re

import numpy as np

from mlxhost.models.gguf.reader import GGUFError, GGUFHeader

log = logging.getLogger(__name__)

# GGUF architecture -> (mlx-lm model_type, Hugging Face architectures entry)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
# Architectures whose Q/K rows llama.cpp's converter permutes (the others use NeoX-style rotary).
PERMUTED_QK = {"llama"}
GEMMA_NORM_SHIFT = 1.0

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3 has four norms per layer; llama.cpp names the one before the MLP ffn_norm.
_GEMMA3_LAYER = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
# Tensors that carry rotary settings; they become config entries, not weights.
ROPE_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")
_NAME = re.compile(r"^(?:blk\.(?P<layer>\d+)\.)?(?P<base>[a-z0-9_]+)\.(?P<kind>weight|bias|scales|biases)$")


def check_architecture(header: GGUFHeader) -> str:
    arch = header.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{header.path}: GGUF architecture {arch or '(none)'!r} is not supported; "
                        f"supported: {', '.join(ARCHITECTURES)}")
    return arch


def hf_name(arch: str, name: str, has_gate: bool = True) -> str | None:
    """The Hugging Face name of a GGUF tensor (also its `.scales` / `.biases` from mx.load); None for
    the rotary tensors that go into the config."""
    m = _NAME.match(name)
    if m is None:
        raise GGUFError(f"tensor {name!r} is not a {arch} tensor this converter knows")
    base, kind, layer = m["base"], m["kind"], m["layer"]
    if layer is None:
        if base in ROPE_TENSORS:
            return None
        if base not in _TOP:
            raise GGUFError(f"tensor {name!r} is not a {arch} tensor this converter knows")
        return f"{_TOP[base]}.{kind}"
    table = {**_LAYER, **_GEMMA3_LAYER} if arch == "gemma3" else _LAYER
    if base not in table:
        raise GGUFError(f"tensor {name!r} is not a {arch} tensor this converter knows")
    target = table[base]
    if base == "ffn_up" and not has_gate:  # Phi-3 keeps gate and up in one fused matrix
        target = "mlp.gate_up_proj"
    return f"model.layers.{layer}.{target}.{kind}"


def unpermute_rows(rows, num_heads: int):
    """Undoes llama.cpp's Q/K row permutation (rows reordered per head from halves to interleaved
    pairs). It moves whole rows, so quantized weights, scales and biases take it unchanged."""
    shape = rows.shape
    half = shape[0] // num_heads // 2
    return rows.reshape(num_heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def make_config(header: GGUFHeader, rope_tensors: dict[str, np.ndarray]) -> dict:
    """The config.json of the converted folder (mlx-lm reads it the Hugging Face way)."""
    arch = check_architecture(header)
    model_type, hf_arch = ARCHITECTURES[arch]
    get = header.arch_value
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    names = {t.name for t in header.tensors}
    embed = next(t for t in header.tensors if t.name == "token_embd.weight")
    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": int(embed.shape[0]),
        "tie_word_embeddings": "output.weight" not in names,
    }
    meta = header.metadata
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key.replace("padding", "pad")] = int(meta[f"tokenizer.ggml.{key}"])
    scaling = _rope_scaling(header, rope_tensors, config)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch == "llama":
        config.update(attention_bias=any(n.endswith("attn_q.bias") for n in names), mlp_bias=False)
    elif arch == "gemma3":
        config.update(sliding_window=int(get("attention.sliding_window", 512)),
                      sliding_window_pattern=6,  # fixed in Gemma 3 (llama.cpp hard-codes it too)
                      rope_local_base_freq=10000.0,
                      # Gemma 3 27B scales queries by hidden/heads, the others by the head size.
                      query_pre_attn_scalar=(hidden // heads if config["num_hidden_layers"] == 62
                                             else config["head_dim"]))
    elif arch == "phi3":
        rotary = int(get("rope.dimension_count", config["head_dim"]))
        config["partial_rotary_factor"] = rotary / config["head_dim"]
    return config


def _rope_scaling(header: GGUFHeader, rope_tensors: dict[str, np.ndarray], config: dict) -> dict | None:
    get = header.arch_value
    kind = get("rope.scaling.type")
    if "rope_factors_long" in rope_tensors:  # Phi-3 128k: LongRoPE factors as tensors
        original = int(get("rope.scaling.original_context_length", config["max_position_embeddings"]))
        return {"type": "longrope", "long_factor": rope_tensors["rope_factors_long"].tolist(),
                "short_factor": rope_tensors.get("rope_factors_short", rope_tensors["rope_factors_long"]).tolist(),
                "original_max_position_embeddings": original}
    if "rope_freqs" in rope_tensors:
        return _llama3_scaling(header, rope_tensors["rope_freqs"], config)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    if kind == "yarn":
        return {"type": "yarn", "factor": float(get("rope.scaling.factor")),
                "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}
    raise GGUFError(f"{header.path}: rope scaling {kind!r} is not supported")


def _llama3_scaling(header: GGUFHeader, freqs: np.ndarray, config: dict) -> dict:
    """Llama 3.1+ stores its rotary frequency divisors as a tensor, not the settings behind them. Every
    Llama 3 release uses low/high frequency factors 1 and 4 over an 8192-token original context, with a
    factor of the tensor's largest entry: rebuild that and check it reproduces the tensor."""
    factor = float(np.max(freqs))
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    dims = int(header.arch_value("rope.dimension_count", config["head_dim"]))
    inv = config["rope_theta"] ** (-np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelen = 2 * np.pi / inv
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    want = np.where(wavelen < high_wavelen, 1.0,
                    np.where(wavelen > low_wavelen, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    if want.shape != freqs.shape or not np.allclose(want, freqs, rtol=1e-3):
        raise GGUFError(f"{header.path}: its rope_freqs tensor is not Llama 3's rotary scaling; "
                        "this converter cannot express it")
    return scaling

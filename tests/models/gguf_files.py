"""Tiny GGUF files written the way llama.cpp's converter writes them, from random mlx-lm models.

`write_gguf` takes a model's Hugging Face-named weights, renames them to GGUF names, permutes the Q/K
rows of llama models like llama.cpp does, adds Gemma's +1 to norm weights, stores each matrix in the
requested type, and writes a byte-level (GPT-2 style) tokenizer with ChatML specials.
"""

from __future__ import annotations

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
_GEMMA3 = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
           "post_feedforward_layernorm": "post_ffw_norm"}


def byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values()) + ["Ġt", "he"] + SPECIALS


def gguf_name(hf: str, arch: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")  # model.layers.N.<module>.<kind>
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    table = {**_LAYER, **_GEMMA3} if arch == "gemma3" else _LAYER
    return f"blk.{layer}.{table[module]}.{kind}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch: str, weights: dict, hparams: dict, qtype: str = "F32", split_max_tensors: int = 0,
               drop: tuple[str, ...] = (), extra: dict | None = None, add_bos: bool = False) -> None:
    """`weights`: Hugging Face name -> float32 numpy. `hparams`: block_count, embedding_length,
    feed_forward_length, head_count, head_count_kv, (key_length, sliding_window, rope_theta). Matrices are stored as
    `qtype`, vectors as F32."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_block_count(hparams["block_count"])
    writer.add_context_length(hparams.get("context_length", 2048))
    writer.add_embedding_length(hparams["embedding_length"])
    writer.add_feed_forward_length(hparams["feed_forward_length"])
    writer.add_head_count(hparams["head_count"])
    writer.add_head_count_kv(hparams["head_count_kv"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(hparams.get("rope_theta", 10000.0))
    if "key_length" in hparams:
        writer.add_key_length(hparams["key_length"])
        writer.add_value_length(hparams["key_length"])
    if "sliding_window" in hparams:
        writer.add_sliding_window(hparams["sliding_window"])
    tokens = byte_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML)
    for hf, value in weights.items():
        if hf in drop:
            continue
        value = np.asarray(value, dtype=np.float32)
        if arch == "llama" and ".self_attn.q_proj." in hf:
            value = permute(value, hparams["head_count"])
        elif arch == "llama" and ".self_attn.k_proj." in hf:
            value = permute(value, hparams["head_count_kv"])
        if arch == "gemma3" and hf.endswith("norm.weight"):
            value = value + 1.0
        name = gguf_name(hf, arch)
        if value.ndim == 2 and qtype != "F32":
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, value)
    for name, value in (extra or {}).items():  # GGUF-named tensors as they are (e.g. rope_freqs.weight)
        writer.add_tensor(name, np.asarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def roundtrip(weights: dict, qtype: str) -> dict:
    """The float weights a reader of `qtype` sees (quantize then dequantize with the gguf package)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    return {k: (gguf.quants.dequantize(gguf.quants.quantize(v, kind), kind).reshape(v.shape)
                if v.ndim == 2 and qtype != "F32" else v) for k, v in weights.items()}

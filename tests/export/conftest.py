"""Tiny random Llama and Qwen3 checkpoints saved the Hugging Face way (transformers' save_pretrained,
float32) with the demo tokenizer, their Core ML exports, and reference logits from transformers and MLX.
Test modules that need torch and coremltools skip without them (`need("torch", "coremltools")` at their top)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlxhost.testing.needs import need

CONTEXT = 64  # prompt (8) + 20 extend steps fit; the ranged dims go up to it
PROMPT_LEN, EXTEND_STEPS = 8, 20
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rope_theta=10000.0,
             rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=True)


# Llama 3.x's rope: frequencies rescaled by wavelength (the rotary module precomputes them).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": SHAPE["rope_theta"], "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def build_hf_folder(out, arch: str, seed: int):
    """arch: llama, llama3 (llama3 rope scaling), qwen2 (q/k/v biases), qwen3 (q/k norms)."""
    need("torch", "coremltools")
    import torch
    import transformers
    from tokenizers import Tokenizer

    from mlxhost.testing.demo import build_tokenizer

    build_tokenizer(out)
    vocab_size = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    family = {"llama3": "Llama", "llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    extra = {"rope_parameters": LLAMA3_ROPE} if arch == "llama3" else {}
    torch.manual_seed(seed)
    # mlx-lm's Qwen2 derives head_dim from hidden_size / heads (16 here) rather than reading it.
    shape = {**SHAPE, "head_dim": 16} if arch == "qwen2" else SHAPE
    config_obj = getattr(transformers, f"{family}Config")(vocab_size=vocab_size, **shape, **extra)
    model = getattr(transformers, f"{family}ForCausalLM")(config_obj)
    if arch == "qwen2":
        with torch.no_grad():  # biases start at zero; random ones make the test see them
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(std=0.1)
    model.save_pretrained(out)
    # mlx-lm reads rope_theta (and rope_scaling) at the top level; transformers 5 nests them in rope_parameters.
    config = json.loads((out / "config.json").read_text())
    config["rope_theta"] = SHAPE["rope_theta"]
    if arch == "llama3":
        config["rope_scaling"] = LLAMA3_ROPE
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="session")
def hf_llama_dir(tmp_path_factory):
    return build_hf_folder(tmp_path_factory.mktemp("hf-llama"), "llama", seed=0)


@pytest.fixture(scope="session")
def hf_qwen3_dir(tmp_path_factory):
    return build_hf_folder(tmp_path_factory.mktemp("hf-qwen3"), "qwen3", seed=1)


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def hf_dir(request):
    return request.getfixturevalue(f"hf_{request.param}_dir")


@pytest.fixture(scope="session")
def int4_package(hf_dir, tmp_path_factory):
    """`mlxhost export coreml MODEL OUT --quantize int4 --block-size 32` of each fixture."""
    need("torch", "coremltools")
    from mlxhost.server.cli import main

    out = tmp_path_factory.mktemp("coreml") / "model.mlpackage"
    assert main(["export", "coreml", str(hf_dir), str(out), "--context", str(CONTEXT),
                 "--quantize", "int4", "--block-size", "32"]) == 0
    return out


@pytest.fixture(scope="session")
def token_ids(hf_llama_dir):
    """Prompt + extend tokens: real text through the demo tokenizer, cut to length."""
    from tokenizers import Tokenizer

    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 4
    ids = Tokenizer.from_file(str(hf_llama_dir / "tokenizer.json")).encode(text).ids
    assert len(ids) >= PROMPT_LEN + EXTEND_STEPS
    return ids[:PROMPT_LEN + EXTEND_STEPS]


def transformers_logits(folder, token_ids, prompt_len: int) -> np.ndarray:
    """transformers' own forward (its default attention, its DynamicCache): the prompt, then one token a step."""
    import inspect

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    # transformers 5 renamed past_key_values to cache; the cache object is updated in place either way.
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([list(token_ids)])
    with torch.no_grad():
        rows = [model(ids[:, :prompt_len], use_cache=True, **{arg: cache}).logits[0]]
        for i in range(prompt_len, ids.shape[1]):
            rows.append(model(ids[:, i:i + 1], use_cache=True, **{arg: cache}).logits[0])
    return torch.cat(rows).numpy()


def mlx_logits(folder, token_ids, prompt_len: int) -> np.ndarray:
    """The model as mlxhost serves it: mlxhost's loader (mlx-lm's model classes) and an mlx-lm prompt cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxhost.models.loader import load_model

    model = load_model(str(folder)).model
    cache = make_prompt_cache(model)
    ids = list(token_ids)
    rows = [model(mx.array([ids[:prompt_len]]), cache=cache)[0]]
    for i in range(prompt_len, len(ids)):
        rows.append(model(mx.array([[ids[i]]]), cache=cache)[0])
    out = mx.concatenate(rows).astype(mx.float32)
    mx.eval(out)
    return np.array(out)

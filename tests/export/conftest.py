"""Tiny random Llama and Qwen3 checkpoints saved the Hugging Face way (transformers' save_pretrained,
float32) with the demo tokenizer, and their Core ML exports. Everything skips without the coreml extra."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason='the Core ML export needs torch: pip install -e ".[coreml]"')
pytest.importorskip("coremltools", reason='the Core ML export needs coremltools: pip install -e ".[coreml]"')

CONTEXT = 64  # prompt (8) + 20 extend steps fit; the ranged dims go up to it
PROMPT_LEN, EXTEND_STEPS = 8, 20
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rope_theta=10000.0,
             rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=True)


def build_hf_folder(out, arch: str, seed: int):
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from mlxserve.models.demo import build_tokenizer

    build_tokenizer(out)
    vocab_size = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(vocab_size=vocab_size, **SHAPE))
    model.save_pretrained(out)
    # mlx-lm reads rope_theta at the top level; transformers 5 nests it in rope_parameters.
    config = json.loads((out / "config.json").read_text())
    config["rope_theta"] = SHAPE["rope_theta"]
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
def token_ids(hf_llama_dir):
    """Prompt + extend tokens: real text through the demo tokenizer, cut to length."""
    from tokenizers import Tokenizer

    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n" * 4
    ids = Tokenizer.from_file(str(hf_llama_dir / "tokenizer.json")).encode(text).ids
    assert len(ids) >= PROMPT_LEN + EXTEND_STEPS
    return ids[:PROMPT_LEN + EXTEND_STEPS]

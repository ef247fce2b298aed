import hashlib
import json

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlxhost.server.cli import main
from mlxhost.testing.families import (
    FAMILIES,
    FAMILY_CACHE_KIND,
    build_family_folder,
    cache_kind,
    family_config,
    make_model,
)

PROMPT = "def hello(name):\n    return"
NUM_TOKENS = 12
# Families whose config keeps a scaled rope: mlx-lm builds their frequency tables lazily at load time.
SCALED_ROPE_FAMILIES = ("llama3-rope", "deepseek_v2", "deepseek_v3", "ministral3")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_generates(family, tmp_path):
    path = build_family_folder(tmp_path / family, family)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == FAMILIES[family]["model_type"]

    model, tokenizer = mlx_lm.load(str(path))
    assert config["vocab_size"] == len(tokenizer.get_vocab())
    text = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=NUM_TOKENS)
    assert isinstance(text, str) and text

    prompt_cache = make_prompt_cache(model)
    responses = list(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=NUM_TOKENS,
                                            prompt_cache=prompt_cache))
    token_ids = [r.token for r in responses]
    assert len(token_ids) == NUM_TOKENS
    assert all(bool(mx.all(mx.isfinite(r.logprobs)).item()) for r in responses)
    # std 0.1 weights keep a random model from echoing one token (std 0.02 would).
    assert len(set(token_ids)) >= 2, token_ids
    assert cache_kind(prompt_cache) == FAMILY_CACHE_KIND[family]


@pytest.mark.parametrize("family", SCALED_ROPE_FAMILIES)
def test_scaled_rope_families_keep_lazy_frequency_tables(family, tmp_path):
    # The loading-thread stream bug needs mlx-lm's lazily built rope tables (Llama3RoPE / YarnRoPE._freqs).
    model, _ = mlx_lm.load(str(build_family_folder(tmp_path / family, family)))
    assert any(isinstance(getattr(module, "_freqs", None), mx.array) for _, module in model.named_modules())


def test_every_family_has_a_cache_kind():
    assert set(FAMILY_CACHE_KIND) == set(FAMILIES)
    assert set(FAMILY_CACHE_KIND.values()) == {"kv", "sliding", "hybrid", "mla"}


def test_build_is_deterministic_per_seed(tmp_path):
    def weights_digest(path):
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    first = weights_digest(build_family_folder(tmp_path / "a", "qwen3_next", seed=0))
    mx.random.seed(1234)  # the global generator must not matter
    again = weights_digest(build_family_folder(tmp_path / "b", "qwen3_next", seed=0))
    other = weights_digest(build_family_folder(tmp_path / "c", "qwen3_next", seed=1))
    assert first == again
    assert first != other


def test_unknown_family(tmp_path):
    with pytest.raises(ValueError, match="unknown family"):
        build_family_folder(tmp_path, "gpt2")


def test_cli_builds_a_family(tmp_path, capsys):
    out = tmp_path / "mamba2"
    assert main(["demo-model", str(out), "--shape", "mamba2"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "mamba2"
    mlx_lm.load(str(out))


def test_cli_family_takes_no_bits(tmp_path):
    with pytest.raises(SystemExit, match="no --bits"):
        main(["demo-model", str(tmp_path / "m"), "--shape", "lfm2", "--bits", "4"])


def _layer_caches(name):
    # The model stays lazy: its billions of parameters are never computed or allocated.
    model = make_model(family_config(name, vocab_size=1000, eos_token_id=1, pad_token_id=0))
    cache = make_prompt_cache(model)
    return sum(v.size for _, v in tree_flatten(model.parameters())), [type(c).__name__ for c in cache], cache


def test_gpu_shape_gemma3_4b_has_gemma_3_4b_layers():
    config = family_config("gemma3-4b", vocab_size=1000, eos_token_id=1, pad_token_id=0)
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    num_params, kinds, cache = _layer_caches("gemma3-4b")
    assert 3.0e9 < num_params < 3.5e9  # Gemma 3 4B less its 262k-token embedding
    assert kinds == (["RotatingKVCache"] * 5 + ["KVCache"]) * 5 + ["RotatingKVCache"] * 4
    assert {c.max_size for c in cache if hasattr(c, "max_size")} == {1024}


def test_gpu_shape_qwen3_5_4b_is_hybrid():
    num_params, kinds, _ = _layer_caches("qwen3.5-4b")
    assert 3.3e9 < num_params < 3.9e9
    assert kinds == (["ArraysCache"] * 3 + ["KVCache"]) * 8


def test_gpu_shape_builds_in_bfloat16(tmp_path):
    # The GPU shape's build path at fixture size: bfloat16 weights on disk, loadable and generating.
    small = {"hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 128, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 16}
    path = build_family_folder(tmp_path / "g", "gemma3-4b", overrides=small)
    weights = mx.load(str(path / "model.safetensors"))
    assert {v.dtype for v in weights.values()} == {mx.bfloat16}
    model, tokenizer = mlx_lm.load(str(path))
    responses = list(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=NUM_TOKENS))
    assert len(responses) == NUM_TOKENS and len({r.token for r in responses}) >= 2

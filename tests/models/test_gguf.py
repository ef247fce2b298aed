"""GGUF as a model source: tiny files written like llama.cpp writes them convert back to the model they
came from (logits), natively read types stay quantized, bad files are clear errors."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlxhost.models.gguf import GGUFConvertConfig, GGUFError, convert_gguf, find_gguf, gguf_folder, prepare_gguf
from mlxhost.models.gguf.reader import read_header
from tests.models.gguf_files import SPECIALS, byte_tokens, roundtrip, write_gguf

pytest.importorskip("gguf")

VOCAB = len(byte_tokens())
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 64, 4, 2, 16, 128, 2
HPARAMS = {"block_count": LAYERS, "embedding_length": HIDDEN, "feed_forward_length": INTER,
           "head_count": HEADS, "head_count_kv": KV_HEADS}
PROMPT = [5, 77, 120, 3, 200, 9, 41, 250]


def _args(arch: str) -> tuple[object, dict, dict]:
    """(mlx-lm module, ModelArgs fields, extra GGUF hparams) of a tiny model of each architecture."""
    from mlx_lm.models import gemma3_text, llama, phi3, qwen2, qwen3

    common = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=INTER, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6, vocab_size=VOCAB)
    if arch == "llama":
        return llama, dict(common, model_type="llama", head_dim=HEAD_DIM, tie_word_embeddings=False,
                           rope_theta=10000.0), {}
    if arch == "qwen2":
        return qwen2, dict(common, model_type="qwen2", rope_theta=10000.0, tie_word_embeddings=True), {}
    if arch == "qwen3":
        return qwen3, dict(common, model_type="qwen3", head_dim=HEAD_DIM, rope_theta=10000.0,
                           tie_word_embeddings=True, max_position_embeddings=2048), {"key_length": HEAD_DIM}
    if arch == "gemma3":
        # 6 layers: mlx-lm's Gemma 3 reads the cache of layer 6 (its first global one) for the mask.
        return gemma3_text, dict(common, model_type="gemma3_text", num_hidden_layers=6, head_dim=HEAD_DIM,
                                 rope_theta=10000.0, query_pre_attn_scalar=HEAD_DIM, sliding_window=4,
                                 sliding_window_pattern=6, rope_local_base_freq=10000.0), \
            {"key_length": HEAD_DIM, "sliding_window": 4, "block_count": 6}
    if arch == "phi3":
        return phi3, dict(common, model_type="phi3", rope_theta=10000.0), {}
    raise AssertionError(arch)


def _model(arch: str, seed: int = 0):
    module, fields, extra = _args(arch)
    model = module.Model(module.ModelArgs.from_dict(fields))
    rng = np.random.default_rng(seed)
    # std 0.1: random weights with the default init repeat one token; these give varied logits.
    weights = {k: (rng.standard_normal(v.shape) * 0.1).astype(np.float32) for k, v in tree_flatten(model.parameters())}
    for k in weights:
        if k.endswith("norm.weight"):
            weights[k] = 1.0 + 0.1 * rng.standard_normal(weights[k].shape).astype(np.float32)
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    return model, weights, {**HPARAMS, **extra}


def _logits(model, ids=PROMPT) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def _load(folder):
    import mlx_lm

    return mlx_lm.load(str(folder))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "phi3"])
def test_float_gguf_converts_back_to_its_model(tmp_path, arch):
    # llama's Q/K rows are permuted and Gemma's norms shifted in the file; both must be undone exactly.
    model, weights, hparams = _model(arch)
    write_gguf(tmp_path / "m.gguf", arch, weights, hparams)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", GGUFConvertConfig(dtype="float32"))
    converted, tokenizer = _load(out)
    np.testing.assert_allclose(_logits(converted), _logits(model), atol=1e-4)
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config
    assert config["tie_word_embeddings"] == ("lm_head.weight" not in weights)


def test_native_types_stay_quantized(tmp_path):
    model, weights, hparams = _model("llama")
    write_gguf(tmp_path / "m.gguf", "llama", weights, hparams, qtype="Q4_0")
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", GGUFConvertConfig(dtype="float32"))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    stored = mx.load(str(out / "model.safetensors"))
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert "model.layers.0.self_attn.q_proj.scales" in stored
    # The reference: the same model holding what a Q4_0 reader sees (quantize -> dequantize).
    reference, _, _ = _model("llama")
    reference.update(tree_unflatten([(k, mx.array(v)) for k, v in roundtrip(weights, "Q4_0").items()]))
    converted, _ = _load(out)
    np.testing.assert_allclose(_logits(converted), _logits(reference), atol=2e-3)


def test_other_types_are_dequantized_then_kept_float_or_quantized(tmp_path):
    model, weights, hparams = _model("qwen2")
    write_gguf(tmp_path / "m.gguf", "qwen2", weights, hparams, qtype="Q5_0")  # mx.load cannot read Q5_0
    reference, _, _ = _model("qwen2")
    reference.update(tree_unflatten([(k, mx.array(v)) for k, v in roundtrip(weights, "Q5_0").items()]))
    floats = convert_gguf(tmp_path / "m.gguf", tmp_path / "f32", GGUFConvertConfig(dtype="float32"))
    np.testing.assert_allclose(_logits(_load(floats)[0]), _logits(reference), atol=1e-4)
    eight = convert_gguf(tmp_path / "m.gguf", tmp_path / "q8", GGUFConvertConfig(dtype="float32", bits=8,
                                                                                  group_size=32))
    assert json.loads((eight / "config.json").read_text())["quantization"] == {"group_size": 32, "bits": 8}
    np.testing.assert_allclose(_logits(_load(eight)[0]), _logits(reference), atol=5e-2)


def test_tokenizer_and_chat_template_come_from_the_metadata(tmp_path):
    _, weights, hparams = _model("qwen2")
    write_gguf(tmp_path / "m.gguf", "qwen2", weights, hparams)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", GGUFConvertConfig(dtype="float32"))
    _, tokenizer = _load(out)
    ids = tokenizer.encode("the <|im_end|>", add_special_tokens=False)
    assert byte_tokens().index("<|im_end|>") in ids  # a control token stays whole
    assert tokenizer.decode(ids) == "the <|im_end|>"
    text = "héllo 世界 🎉"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token_ids == {byte_tokens().index("<|im_end|>")}
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] == SPECIALS[0]


def test_a_file_that_asks_for_bos_gets_it_from_the_tokenizer(tmp_path):
    _, weights, hparams = _model("qwen2")
    write_gguf(tmp_path / "m.gguf", "qwen2", weights, hparams, add_bos=True)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", GGUFConvertConfig(dtype="float32"))
    _, tokenizer = _load(out)
    bos = byte_tokens().index(SPECIALS[0])
    ids = tokenizer.encode("the")
    assert ids[0] == bos and ids.count(bos) == 1
    assert tokenizer.encode("the", add_special_tokens=False)[0] != bos


def test_split_files_and_folders(tmp_path):
    model, weights, hparams = _model("qwen3")
    folder = tmp_path / "split"
    folder.mkdir()
    write_gguf(folder / "m.gguf", "qwen3", weights, hparams, split_max_tensors=8)
    parts = sorted(p.name for p in folder.glob("*.gguf"))
    assert len(parts) > 2 and parts[0].endswith("-00001-of-%05d.gguf" % len(parts))
    assert find_gguf(folder) == folder / parts[0]
    assert len(read_header(folder / parts[1]).tensors) == len(weights) - 0  # any part names the whole set
    out = prepare_gguf(folder, GGUFConvertConfig(dtype="float32"), cache=tmp_path / "cache")
    np.testing.assert_allclose(_logits(_load(out)[0]), _logits(model), atol=1e-4)
    (folder / parts[-1]).unlink()
    with pytest.raises(GGUFError, match="missing"):
        read_header(folder / parts[0])


def test_prepare_converts_once_and_reconverts_a_changed_file(tmp_path):
    _, weights, hparams = _model("qwen2")
    src = tmp_path / "m.gguf"
    write_gguf(src, "qwen2", weights, hparams)
    cfg = GGUFConvertConfig(dtype="float32")
    first = prepare_gguf(src, cfg, cache=tmp_path / "cache")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert prepare_gguf(src, cfg, cache=tmp_path / "cache") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert prepare_gguf(src, GGUFConvertConfig(dtype="float16"), cache=tmp_path / "cache") != first
    write_gguf(src, "qwen2", {k: v * 0.5 for k, v in weights.items()}, hparams)
    assert prepare_gguf(src, cfg, cache=tmp_path / "cache") != first
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no temp folders left


def test_gguf_folder_leaves_other_sources_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXHOST_GGUF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MLXHOST_GGUF_DTYPE", "float32")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert gguf_folder(plain) == plain
    _, weights, hparams = _model("qwen2")
    write_gguf(tmp_path / "m.gguf", "qwen2", weights, hparams)
    assert gguf_folder(tmp_path / "m.gguf").parent == tmp_path / "cache"
    shutil.copy(tmp_path / "m.gguf", tmp_path / "second.gguf")
    with pytest.raises(GGUFError, match="several GGUF models"):
        find_gguf(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "magic", "header", "empty", "version"])
def test_corrupt_files_are_clear_errors(tmp_path, damage):
    _, weights, hparams = _model("qwen2")
    src = tmp_path / "m.gguf"
    write_gguf(src, "qwen2", weights, hparams)
    data = bytearray(src.read_bytes())
    if damage == "truncated":
        data = data[: len(data) - 1000]
    elif damage == "magic":
        data[:4] = b"GGML"
    elif damage == "header":
        data[24:64] = b"\xff" * 40  # the first key's length and bytes
    elif damage == "empty":
        data = bytearray()
    elif damage == "version":
        data[4:8] = (99).to_bytes(4, "little")
    src.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=str(src)):
        convert_gguf(src, tmp_path / "out")


def test_unsupported_architecture_is_named(tmp_path):
    _, weights, hparams = _model("llama")
    write_gguf(tmp_path / "m.gguf", "falcon", weights, hparams)
    with pytest.raises(GGUFError, match="'falcon' is not supported"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_llama3_rope_freqs_become_its_rope_scaling(tmp_path):
    from mlx_lm.models import llama

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    _, fields, _ = _args("llama")
    model = llama.Model(llama.ModelArgs.from_dict(dict(fields, rope_theta=500000.0, rope_scaling=scaling)))
    _, weights, hparams = _model("llama")
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
    # What llama.cpp stores for Llama 3.1+: one divisor per rotary frequency.
    inv = 500000.0 ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    wavelen = 2 * np.pi / inv
    smooth = (8192 / wavelen - 1) / 3
    freqs = np.where(wavelen < 2048, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8 + smooth)))
    assert len(set(freqs.round(3))) > 2  # unscaled, fully scaled and blended frequencies
    write_gguf(tmp_path / "m.gguf", "llama", weights, dict(hparams, rope_theta=500000.0),
               extra={"rope_freqs.weight": freqs})
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", GGUFConvertConfig(dtype="float32"))
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == scaling
    ids = list(range(3, 3 + 40))
    np.testing.assert_allclose(_logits(_load(out)[0], ids), _logits(model, ids), atol=1e-4)

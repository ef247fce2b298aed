import json

import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

from mlxhost.models.convert import convert_model
from mlxhost.server.cli import main


def test_convert_to_4_bits(qwen3_model_dir, tmp_path, capsys):
    out = tmp_path / "q4"
    assert main(["convert", str(qwen3_model_dir), str(out), "--bits", "4", "--group-size", "64"]) == 0
    captured = capsys.readouterr()
    assert str(out) in captured.out and "->" in captured.out
    assert "loading..." in captured.err and "quantizing and saving..." in captured.err  # progress, on stderr
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    model, tokenizer = mlx_lm.load(str(out))
    linears = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    assert linears and all(isinstance(m, nn.QuantizedLinear) for m in linears)
    text = mlx_lm.generate(model, tokenizer, "Hello world", max_tokens=8, sampler=make_sampler(temp=0.0))
    assert isinstance(text, str) and text


def test_empty_out_is_accepted(qwen3_model_dir, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    convert_model(str(qwen3_model_dir), out, bits=8, group_size=32)
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 8


def test_refuses_non_empty_out(qwen3_model_dir, tmp_path, capsys):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["convert", str(qwen3_model_dir), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(FileExistsError):
        convert_model(str(qwen3_model_dir), out)


def test_flag_choices():
    with pytest.raises(SystemExit):
        main(["convert", "a", "b", "--group-size", "48"])
    with pytest.raises(SystemExit):
        main(["convert", "a", "b", "--bits", "7"])


def _tiny_gguf(path, qtype: str):
    """A two-layer qwen2 GGUF with random weights, its matrices stored as `qtype`."""
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen2

    from tests.models.gguf_files import byte_tokens, write_gguf

    fields = dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=len(byte_tokens()),
                  rope_theta=10000.0, tie_word_embeddings=True)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(fields))
    rng = np.random.default_rng(0)
    weights = {k: (rng.standard_normal(v.shape) * 0.1).astype(np.float32) for k, v in tree_flatten(model.parameters())}
    write_gguf(path, "qwen2", weights, {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128,
                                        "head_count": 4, "head_count_kv": 2}, qtype=qtype)
    return path


@pytest.mark.parametrize("qtype,says", [("Q4_1", ", float16)"), ("Q5_0", ", float16, Q5_0 as 4-bit)")])
def test_a_gguf_names_the_bits_only_for_types_it_requantized(qtype, says, tmp_path, capsys):
    pytest.importorskip("gguf")
    src = _tiny_gguf(tmp_path / f"m.{qtype}.gguf", qtype)
    assert main(["convert", str(src), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(str(tmp_path / "out")) and out.endswith(says), out
    bits = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]["bits"]
    assert bits == 4  # Q4_1 keeps its own 4 bits; Q5_0 is dequantized, then quantized to --bits


def test_requantized_types_are_the_ones_mlx_cannot_read():
    from mlxhost.models.convert import requantized_types
    from mlxhost.models.gguf import GGUFConvertConfig

    cfg = GGUFConvertConfig(bits=4)
    assert requantized_types({"Q4_K", "Q6_K", "F32"}, cfg) == "Q4_K/Q6_K"
    assert requantized_types({"Q4_1", "Q8_0", "F16"}, cfg) == ""
    assert requantized_types({"Q4_K", "F32"}, GGUFConvertConfig()) == ""  # no --bits: kept float


def test_help_names_gguf(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "GGUF" in text and ".gguf file" in text and "K-quants" in text

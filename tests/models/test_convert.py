import json

import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

from mlxhost.server.cli import main
from mlxhost.models.convert import convert_model


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

import shutil
import struct

import pytest

from mlxhost.config import ServerConfig
from mlxhost.models.loader import (
    LOAD_STRATEGIES,
    ModelLoadError,
    choose_load_strategy,
    load_model,
    read_safetensors_mmap,
)
from mlxhost.server.cli import main


@pytest.fixture
def model_copy(qwen3_model_dir, tmp_path):
    return shutil.copytree(qwen3_model_dir, tmp_path / "model")


def test_good_folder_loads(model_copy):
    loaded = load_model(str(model_copy))
    assert loaded.config["model_type"] == "qwen3"


@pytest.mark.parametrize("strategy", ("auto",) + LOAD_STRATEGIES)
def test_truncated_file_names_it(model_copy, strategy):
    path = model_copy / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated: \d+ bytes, header says \d+"):
        load_model(str(model_copy), strategy)


def test_garbage_header(model_copy):
    path = model_copy / "model.safetensors"
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + header_len] = b"\xff" * header_len
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: bad safetensors header"):
        load_model(str(model_copy))


def test_absurd_header_length(model_copy):
    path = model_copy / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated or not safetensors"):
        load_model(str(model_copy))


@pytest.mark.parametrize("strategy", ["auto", "mmap"])
def test_serve_exits_with_the_message(model_copy, capsys, strategy):
    path = model_copy / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(100)
    assert main(["serve", str(model_copy), "--load-strategy", strategy]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "Traceback" not in err


def _params_and_logits(loaded):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(loaded.model.parameters()))
    logits = loaded.model(mx.array([[1, 2, 3, 4]]))
    mx.eval(logits, params)
    return params, logits


@pytest.mark.parametrize("fixture", ["qwen3_model_dir", "qwen3_4bit_model_dir"])
def test_every_strategy_loads_the_same_model(fixture, request):
    import mlx.core as mx

    folder = str(request.getfixturevalue(fixture))
    ref_params, ref_logits = _params_and_logits(load_model(folder, "mlx-lm"))
    for strategy in LOAD_STRATEGIES[1:]:
        params, logits = _params_and_logits(load_model(folder, strategy))
        assert params.keys() == ref_params.keys(), strategy
        for name, value in params.items():
            ref = ref_params[name]
            assert value.dtype == ref.dtype and value.shape == ref.shape, (strategy, name)
            assert mx.array_equal(value, ref).item(), (strategy, name)
        assert mx.array_equal(logits, ref_logits).item(), strategy


def test_mmap_reader_keeps_bfloat16_bits(tmp_path):
    import mlx.core as mx

    # Values numpy cannot hold as bfloat16, and one that float32 -> bfloat16 rounding would change.
    original = {"a": mx.array([1.0, -2.5, 3.0e-39, 65504.0], dtype=mx.bfloat16),
                "b": mx.arange(12, dtype=mx.uint32).reshape(3, 4), "c": mx.array([0.1], dtype=mx.float16)}
    mx.save_safetensors(str(tmp_path / "w.safetensors"), original)
    read = read_safetensors_mmap(tmp_path / "w.safetensors")
    for name, value in original.items():
        assert read[name].dtype == value.dtype and read[name].shape == value.shape
        assert mx.array_equal(read[name].view(mx.uint8), value.view(mx.uint8)).item(), name


def test_auto_picks_by_total_weight_size():
    small, large = choose_load_strategy(300 << 20), choose_load_strategy(16 << 30)
    assert small in LOAD_STRATEGIES and large in LOAD_STRATEGIES
    # What `mlxhost bench load` measured (see choose_load_strategy): mlx-lm's own load at both ends.
    assert small == large == "mlx-lm"
    # The rule is monotone in size: one switch point at most.
    picks = [choose_load_strategy(n << 20) for n in (1, 100, 1000, 4000, 8000, 16000, 64000)]
    assert len([i for i in range(1, len(picks)) if picks[i] != picks[i - 1]]) <= 1


def test_auto_uses_the_rule(model_copy, caplog, monkeypatch):
    import mlxhost.models.loader as loader

    seen = []
    monkeypatch.setattr(loader, "choose_load_strategy", lambda n: seen.append(n) or "mmap")
    with caplog.at_level("INFO", logger="mlxhost.models.loader"):
        load_model(str(model_copy))
    assert seen == [(model_copy / "model.safetensors").stat().st_size]
    assert "(mmap)" in caplog.text


def test_unknown_strategy_is_refused(model_copy):
    with pytest.raises(ValueError, match="load strategy"):
        load_model(str(model_copy), "fastest")
    with pytest.raises(ValueError, match="load_strategy"):
        ServerConfig(load_strategy="fastest")

import json

import mlx.core as mx
import mlx_lm
import pytest

from mlxhost.kv.kinds.probe import probe_kv


@pytest.mark.parametrize("fixture", ["qwen3_model_dir", "qwen3_4bit_model_dir"])
def test_probe_kv_reports_activation_dtype(fixture, request):
    path = request.getfixturevalue(fixture)
    model, _ = mlx_lm.load(str(path))
    config = json.loads((path / "config.json").read_text())
    probe = probe_kv(model)
    per_token, dtype, num_layers = probe.bytes_per_token, probe.dtype, probe.num_layers
    # The fixtures are float32; a 4-bit model's activations take the dtype of its quantization scales.
    assert dtype == mx.float32 and dtype != mx.uint32
    assert num_layers == config["num_hidden_layers"]
    itemsize = 4
    expected = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * itemsize
    assert per_token == expected


def test_4bit_scales_are_float32(qwen3_4bit_model_dir):
    model, _ = mlx_lm.load(str(qwen3_4bit_model_dir))
    layer = model.model.layers[0].self_attn.k_proj
    assert layer.weight.dtype == mx.uint32 and layer.scales.dtype == mx.float32
    dtype = probe_kv(model).dtype
    assert dtype == layer.scales.dtype

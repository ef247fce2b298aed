"""Start-up measurements kept between starts (memory/profile.py): a second start of the same model shape reads
the activation peak back instead of running the forward; another shape, a bad file or no folder measures."""

import json

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from mlxhost.memory import profile
from mlxhost.platform.quantized_rows import dequant_in_flight_bytes, fold_quantized_rows


def _model(hidden=64):
    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _counting(monkeypatch):
    calls = []
    real = profile.activation_bytes

    def counted(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)

    monkeypatch.setattr(profile, "activation_bytes", counted)
    return calls


def test_a_second_start_reads_the_measurement_back(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    first = profile.remembered_activation_bytes(_model(), 32, None, tmp_path)
    again = profile.remembered_activation_bytes(_model(), 32, None, tmp_path)  # other values, same shape
    assert first == again and calls == [32]
    profile.remembered_activation_bytes(_model(), 64, None, tmp_path)  # another chunk
    profile.remembered_activation_bytes(_model(hidden=128), 32, None, tmp_path)  # another shape
    assert calls == [32, 64, 32]


def test_a_damaged_file_is_measured_again(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    profile.remembered_activation_bytes(_model(), 32, None, tmp_path)
    (saved,) = tmp_path.glob("activations-*.json")
    saved.write_text("{not json")
    measured = profile.remembered_activation_bytes(_model(), 32, None, tmp_path)  # a peak reading: may differ
    assert len(calls) == 2 and json.loads(saved.read_text())["activation_bytes"] == measured


def test_startup_budget_remembers_only_when_asked(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    for _ in range(2):
        profile.startup_budget(_model(), 32)
    assert len(calls) == 2 and not any(tmp_path.iterdir())
    for _ in range(2):
        profile.startup_budget(_model(), 32, remember=str(tmp_path))
    assert len(calls) == 3


def test_the_budget_adds_the_dequantized_weights_forwards_hold_where_layers_fold_rows(monkeypatch):
    """On MLX-CUDA (row-folding layers) forwards in flight hold dequantized weight copies the one-forward profile
    does not see; elsewhere nothing is added."""
    monkeypatch.setattr(profile, "activation_bytes", lambda *a, **kw: 1000)
    plain = profile.startup_budget(_model(), 32)
    assert plain.activations == 1000
    model = _model()
    nn.quantize(model, group_size=32, bits=4)
    fold_quantized_rows(model)
    extra = dequant_in_flight_bytes(model)
    assert extra > 0 and profile.startup_budget(model, 32).activations == 1000 + extra


def test_a_measurement_from_before_forwards_freed_their_copies_is_not_read_back(monkeypatch):
    """What a forward holds changed with how it runs: the key says how it was measured."""
    key = profile.measurement_key(_model(), 32)
    monkeypatch.setattr(profile, "_MEASURED_AS", "before")
    assert key is not None and profile.measurement_key(_model(), 32) not in (None, key)

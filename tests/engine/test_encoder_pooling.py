"""Encoder pooling over right-padded batches (no model), and reading which pooling a folder asks for."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxhost.engine.encoder import pool
from mlxhost.models.encoder import encoder_type, read_pooling
from mlxhost.models.loader import ModelLoadError

# Two rows: 3 real tokens, then 1 real token and 2 padded positions full of junk.
HIDDEN = mx.array([[[1.0, 2.0], [3.0, 4.0], [5.0, 0.0]],
                   [[7.0, -1.0], [100.0, 100.0], [-100.0, 50.0]]])
MASK = mx.array([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("mode,expected", [
    ("mean", [[3.0, 2.0], [7.0, -1.0]]),
    ("cls", [[1.0, 2.0], [7.0, -1.0]]),
    ("max", [[5.0, 4.0], [7.0, -1.0]]),
    ("lasttoken", [[5.0, 0.0], [7.0, -1.0]]),
])
def test_pooling_ignores_padding(mode, expected):
    out = pool(HIDDEN, MASK, mode)
    assert out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), expected)


def test_unknown_pooling_is_refused():
    with pytest.raises(ValueError):
        pool(HIDDEN, MASK, "weighted")


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_pooling_read_from_the_folder(tmp_path):
    assert read_pooling(tmp_path) == "mean"  # no sentence-transformers files: mean
    _write(tmp_path / "1_Pooling" / "config.json", {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    assert read_pooling(tmp_path) == "cls"
    # modules.json names the Pooling module's folder.
    _write(tmp_path / "modules.json", [{"type": "sentence_transformers.models.Transformer", "path": ""},
                                       {"type": "sentence_transformers.models.Pooling", "path": "pool"}])
    _write(tmp_path / "pool" / "config.json", {"pooling_mode_max_tokens": True})
    assert read_pooling(tmp_path) == "max"


@pytest.mark.parametrize("modules,pooling", [
    ([{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}], None),  # would change the vectors
    (None, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}),  # two at once
    (None, {"pooling_mode_mean_sqrt_len_tokens": True}),  # not supported
])
def test_unsupported_folders_are_refused(tmp_path, modules, pooling):
    if modules is not None:
        _write(tmp_path / "modules.json", modules)
    if pooling is not None:
        _write(tmp_path / "1_Pooling" / "config.json", pooling)
    with pytest.raises(ModelLoadError):
        read_pooling(tmp_path)


@pytest.mark.parametrize("config,expected", [
    ({"model_type": "bert"}, "bert"),
    ({"model_type": "xlm-roberta"}, "xlm_roberta"),
    ({"model_type": "modernbert", "architectures": ["ModernBertForMaskedLM"]}, "modernbert"),
    ({"architectures": ["BertModel"]}, "bert"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, None),
    ({"architectures": ["BertForSequenceClassification"]}, "bert"),  # a cross-encoder: served for rerank
])
def test_encoder_detection(config, expected):
    assert encoder_type(config) == expected

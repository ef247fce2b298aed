"""The three Whisper folder layouts load into the same network: a faster-whisper (CTranslate2) folder
written from a tiny MLX one gives the same weights (to float16 rounding) and the same transcript."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxhost.audio.ct2 import CT2FormatError, read_model_bin
from mlxhost.audio.detect import audio_kind, whisper_layout
from mlxhost.audio.transcribe import TranscribeOptions, TranscriptionJob
from mlxhost.audio.whisper import load_whisper
from mlxhost.models.loader import ModelLoadError, load_model
from mlxhost.testing.audio_fixtures import build_tiny_whisper, build_tiny_whisper_ct2


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    mlx_dir = build_tiny_whisper(tmp_path_factory.mktemp("whisper-mlx"))
    return mlx_dir, build_tiny_whisper_ct2(tmp_path_factory.mktemp("whisper-ct2"), mlx_dir)


def _load(folder):
    return load_whisper(folder, json.loads((folder / "config.json").read_text()))


class _Core:
    def __init__(self, model):
        self.model = model


def test_layouts_are_detected_from_config(folders):
    mlx_dir, ct2_dir = folders
    assert whisper_layout(json.loads((mlx_dir / "config.json").read_text())) == "mlx"
    assert whisper_layout(json.loads((ct2_dir / "config.json").read_text())) == "ct2"
    assert whisper_layout({"model_type": "whisper", "d_model": 64}) == "hf"
    assert audio_kind({"model_type": "qwen3"}) is None
    assert audio_kind({"istftnet": {}, "plbert": {}}) == "kokoro"


def test_ct2_weights_match_the_mlx_folder(folders):
    mlx_dir, ct2_dir = folders
    a = dict(tree_flatten(_load(mlx_dir).net.parameters()))
    b = dict(tree_flatten(_load(ct2_dir).net.parameters()))
    assert a.keys() == b.keys()
    for key in a:
        expected = np.array(a[key]).astype(np.float16).astype(np.float32)
        if key.endswith("attn.key.bias"):
            continue  # not a parameter of Whisper's key projection
        np.testing.assert_array_equal(np.array(b[key]), expected, err_msg=key)


def test_ct2_folder_transcribes_like_the_mlx_folder(folders, tmp_path):
    mlx_dir, ct2_dir = folders
    # float32 CTranslate2 weights: exactly the MLX folder's, so the same tokens come out.
    exact = build_tiny_whisper_ct2(tmp_path / "ct2-f32", mlx_dir, float16=False)
    samples = (np.random.default_rng(0).standard_normal(16000 * 3) * 0.1).astype(np.float32)
    texts = []
    for folder in (mlx_dir, exact):
        core = _Core(_load(folder))
        mx.random.seed(0)  # a random model falls back to sampled decodes
        job = TranscriptionJob(samples, TranscribeOptions(temperature=0.0))
        while not job.advance(core):
            pass
        texts.append([s.tokens for s in job.segments])
    assert texts[0] == texts[1]


def test_timestamp_tokens_are_added_after_notimestamps(folders):
    _, ct2_dir = folders
    tokenizer = _load(ct2_dir).net.get_tokenizer()
    assert tokenizer.timestamp_begin == tokenizer.no_timestamps + 1


def test_load_model_routes_whisper_folders(folders):
    loaded = load_model(str(folders[1]))
    assert loaded.model.is_audio and loaded.model.layout == "ct2"


def test_bad_model_bin_is_a_load_error(folders, tmp_path):
    _, ct2_dir = folders
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (broken / name).write_bytes((ct2_dir / name).read_bytes())
    (broken / "model.bin").write_bytes((ct2_dir / "model.bin").read_bytes()[:1000])
    with pytest.raises(CT2FormatError):
        read_model_bin(broken / "model.bin")
    with pytest.raises(ModelLoadError):
        _load(broken)


def test_convert_writes_an_mlx_folder(folders, tmp_path):
    from mlxhost.audio.convert import convert_ct2_whisper, is_ct2_whisper

    _, ct2_dir = folders
    assert is_ct2_whisper(ct2_dir) and not is_ct2_whisper(folders[0])
    out = convert_ct2_whisper(ct2_dir, tmp_path / "converted", dtype="float32")
    assert whisper_layout(json.loads((out / "config.json").read_text())) == "mlx"
    a = dict(tree_flatten(_load(ct2_dir).net.parameters()))
    b = dict(tree_flatten(_load(out).net.parameters()))
    for key in a:
        np.testing.assert_array_equal(np.array(a[key]), np.array(b[key]), err_msg=key)
    with pytest.raises(FileExistsError):
        convert_ct2_whisper(ct2_dir, out)

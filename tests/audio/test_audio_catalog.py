"""Audio folders as the rest of the server sees models: `--model-dir` and `mlxhost list` find them by
config.json alone, and their weight files count toward the memory budget (a faster-whisper folder's
model.bin, an MLX Whisper's weights file)."""

from __future__ import annotations

import json

from mlxhost.models.catalog import model_dir_specs, scan_model_dir
from mlxhost.models.specs import weights_on_disk
from mlxhost.testing.audio_fixtures import build_tiny_whisper, build_tiny_whisper_ct2


def test_model_dir_finds_audio_folders(tmp_path):
    root = tmp_path / "models"
    mlx_dir = build_tiny_whisper(root / "whisper-mlx")
    ct2_dir = build_tiny_whisper_ct2(root / "whisper-ct2", mlx_dir)
    (root / "kokoro").mkdir()
    (root / "kokoro" / "config.json").write_text(json.dumps({"istftnet": {}, "plbert": {}, "vocab": {}}))
    found = {m.name: m for m in scan_model_dir(root)}
    assert set(found) == {"whisper-mlx", "whisper-ct2", "kokoro"}
    assert all(m.servable for m in found.values()), [m.why_not for m in found.values()]
    assert {s.name for s in model_dir_specs(root)} == {"whisper-mlx", "whisper-ct2", "kokoro"}
    assert weights_on_disk(str(ct2_dir)) == (ct2_dir / "model.bin").stat().st_size
    assert weights_on_disk(str(mlx_dir)) == (mlx_dir / "weights.safetensors").stat().st_size

"""Audio models load where MLX computes on CUDA: the loader's CUDA-only rework of quantized text layers
must leave them alone (a Whisper load on an H200 failed there: its model is no `nn.Module`). The CUDA
check is forced on so the CPU runs the same branch."""

from __future__ import annotations

import pytest

from mlxhost.models.loader import load_model
from mlxhost.platform import backend
from mlxhost.testing.audio_fixtures import build_tiny_kokoro, build_tiny_whisper, build_tiny_whisper_ct2


@pytest.mark.parametrize("layout", ["mlx", "ct2", pytest.param("kokoro", marks=pytest.mark.needs("espeak-ng"))])
def test_audio_folders_load_with_the_cuda_branch_taken(layout, tmp_path, monkeypatch):
    monkeypatch.setattr(backend, "is_cuda", lambda: True)
    monkeypatch.delenv("MLXHOST_FOLD_ROWS", raising=False)
    if layout == "kokoro":
        folder = build_tiny_kokoro(tmp_path / "kokoro")
    else:
        folder = build_tiny_whisper(tmp_path / "whisper")
        if layout == "ct2":
            folder = build_tiny_whisper_ct2(tmp_path / "ct2", folder)
    loaded = load_model(str(folder))
    assert loaded.model.is_audio and loaded.model.kind == ("kokoro" if layout == "kokoro" else "whisper")

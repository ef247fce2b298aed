"""Which model folders are audio models, read off config.json alone (no MLX, no weights opened).

Whisper comes in three layouts: mlx-whisper / mlx-community (`n_mels`, `n_audio_ctx`, ... and
weights.safetensors or weights.npz), Hugging Face transformers (`model_type: whisper`), and
faster-whisper / CTranslate2 (model.bin, whose config.json holds only decoding settings such as
`suppress_ids` and `lang_ids`). Kokoro folders carry `istftnet` and `plbert` sections.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

AUDIO_HINT = "audio models need the audio extra: pip install 'mlxhost[audio]'"

# CTranslate2's Whisper config.json: decoding settings only, no model_type.
_CT2_WHISPER_KEYS = {"suppress_ids", "suppress_ids_begin", "lang_ids"}
_MLX_WHISPER_KEYS = {"n_mels", "n_audio_ctx", "n_text_ctx"}


def whisper_layout(config: dict) -> str | None:
    """"mlx", "hf" or "ct2" for a Whisper config; None for anything else."""
    if _MLX_WHISPER_KEYS <= set(config):  # before model_type: mlx-community configs say "whisper" too
        return "mlx"
    if str(config.get("model_type", "")).lower() == "whisper" or any(
            str(a).startswith("Whisper") for a in config.get("architectures") or ()):
        return "hf"
    if _CT2_WHISPER_KEYS & set(config) and "model_type" not in config:
        return "ct2"
    return None


def audio_kind(config: dict | None) -> str | None:
    """"whisper" (speech to text), "kokoro" (text to speech) or None."""
    if not isinstance(config, dict):
        return None
    if whisper_layout(config) is not None:
        return "whisper"
    if str(config.get("model_type", "")).lower() == "kokoro" or {"istftnet", "plbert"} <= set(config):
        return "kokoro"
    return None


def has_audio() -> bool:
    """Whether the audio extra's libraries (mlx-audio for the models, PyAV for the files) are installed."""
    return all(importlib.util.find_spec(m) is not None for m in ("mlx_audio", "av"))


def read_voices(folder) -> list[str]:
    """A Kokoro folder's voice names: its voices/NAME.safetensors files."""
    return sorted(p.stem for p in (Path(folder) / "voices").glob("*.safetensors"))

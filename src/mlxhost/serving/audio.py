"""What the HTTP side knows about a served audio model: plain data and a job factory, no MLX."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class AudioInfo:
    task: str  # "transcription" (speech to text) or "speech" (text to speech)
    kind: str  # "whisper", "kokoro"
    sample_rate: int  # of the audio the model takes (transcription) or makes (speech)
    voices: tuple[str, ...] = ()
    # Builds the job the engine thread advances: (samples, **TranscribeOptions) or (text, voice=, speed=).
    make_job: Callable[..., Any] | None = None

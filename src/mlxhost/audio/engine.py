"""Audio models as served models: loaded like any folder, each on its own engine thread.

The core only answers `call`s, as an encoder's does (engine/encoder.py): a transcription or speech
job's `advance` runs there one window or one sentence at a time, so requests on one model take turns
and the chat models' engine threads never wait for audio work.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from mlxhost.audio.detect import AUDIO_HINT, audio_kind
from mlxhost.audio.kokoro import SpeechJob
from mlxhost.engine.encoder import EncoderCore
from mlxhost.engine.loop import Assembled, AsyncEngine
from mlxhost.models.loader import LoadedModel, ModelLoadError
from mlxhost.serving.audio import AudioInfo
from mlxhost.serving.model import ServedModel

log = logging.getLogger(__name__)


def load_audio_model(folder: str, config: dict, source: str) -> LoadedModel:
    """A Whisper or Kokoro folder as a LoadedModel whose `model.is_audio` is set."""
    kind = audio_kind(config)
    start = time.perf_counter()
    try:
        if kind == "whisper":
            from mlxhost.audio.whisper import load_whisper  # optional: mlx_audio (audio extra)

            model = load_whisper(Path(folder), config)
        else:
            from mlxhost.audio.kokoro import load_kokoro  # optional: mlx_audio (audio extra)

            model = load_kokoro(Path(folder), config)
    except ImportError as exc:
        raise ModelLoadError(f"{source}: {AUDIO_HINT} ({exc})") from exc
    return LoadedModel(model, None, config, source, timings={"load": time.perf_counter() - start})


class AudioCore(EncoderCore):
    """Owns an audio model on its engine thread (engine/contract.py's Core, as an encoder's): its jobs come as
    `AsyncEngine.call`s; it generates no text."""

    def add(self, request) -> None:
        raise ValueError("an audio model cannot generate text")

    def status(self) -> dict:
        return {"kind": self.model.kind, "num_running": 0, "num_waiting": 0, "prefix_cache": {"enabled": False}}


def audio_served(spec, config, loaded: LoadedModel):
    """(ServedModel, AsyncEngine not started) for an audio model (server.load_served's hook)."""
    model = loaded.model
    info = AudioInfo(task=model.task, kind=model.kind, sample_rate=getattr(model, "sample_rate", 16000),
                     voices=tuple(getattr(model, "voices", ())), make_job=_job_factory(model))
    served = ServedModel(name=spec.name, aliases=frozenset(spec.aliases), tokenizer=None, max_model_len=0,
                         vocab_size=0, eos_token_ids=frozenset(), default_max_tokens=0, created=int(time.time()),
                         audio=info)
    engine_config = spec.engine or config.engine
    log.info("serving %s %s as %r (%s)", model.kind, loaded.source, spec.name, model.task)
    return served, AsyncEngine(lambda: Assembled(AudioCore(model, engine_config)),
                               max_num_waiting=engine_config.max_num_waiting)


def _job_factory(model):
    """What turns a request's plain data into a job for this model's engine thread."""
    if model.task == "transcription":
        from mlxhost.audio.transcribe import TranscribeOptions, TranscriptionJob  # optional: mlx_audio (audio extra)

        return lambda samples, **options: TranscriptionJob(samples, TranscribeOptions(**options))

    return lambda text, **options: SpeechJob(text, **options)

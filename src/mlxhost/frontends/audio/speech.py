"""`POST /v1/audio/speech` and `GET /v1/audio/voices` (OpenAI): text in, audio bytes out.

The first sentence is synthesized before the response starts, so a bad voice or a failing
synthesizer is still a proper error status; then each further sentence is one engine call, encoded
and sent as soon as it exists (chunked transfer), or as `speech.audio.delta` events with
`stream_format: sse`.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import ConfigDict, Field

from mlxhost.frontends.audio.media import CONTENT_TYPES, SpeechEncoder
from mlxhost.frontends.audio.transcriptions import check_audio_model
from mlxhost.frontends.common.errors import APIError, clip
from mlxhost.frontends.common.gateway import Gateway
from mlxhost.frontends.common.sse import sse
from mlxhost.serving.schemas import StrictModel

MAX_INPUT_CHARS = 4096  # OpenAI's limit


class VoiceId(StrictModel):
    model_config = ConfigDict(extra="forbid")
    id: str


class SpeechRequest(StrictModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str = Field(min_length=1, max_length=MAX_INPUT_CHARS)
    voice: Union[str, VoiceId]
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = Field(1.0, ge=0.25, le=4.0)
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: Optional[str] = None  # for models that take style prompts; Kokoro's style is the voice


def add_speech_routes(app: FastAPI, gateway: Gateway) -> None:
    models = gateway.models
    @app.post("/v1/audio/speech")
    async def speech(body: SpeechRequest, raw: Request):
        voice = body.voice if isinstance(body.voice, str) else body.voice.id
        async with gateway.hold(body.model) as held:
            model = held.model
            check_audio_model(model, "speech")
            info = model.audio
            if voice not in info.voices:
                raise APIError(400, f"voice {clip(voice)!r} is not one of this model's voices: "
                               f"{', '.join(info.voices)}", "voice")
            job = info.make_job(body.input, voice=voice, speed=body.speed)
            first = await held.run_job(job.advance)
        if first is None:
            raise APIError(400, "input has nothing speakable", "input")
        encoder = SpeechEncoder(body.response_format, info.sample_rate)
        chunks = _audio_chunks(gateway, body.model, job, first, encoder, raw)
        if body.stream_format == "sse":
            return StreamingResponse(_sse(chunks, job), media_type="text/event-stream")
        return StreamingResponse(chunks, media_type=CONTENT_TYPES[body.response_format])

    @app.get("/v1/audio/voices")
    async def voices(raw: Request, model: Optional[str] = None):
        """Each text-to-speech model's voices, read off its folder (listing loads nothing)."""
        from mlxhost.audio.detect import audio_kind, read_voices  # the models' side: only when voices are listed

        specs = getattr(raw.app.state, "model_specs", ())
        if model is not None:
            name = models.resolve(model)
            specs = [s for s in specs if s.name == name]
        out = []
        for spec in specs:
            config = _config(spec.source)
            if audio_kind(config) == "kokoro":
                out += [{"id": v, "name": v, "model": spec.name} for v in read_voices(spec.source)]
        return {"object": "list", "voices": out, "data": out}


async def _audio_chunks(gateway: Gateway, name: str, job, first, encoder: SpeechEncoder, raw: Request):
    samples = first
    async with gateway.hold(name) as held:  # keeps the model loaded while the stream runs
        while samples is not None:
            data = await asyncio.to_thread(encoder.encode, samples)
            if data:
                yield data
            if await raw.is_disconnected():
                return
            samples = await held.run_job(job.advance)
    tail = await asyncio.to_thread(encoder.finish)
    if tail:
        yield tail


async def _sse(chunks, job):
    async for data in chunks:
        yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
    usage = {"input_tokens": len(job.sentences), "output_tokens": job.num_samples, "total_tokens": 0}
    yield sse({"type": "speech.audio.done", "usage": usage})


def _config(source: str) -> dict | None:
    try:
        return json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return None

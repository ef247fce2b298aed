"""`POST /v1/audio/transcriptions` and `/v1/audio/translations` (OpenAI): the file is decoded here,
off the event loop; the Whisper job runs on the model's engine thread one 30-second window per call,
so other requests on the same model take turns and chat models' threads never wait for it."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from mlxhost.frontends.audio import render
from mlxhost.frontends.audio.forms import TranscriptionForm, read_form
from mlxhost.frontends.audio.media import AudioDecodeError, decode_audio
from mlxhost.frontends.common.errors import APIError, error_body
from mlxhost.frontends.common.gateway import Gateway, Held
from mlxhost.frontends.common.sse import client_gone, sse

_FORM_DOC = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "model"], "properties": {
        "file": {"type": "string", "format": "binary"}, "model": {"type": "string"},
        "language": {"type": "string"}, "prompt": {"type": "string"},
        "response_format": {"type": "string", "enum": list(render.FORMATS)},
        "temperature": {"type": "number"}, "stream": {"type": "boolean"},
        "timestamp_granularities[]": {"type": "array", "items": {"type": "string", "enum": ["word", "segment"]}},
    }}}}}}


def check_audio_model(model, task: str) -> None:
    info = model.audio
    if info is None or info.task != task:
        what = "speech-to-text" if task == "transcription" else "text-to-speech"
        raise APIError(400, f"`{model.name}` is not a {what} model", "model", "model_not_supported")


async def _samples(form: TranscriptionForm):
    try:
        return await asyncio.to_thread(decode_audio, form.data)
    except AudioDecodeError as exc:
        raise APIError(400, f"{form.filename}: {exc}", "file", "invalid_audio") from None


async def _run_window(held: Held, job) -> bool:
    try:
        return await held.run_job(job.advance)
    except ValueError as exc:  # e.g. a language the model does not know
        raise APIError(400, str(exc), "language") from exc


def add_transcription_routes(app: FastAPI, gateway: Gateway) -> None:
    async def transcribe(raw: Request, translate: bool):
        form = await read_form(raw, translate)
        task = "translate" if translate else "transcribe"
        async with gateway.hold(form.model) as held:
            check_audio_model(held.model, "transcription")
        samples = await _samples(form)
        options = {"task": task, "language": form.language, "prompt": form.prompt,
                   "temperature": form.temperature, "word_timestamps": "word" in form.granularities}
        if form.stream:
            return StreamingResponse(_stream(gateway, form, samples, options), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        async with gateway.hold(form.model) as held:
            job = held.model.audio.make_job(samples, **options)
            while not await _run_window(held, job):
                if await raw.is_disconnected():
                    return client_gone()
        return _respond(job, form, task)

    @app.post("/v1/audio/transcriptions", openapi_extra=_FORM_DOC)
    async def transcriptions(raw: Request):
        return await transcribe(raw, translate=False)

    @app.post("/v1/audio/translations", openapi_extra=_FORM_DOC)
    async def translations(raw: Request):
        return await transcribe(raw, translate=True)


def _respond(job, form: TranscriptionForm, task: str):
    fmt = form.response_format
    if fmt == "text":
        return PlainTextResponse(job.text + "\n")
    if fmt == "srt":
        return PlainTextResponse(render.srt(job.segments), media_type="application/x-subrip")
    if fmt == "vtt":
        return PlainTextResponse(render.vtt(job.segments), media_type="text/vtt")
    if fmt == "verbose_json":
        return JSONResponse(render.verbose(job, task, form.granularities))
    return JSONResponse({"text": job.text, "usage": render.duration_usage(job)})


async def _stream(gateway: Gateway, form: TranscriptionForm, samples, options: dict):
    """OpenAI's transcript events: a `transcript.text.delta` per window's text, then `transcript.text.done`."""
    try:
        async with gateway.hold(form.model) as held:
            job = held.model.audio.make_job(samples, **options)
            done = False
            while not done:
                done = await _run_window(held, job)
                delta = job.take_delta()
                if delta:
                    yield sse({"type": "transcript.text.delta", "delta": delta})
        yield sse({"type": "transcript.text.done", "text": job.text, "usage": render.duration_usage(job)})
    except APIError as exc:  # the status line is gone: the error travels as an event
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))

"""OpenAI's multipart form for /v1/audio/transcriptions and /translations, read into plain data.

Parsed by hand rather than by FastAPI's Form parameters so that every mistake is a 400 in OpenAI's
error shape naming the field (FastAPI would answer 422 for some of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.datastructures import UploadFile

from mlxhost.frontends.audio.render import FORMATS
from mlxhost.frontends.common.errors import APIError, clip

# Fields OpenAI defines that change nothing here (diarization, logprobs, server-side chunking).
_SKIPPED = {"chunking_strategy", "include[]", "include", "known_speaker_names[]", "known_speaker_references[]",
            "user"}
_GRANULARITIES = {"word", "segment"}
# The largest upload read: OpenAI's own limit is 25 MB; long local recordings are allowed more.
MAX_FILE_BYTES = 512 << 20


@dataclass
class TranscriptionForm:
    model: str
    data: bytes
    filename: str
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    granularities: set[str] = field(default_factory=set)
    stream: bool = False


async def read_form(request, translate: bool) -> TranscriptionForm:
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise APIError(400, "send the audio as multipart/form-data with a `file` field", "file")
    try:
        form = await request.form(max_files=2, max_fields=64)
    except Exception as exc:  # a malformed multipart body
        raise APIError(400, f"the multipart body cannot be read: {exc}", "file") from None
    known = {"file", "model", "prompt", "response_format", "temperature"} | (
        set() if translate else {"language", "timestamp_granularities[]", "timestamp_granularities", "stream"})
    unknown = sorted(set(form.keys()) - known - _SKIPPED)
    if unknown:
        raise APIError(400, f"unknown form fields: {', '.join(clip(u) for u in unknown)}; known: "
                       f"{', '.join(sorted(known))}", unknown[0])
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise APIError(400, "`file` is required: the audio file to transcribe", "file")
    data = await upload.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise APIError(413, f"the file is larger than {MAX_FILE_BYTES >> 20} MB", "file")
    model = _text(form, "model")
    if not model:
        raise APIError(400, "`model` is required", "model")
    out = TranscriptionForm(model=model, data=data, filename=upload.filename or "audio",
                            language=_text(form, "language") or None, prompt=_text(form, "prompt") or None)
    out.response_format = _text(form, "response_format") or "json"
    if out.response_format not in FORMATS:
        raise APIError(400, f"response_format must be one of {', '.join(FORMATS)}, got "
                       f"{clip(out.response_format)!r}", "response_format")
    temperature = _text(form, "temperature")
    if temperature:
        try:
            out.temperature = float(temperature)
        except ValueError:
            raise APIError(400, f"temperature must be a number, got {clip(temperature)!r}", "temperature") from None
        if not 0.0 <= out.temperature <= 1.0:
            raise APIError(400, "temperature must be between 0 and 1", "temperature")
    grains = [str(v) for k in ("timestamp_granularities[]", "timestamp_granularities") for v in form.getlist(k)]
    bad = [g for g in grains if g not in _GRANULARITIES]
    if bad:
        raise APIError(400, f"timestamp_granularities: {clip(bad[0])!r} is not one of word, segment",
                       "timestamp_granularities")
    out.granularities = set(grains)
    stream = (_text(form, "stream") or "false").lower()
    if stream not in ("true", "false", "1", "0"):
        raise APIError(400, f"stream must be true or false, got {clip(stream)!r}", "stream")
    out.stream = stream in ("true", "1")
    if out.stream and out.response_format not in ("json", "text"):
        raise APIError(400, "stream needs response_format json or text", "stream")
    if out.language is not None and not (2 <= len(out.language) <= 3 and out.language.isalpha()):
        raise APIError(400, f"language must be an ISO-639-1 code such as `en`, got {clip(out.language)!r}",
                       "language")
    return out


def _text(form, name: str) -> str:
    value = form.get(name)
    if value is None:
        return ""
    if isinstance(value, UploadFile):
        raise APIError(400, f"`{name}` must be a text field, not a file", name)
    return str(value).strip()

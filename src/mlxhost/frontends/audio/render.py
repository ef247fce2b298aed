"""A finished transcription in OpenAI's response formats: json, text, srt, vtt and verbose_json.

Works on the job's plain data (segments with start, end, text; words) after the engine is done.
"""

from __future__ import annotations

import math

# Whisper's language codes -> the names verbose_json reports (OpenAI writes "english", not "en").
_NAMES = {"en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian", "ko": "korean",
          "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish", "pl": "polish", "nl": "dutch",
          "it": "italian", "ar": "arabic", "sv": "swedish", "hi": "hindi", "uk": "ukrainian"}
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")


def clock(seconds: float, separator: str) -> str:
    """HH:MM:SS,mmm (srt) or HH:MM:SS.mmm (vtt)."""
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{separator}{ms:03d}"


def srt(segments) -> str:
    return "".join(f"{i}\n{clock(s.start, ',')} --> {clock(s.end, ',')}\n{s.text.strip()}\n\n"
                   for i, s in enumerate(segments, 1))


def vtt(segments) -> str:
    return "WEBVTT\n\n" + "".join(f"{clock(s.start, '.')} --> {clock(s.end, '.')}\n{s.text.strip()}\n\n"
                                  for s in segments)


def duration_usage(job) -> dict:
    # Billed as whole seconds, as OpenAI reports duration usage.
    return {"type": "duration", "seconds": int(math.ceil(job.duration))}


def verbose(job, task: str, granularities: set[str]) -> dict:
    out = {"task": task, "language": _NAMES.get(job.language or "", job.language or ""),
           "duration": round(job.duration, 2), "text": job.text}
    if "segment" in granularities or not granularities:
        out["segments"] = [{"id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text,
                            "tokens": s.tokens, "temperature": _number(s.temperature),
                            "avg_logprob": _number(s.avg_logprob), "compression_ratio": _number(s.compression_ratio),
                            "no_speech_prob": _number(s.no_speech_prob)}
                           for s in job.segments]
    if "word" in granularities:
        out["words"] = [{"word": w["word"].strip(), "start": w["start"], "end": w["end"]}
                        for s in job.segments for w in s.words]
    out["usage"] = duration_usage(job)
    return out


def _number(x) -> float:
    # A window with no text tokens has a NaN mean log probability; JSON has no NaN.
    x = float(x)
    return x if math.isfinite(x) else 0.0

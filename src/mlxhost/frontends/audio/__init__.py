"""OpenAI's audio endpoints: transcriptions and translations (speech to text), speech and voices
(text to speech). HTTP only, no MLX: the models and their jobs live in mlxhost/audio/."""

from __future__ import annotations

from fastapi import FastAPI


def add_audio_routes(app: FastAPI, gateway) -> None:
    # Both import this package (`from mlxhost.frontends.audio import render`): at module level, a cycle.
    from mlxhost.frontends.audio.speech import add_speech_routes
    from mlxhost.frontends.audio.transcriptions import add_transcription_routes

    add_transcription_routes(app, gateway)
    add_speech_routes(app, gateway)

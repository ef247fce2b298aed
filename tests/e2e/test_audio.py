"""Audio endpoints on a live server through the official openai client, unmodified: tiny random
Whisper folders (MLX and faster-whisper layouts) and a tiny random Kokoro beside the tiny chat model.
The models' words are noise by design; these tests check the protocol: every transcription format,
streamed transcript events, translations, speech in streamed chunks, voices, and 400s for bad files,
bad fields and the wrong kind of model. Real speech is tests/realweights/test_transcription.py."""

from __future__ import annotations

import concurrent.futures
import io
import json

import httpx
import numpy as np
import openai
import pytest

from mlxhost.config import EngineConfig, ModelSpec, ServerConfig
from mlxhost.frontends.audio.media import decode_audio
from mlxhost.server.app import build_app
from mlxhost.testing.audio_fixtures import build_tiny_kokoro, build_tiny_whisper, build_tiny_whisper_ct2

# Models load on first use: the server starts without espeak-ng, and only the tests that make Kokoro load (to
# speak, to look up a voice, to find it is no Whisper) need it; the others are answered before any load.
KOKORO_LOADS = pytest.mark.needs("espeak-ng")


def wav_bytes(seconds: float, rate: int = 16000) -> bytes:
    """A 16-bit mono WAV of a tone with some noise (what a client uploads)."""
    import av

    t = np.arange(int(seconds * rate)) / rate
    samples = (0.2 * np.sin(2 * np.pi * 220 * t) + 0.05 * np.random.default_rng(0).standard_normal(t.size))
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray((samples * 32767).astype("<i2").reshape(1, -1), format="s16",
                                           layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="module")
def live(qwen3_model_dir, tmp_path_factory, serve_module_app):
    whisper = build_tiny_whisper(tmp_path_factory.mktemp("whisper"))
    ct2 = build_tiny_whisper_ct2(tmp_path_factory.mktemp("whisper-ct2"), whisper)
    kokoro = build_tiny_kokoro(tmp_path_factory.mktemp("kokoro"))
    specs = (ModelSpec("chat", str(qwen3_model_dir), pinned=True), ModelSpec("whisper", str(whisper)),
             ModelSpec("whisper-ct2", str(ct2)), ModelSpec("kokoro", str(kokoro)))
    return serve_module_app(build_app(ServerConfig(models=specs, engine=EngineConfig(max_num_seqs=4))))


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=600) as c:
        yield c


@pytest.fixture(scope="module")
def audio():
    return wav_bytes(3.0)


def test_models_are_listed(client):
    ids = {m.id for m in client.models.list().data}
    assert {"whisper", "whisper-ct2", "kokoro", "chat"} <= ids


@pytest.mark.parametrize("model", ["whisper", "whisper-ct2"])
def test_json_and_text(client, audio, model):
    out = client.audio.transcriptions.create(model=model, file=("a.wav", audio))
    assert isinstance(out.text, str)
    assert out.usage.seconds == 3
    text = client.audio.transcriptions.create(model=model, file=("a.wav", audio), response_format="text")
    assert isinstance(text, str) and text.endswith("\n")


def test_verbose_json_with_words_and_segments(client, audio):
    out = client.audio.transcriptions.create(model="whisper", file=("a.wav", audio), response_format="verbose_json",
                                             timestamp_granularities=["word", "segment"], language="en")
    assert out.language == "english" and out.duration == pytest.approx(3.0, abs=0.01)
    assert out.words is not None and out.segments is not None
    for seg in out.segments:
        assert 0 <= seg.start <= seg.end and seg.text.strip()
        assert seg.text in out.text or seg.text.strip() in out.text
    for word in out.words:
        assert word.start <= word.end


@pytest.mark.parametrize("fmt,head", [("srt", "1\n"), ("vtt", "WEBVTT\n\n")])
def test_subtitle_formats(client, audio, fmt, head):
    out = client.audio.transcriptions.create(model="whisper", file=("a.wav", audio), response_format=fmt)
    assert isinstance(out, str) and (out.startswith(head) or (fmt == "srt" and out == ""))
    assert "-->" in out or out.strip() in ("", "WEBVTT")


def test_streamed_transcript_events(client, audio):
    long_audio = wav_bytes(40.0)  # two windows: a delta for each window that said something
    events = list(client.audio.transcriptions.create(model="whisper", file=("a.wav", long_audio), stream=True))
    assert events and events[-1].type == "transcript.text.done"
    deltas = [e.delta for e in events[:-1]]
    assert all(e.type == "transcript.text.delta" for e in events[:-1])
    assert "".join(deltas).strip() == events[-1].text


def test_translations(client, audio):
    out = client.audio.translations.create(model="whisper", file=("a.wav", audio))
    assert isinstance(out.text, str)


@pytest.mark.parametrize("data", [b"", b"this is not audio", b"RIFF\x00\x00\x00\x00WAVE"])
def test_bad_files_are_400(client, data):
    with pytest.raises(openai.BadRequestError) as err:
        client.audio.transcriptions.create(model="whisper", file=("bad.wav", data))
    assert err.value.body["param"] == "file"


@pytest.mark.parametrize("fields,param", [({"model": "whisper", "response_format": "xml"}, "response_format"),
                                          ({"model": "whisper", "temperature": "hot"}, "temperature"),
                                          ({"model": "whisper", "tempreature": "0"}, "tempreature"),
                                          ({"model": "whisper", "stream": "true", "response_format": "srt"}, "stream")])
def test_bad_fields_are_400(live, audio, fields, param):
    r = httpx.post(live.base_url + "/audio/transcriptions", data=fields, files={"file": ("a.wav", audio)}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_missing_file_and_json_body_are_400(live):
    r = httpx.post(live.base_url + "/audio/transcriptions", data={"model": "whisper"}, files={"x": ("", b"")})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("file", "x")
    r = httpx.post(live.base_url + "/audio/transcriptions", json={"model": "whisper"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"


@KOKORO_LOADS
def test_wrong_kind_of_model_is_400(client, audio):
    with pytest.raises(openai.BadRequestError):
        client.audio.transcriptions.create(model="chat", file=("a.wav", audio))
    with pytest.raises(openai.BadRequestError):
        client.audio.transcriptions.create(model="kokoro", file=("a.wav", audio))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="whisper", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="nope", file=("a.wav", audio))


def test_transcriptions_and_chat_at_once(client, audio):
    """Two transcriptions on one model and a chat stream run together; each gets its whole answer."""
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        jobs = [pool.submit(client.audio.transcriptions.create, model="whisper", file=("a.wav", audio))
                for _ in range(2)]
        stream = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=16, stream=True)
        chunks = [c for c in stream]
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        assert all(isinstance(j.result().text, str) for j in jobs)


@KOKORO_LOADS
def test_speech_wav(client):
    data = client.audio.speech.create(model="kokoro", voice="af_test", input="Hello.", response_format="wav").read()
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    samples = decode_audio(data, 24000)
    assert 0.05 < len(samples) / 24000 < 10 and np.isfinite(samples).all()


@KOKORO_LOADS
def test_speech_streams_mp3_chunks(client):
    with client.audio.speech.with_streaming_response.create(model="kokoro", voice="am_test", input="Hi. Yes.",
                                                            response_format="mp3", speed=1.5) as resp:
        assert resp.headers["content-type"] == "audio/mpeg"
        parts = [p for p in resp.iter_bytes() if p]
    samples = decode_audio(b"".join(parts), 24000)
    assert len(samples) > 0 and np.isfinite(samples).all()


@KOKORO_LOADS
def test_speech_sse(live):
    body = {"model": "kokoro", "voice": {"id": "af_test"}, "input": "Hi.", "response_format": "pcm",
            "stream_format": "sse"}
    with httpx.stream("POST", live.base_url + "/audio/speech", json=body, timeout=600) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    assert all(e["type"] == "speech.audio.delta" and e["audio"] for e in events[:-1])


def test_voices(live):
    voices = httpx.get(live.base_url + "/audio/voices").json()["voices"]
    assert {(v["id"], v["model"]) for v in voices} == {("af_test", "kokoro"), ("am_test", "kokoro")}
    assert httpx.get(live.base_url + "/audio/voices", params={"model": "whisper"}).json()["voices"] == []


@pytest.mark.parametrize("body,param", [pytest.param({"voice": "nobody", "input": "Hi."}, "voice",
                                                     marks=KOKORO_LOADS),
                                        ({"voice": "af_test", "input": ""}, "input"),
                                        ({"voice": "af_test", "input": "Hi.", "response_format": "ogg"},
                                         "response_format"),
                                        ({"voice": "af_test", "input": "Hi.", "speed": 9}, "speed")])
def test_bad_speech_requests_are_400(live, body, param):
    r = httpx.post(live.base_url + "/audio/speech", json={"model": "kokoro", **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_speech_on_whisper_is_400(client):
    with pytest.raises(openai.BadRequestError):
        client.audio.speech.create(model="whisper", voice="af_test", input="Hi.")


def test_unload_and_load_again_on_use(live, client, audio):
    client.audio.transcriptions.create(model="whisper", file=("a.wav", audio))
    r = httpx.post(live.base_url + "/models/whisper/unload", json={}, timeout=60)
    assert r.status_code == 200
    cards = {c["id"]: c for c in httpx.get(live.base_url + "/models").json()["data"]}
    assert cards["whisper"]["status"] == "not_loaded" and cards["whisper"]["weight_bytes"] > 0
    assert isinstance(client.audio.transcriptions.create(model="whisper", file=("a.wav", audio)).text, str)
    cards = {c["id"]: c for c in httpx.get(live.base_url + "/models").json()["data"]}
    assert cards["whisper"]["status"] == "loaded"

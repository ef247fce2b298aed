"""Audio files through PyAV without a model: every container Whisper requests arrive in decodes to
16 kHz mono float32 of the right length; every speech format encodes, streamed piece by piece, to
audio that decodes back; bytes that are not audio are an AudioDecodeError (the endpoint's 400)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from mlxhost.frontends.audio.media import SPEECH_FORMATS, AudioDecodeError, SpeechEncoder, decode_audio, wav_header
from mlxhost.frontends.audio.render import clock, srt, vtt

RATE = 24000


def tone(seconds: float, rate: int = RATE) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def encode_file(container: str, codec: str, samples: np.ndarray, rate: int = 44100) -> bytes:
    """A whole file in `container` (what a client uploads)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = "stereo"
        resampler = av.AudioResampler(format=stream.codec_context.codec.audio_formats[0].name,
                                      layout="stereo", rate=rate)
        frame = av.AudioFrame.from_ndarray(np.stack([samples, samples]).reshape(1, -1), format="flt",
                                           layout="stereo")
        frame.sample_rate = RATE
        for f in [*resampler.resample(frame), *resampler.resample(None)]:
            for packet in stream.encode(f):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("container,codec", [("wav", "pcm_s16le"), ("mp3", "libmp3lame"), ("ipod", "aac"),
                                             ("ogg", "libopus"), ("flac", "flac"), ("webm", "libopus")])
def test_uploads_decode_to_16k_mono(container, codec):
    data = encode_file(container, codec, tone(2.0), rate=48000 if codec == "libopus" else 44100)
    samples = decode_audio(data)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) / 16000 - 2.0) < 0.1  # encoder padding / priming only
    assert 0.1 < np.abs(samples).max() <= 1.0


@pytest.mark.parametrize("data", [b"", b"not audio at all", wav_header(16000, 0)[:20], b"\x00" * 4096])
def test_bad_bytes_are_a_decode_error(data):
    with pytest.raises(AudioDecodeError):
        decode_audio(data)


@pytest.mark.parametrize("fmt", SPEECH_FORMATS)
def test_speech_formats_stream_and_decode(fmt):
    samples = tone(1.5)
    encoder = SpeechEncoder(fmt, RATE)
    parts = [encoder.encode(samples[i:i + 6000]) for i in range(0, len(samples), 6000)] + [encoder.finish()]
    data = b"".join(parts)
    if fmt == "pcm":
        assert len(data) == 2 * len(samples)
        back = np.frombuffer(data, "<i2").astype(np.float32) / 32767
    else:
        back = decode_audio(data, RATE)
    assert abs(len(back) / RATE - 1.5) < 0.1
    if fmt in ("wav", "pcm", "flac"):  # lossless: the samples themselves come back (16-bit)
        np.testing.assert_allclose(back[:len(samples)], samples, atol=2e-4)


def test_subtitles():
    class S:
        def __init__(self, start, end, text):
            self.start, self.end, self.text = start, end, text

    segments = [S(0.0, 1.5, " Hello."), S(3661.25, 3662.0, " World.")]
    assert clock(3661.25, ",") == "01:01:01,250"
    assert srt(segments) == "1\n00:00:00,000 --> 00:00:01,500\nHello.\n\n2\n01:01:01,250 --> 01:01:02,000\nWorld.\n\n"
    assert vtt(segments).startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello.\n\n")

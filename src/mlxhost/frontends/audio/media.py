"""Audio files in and out, through PyAV (FFmpeg): any container FFmpeg reads, decoded to 16 kHz mono
float32 for Whisper; synthesized float32 samples encoded to mp3 / opus / aac / flac / wav / pcm as a
stream of byte chunks. Numpy only, no MLX: this runs on the HTTP side, off the event loop."""

from __future__ import annotations

import io
import struct

import numpy as np

WHISPER_RATE = 16000
# The most seconds of audio one request may carry: Whisper reads it all into one spectrogram.
MAX_AUDIO_S = 4 * 3600.0


class AudioDecodeError(ValueError):
    """Bytes that are not a readable audio file; the message says why (the client's 400)."""


def decode_audio(data: bytes, rate: int = WHISPER_RATE) -> np.ndarray:
    """The first audio stream of `data` (wav, mp3, m4a, ogg, flac, webm, ...) as mono float32 at `rate`."""
    import av  # PyAV (the audio extra): loaded only when audio is decoded

    if not data:
        raise AudioDecodeError("the file is empty")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise AudioDecodeError(f"not a readable audio file: {exc}") from None
    chunks: list[np.ndarray] = []
    with container:
        if not container.streams.audio:
            raise AudioDecodeError("the file has no audio stream")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        total = 0
        try:
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    total += chunks[-1].size
                if total > MAX_AUDIO_S * rate:
                    raise AudioDecodeError(f"the audio is longer than {MAX_AUDIO_S / 3600:g} hours")
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
        except av.FFmpegError as exc:
            raise AudioDecodeError(f"the audio cannot be decoded: {exc}") from None
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise AudioDecodeError("the file holds no audio samples")
    return samples.astype(np.float32, copy=False)


# response_format -> (container, codec, sample format) for the formats FFmpeg encodes.
_CODECS = {"mp3": ("mp3", "libmp3lame", "s16p"), "opus": ("ogg", "libopus", "s16"),
           "aac": ("adts", "aac", "fltp"), "flac": ("flac", "flac", "s16")}
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
CONTENT_TYPES = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac",
                 "wav": "audio/wav", "pcm": "audio/pcm"}


class _Sink(io.RawIOBase):
    """A write-only file that hands over what was written since the last `take`."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False  # streamed: muxers must not go back to patch headers

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self._parts = b"".join(self._parts), []
        return out


def _pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


class SpeechEncoder:
    """Float32 mono samples in, bytes of `fmt` out, piece by piece (each `encode` returns what is
    ready, `finish` the rest). pcm is raw 16-bit little-endian; wav a streaming header (sizes unknown,
    so set to the maximum, as streamed WAV does) and the same samples."""

    def __init__(self, fmt: str, rate: int) -> None:
        if fmt not in SPEECH_FORMATS:
            raise ValueError(f"unknown audio format {fmt!r}")
        self.fmt, self.rate = fmt, rate
        self._header_sent = False
        self._container = self._stream = self._sink = None
        if fmt in _CODECS:
            import av  # PyAV (the audio extra): loaded only when audio is encoded

            container_name, codec, self._sample_format = _CODECS[fmt]
            self._sink = _Sink()
            self._container = av.open(self._sink, mode="w", format=container_name)
            self._stream = self._container.add_stream(codec, rate=rate)
            self._stream.layout = "mono"
            self._resampler = av.AudioResampler(format=self._sample_format, layout="mono", rate=rate)

    def encode(self, samples: np.ndarray) -> bytes:
        if self.fmt == "pcm":
            return _pcm16(samples)
        if self.fmt == "wav":
            head = b"" if self._header_sent else wav_header(self.rate)
            self._header_sent = True
            return head + _pcm16(samples)
        import av  # PyAV (the audio extra): loaded only when audio is encoded

        frame = av.AudioFrame.from_ndarray(np.asarray(samples, np.float32).reshape(1, -1), format="flt",
                                           layout="mono")
        frame.sample_rate = self.rate
        for out in self._resampler.resample(frame):
            for packet in self._stream.encode(out):
                self._container.mux(packet)
        return self._sink.take()

    def finish(self) -> bytes:
        if self._container is None:
            return b"" if self._header_sent or self.fmt == "pcm" else wav_header(self.rate)
        for out in self._resampler.resample(None):
            for packet in self._stream.encode(out):
                self._container.mux(packet)
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.take()


def wav_header(rate: int, num_bytes: int = 0xFFFFFFFF - 36) -> bytes:
    """A 16-bit mono PCM WAV header; the default sizes say "until the stream ends"."""
    return (b"RIFF" + struct.pack("<I", min(num_bytes + 36, 0xFFFFFFFF)) + b"WAVEfmt "
            + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16) + b"data" + struct.pack("<I", num_bytes))

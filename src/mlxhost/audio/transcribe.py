"""Transcription as a job the engine thread advances one 30-second window at a time.

The window loop follows Whisper's own long-form procedure: each window is decoded with timestamps
(mlx-audio's `decode`), cut into segments at timestamp pairs, and the next window starts where the
last complete segment ended; a window that fails the compression-ratio or log-probability checks is
decoded again at the next temperature; the text so far prompts the next window. One `advance` per
window lets several requests take turns on one model and lets a stream show each window's text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_audio.stt.models.whisper.audio import (
    HOP_LENGTH,
    N_FRAMES,
    N_SAMPLES,
    SAMPLE_RATE,
    log_mel_spectrogram,
    pad_or_trim,
)
from mlx_audio.stt.models.whisper.decoding import DecodingOptions
from mlx_audio.stt.models.whisper.timing import add_word_timestamps

_FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
_COMPRESSION_RATIO_MAX = 2.4  # above: the window repeats itself
_LOGPROB_MIN = -1.0  # below (mean token log probability): too unsure
_NO_SPEECH_MIN = 0.6  # a window this likely silent (and unsure) yields no segment
_TIME_PRECISION = 0.02  # seconds per timestamp token


@dataclass
class TranscribeOptions:
    """What a request asks for, as plain data (frontends/audio/transcriptions.py builds it)."""

    task: str = "transcribe"  # or "translate" (to English)
    language: str | None = None  # None: detected from the first window (multilingual models)
    prompt: str | None = None
    temperature: float = 0.0  # 0: the fallback ladder; above 0: that temperature only
    word_timestamps: bool = False
    condition_on_previous_text: bool = True


@dataclass
class Segment:
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: list[dict] = field(default_factory=list)


class TranscriptionJob:
    """One request's audio (16 kHz mono float32). Engine thread only: `advance(core)` decodes the next
    window; `segments` grows, `take_delta()` returns the text added since the last call."""

    def __init__(self, samples: np.ndarray, options: TranscribeOptions) -> None:
        self.samples, self.options = samples, options
        self.segments: list[Segment] = []
        self.language: str | None = options.language
        self.duration = len(samples) / SAMPLE_RATE
        self.done = False
        self._mel: mx.array | None = None
        self._seek = 0
        self._content_frames = 0
        self._prompt_tokens: list[int] = []
        self._prompt_from = 0
        self._emitted = 0

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments).strip()

    def take_delta(self) -> str:
        """Text of the segments finished since the last call (the first without its leading space)."""
        new = "".join(s.text for s in self.segments[self._emitted:])
        if self._emitted == 0:
            new = new.lstrip()
        self._emitted = len(self.segments)
        return new

    def advance(self, core) -> bool:
        """Decodes the next window on the engine thread; True once the whole file is done."""
        net = core.model.net
        if self._mel is None:
            self._start(net)
        if self._seek < self._content_frames:
            self._window(net)
        self.done = self._seek >= self._content_frames
        if self.done:
            self._mel = None  # the spectrogram of a long file is the job's largest array
        return self.done

    def _start(self, net) -> None:
        self._mel = log_mel_spectrogram(mx.array(self.samples), n_mels=net.dims.n_mels, padding=N_SAMPLES)
        self._content_frames = self._mel.shape[0] - N_FRAMES
        if self.language is None:
            if net.is_multilingual:
                first = pad_or_trim(self._mel, N_FRAMES, axis=-2).astype(net.dtype)
                _, probs = net.detect_language(first, net.get_tokenizer(task=self.options.task))
                self.language = max(probs, key=probs.get)
            else:
                self.language = "en"
        tokenizer = net.get_tokenizer(language=self.language, task=self.options.task)
        if self.options.prompt:
            self._prompt_tokens = tokenizer.encode(" " + self.options.prompt.strip())

    def _window(self, net) -> None:
        tokenizer = net.get_tokenizer(language=self.language, task=self.options.task)
        seek = self._seek
        time_offset = seek * HOP_LENGTH / SAMPLE_RATE
        size = min(N_FRAMES, self._content_frames - seek)
        window = pad_or_trim(self._mel[seek:seek + size], N_FRAMES, axis=-2).astype(net.dtype)
        # Encoded once: `decode` takes features in place of a spectrogram, so fallbacks skip the encoder.
        features = encode(net, window[None])
        result = self._decode(net, features)
        tokens = list(result.tokens)
        if result.no_speech_prob > _NO_SPEECH_MIN and result.avg_logprob < _LOGPROB_MIN:
            self._seek += size  # silence: nothing to say here
            return
        begin = tokenizer.timestamp_begin
        is_time = [t >= begin for t in tokens]
        pieces: list[tuple[float, float, list[int]]] = []
        cuts = [i for i in range(1, len(tokens)) if is_time[i] and is_time[i - 1]]
        single_ending = is_time[-2:] == [False, True]
        if cuts:
            last = 0
            for cut in cuts + ([len(tokens)] if single_ending else []):
                part = tokens[last:cut]
                pieces.append((time_offset + (part[0] - begin) * _TIME_PRECISION,
                               time_offset + (part[-1] - begin) * _TIME_PRECISION, part))
                last = cut
            # Resume after the last complete segment, else after the whole window.
            next_seek = seek + size if single_ending else seek + (tokens[last - 1] - begin) * 2
        else:
            stamps = [t for t in tokens if t >= begin]
            duration = size * HOP_LENGTH / SAMPLE_RATE
            if stamps and stamps[-1] != begin:
                duration = (stamps[-1] - begin) * _TIME_PRECISION
            pieces.append((time_offset, time_offset + duration, tokens))
            next_seek = seek + size
        new = []
        for start, end, part in pieces:
            text_tokens = [t for t in part if t < tokenizer.eot]
            text = tokenizer.decode(text_tokens)
            if not text.strip():
                continue
            new.append(Segment(len(self.segments) + len(new), seek, round(start, 2), round(end, 2), text,
                               part, result.temperature, result.avg_logprob, result.compression_ratio,
                               result.no_speech_prob))
        if self.options.word_timestamps and new:
            self._add_words(net, tokenizer, new, window, size)
        for seg in new:  # a confused model can say times past the end or out of order
            seg.end = _clamp(seg.end, 0.0, self.duration)
            seg.start = _clamp(seg.start, 0.0, seg.end)
            for w in seg.words:
                w["end"] = _clamp(w["end"], seg.start, seg.end)
                w["start"] = _clamp(w["start"], seg.start, w["end"])
        self.segments.extend(new)
        self._prompt_tokens += [t for s in new for t in s.tokens if t < tokenizer.eot]
        if not self.options.condition_on_previous_text or result.temperature > 0.5:
            self._prompt_from = len(self._prompt_tokens)  # a shaky window must not steer the next
        self._seek = max(next_seek, seek + 1)

    def _decode(self, net, features: mx.array):
        t0 = self.options.temperature
        temperatures = _FALLBACK_TEMPERATURES if t0 == 0 else (t0,)
        result = None
        for t in temperatures:
            options = DecodingOptions(task=self.options.task, language=self.language, temperature=t,
                                      prompt=self._prompt_tokens[self._prompt_from:] or None,
                                      fp16=net.dtype == mx.float16)
            result = net.decode(features, options)[0]
            if result.no_speech_prob > _NO_SPEECH_MIN and result.avg_logprob < _LOGPROB_MIN:
                break  # silence: a hotter decode would only invent words
            if result.compression_ratio <= _COMPRESSION_RATIO_MAX and result.avg_logprob >= _LOGPROB_MIN:
                break
        return result

    def _add_words(self, net, tokenizer, segments: list[Segment], window: mx.array, size: int) -> None:
        dicts = [{"seek": s.seek, "start": s.start, "end": s.end, "tokens": s.tokens, "text": s.text}
                 for s in segments]
        last_end = self.segments[-1].end if self.segments else 0.0
        add_word_timestamps(segments=dicts, model=net, tokenizer=tokenizer, mel=window, num_frames=size,
                            last_speech_timestamp=last_end)
        for seg, d in zip(segments, dicts):
            seg.words = [{"word": w["word"], "start": w["start"], "end": w["end"]} for w in d.get("words", [])]
            seg.start, seg.end = d["start"], d["end"]


def encode(net, mel: mx.array) -> mx.array:
    """The audio encoder's output, evaluated block by block (mlx-audio's AudioEncoder, step by step):
    on a CPU one window's encoder is seconds of work, and another engine thread's decode step (a chat
    stream) waits at most one block for it, not the whole window."""
    enc = net.encoder
    x = nn.gelu(enc.conv2(nn.gelu(enc.conv1(mel)))) + enc._positional_embedding
    mx.eval(x)
    for block in enc.blocks:
        x, _, _ = block(x)
        mx.eval(x)
    return enc.ln_post(x)


def _clamp(x: float, low: float, high: float) -> float:
    return round(min(max(float(x), low), high), 2)

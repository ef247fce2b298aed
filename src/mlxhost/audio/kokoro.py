"""Kokoro text to speech: mlx-audio's Kokoro network, phonemes from Debian's espeak-ng.

mlx-audio's own Kokoro pipeline phonemizes with misaki, which fetches a spaCy model at run time;
the network itself is language-blind and takes a phoneme string (its config's `vocab` maps each
phoneme character to an id). So text goes to espeak-ng's IPA output (as the kokoro-onnx project
does), sentence by sentence; each sentence is one `advance` on the engine thread, and its samples
are streamed as soon as they exist. Voices are the folder's voices/NAME.safetensors style packs.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxhost.audio.detect import read_voices
from mlxhost.models.loader import ModelLoadError

log = logging.getLogger(__name__)

_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+|\n+")
_MAX_PHONEMES = 400  # per piece; Kokoro's context is 512 positions
_ESPEAK_TIMEOUT_S = 30


@dataclass
class KokoroModel:
    net: Any  # mlx_audio.tts.models.kokoro.Model
    voice_files: dict[str, Path]
    espeak_voice: str = "en-us"
    packs: dict[str, mx.array] = field(default_factory=dict)  # loaded on first use, engine thread
    kind = "kokoro"
    task = "speech"
    is_audio = True
    is_encoder = False
    is_vlm = False

    @property
    def sample_rate(self) -> int:
        return int(self.net.sample_rate)

    @property
    def voices(self) -> tuple[str, ...]:
        return tuple(self.voice_files)

    def voice(self, name: str) -> mx.array:
        if name not in self.packs:
            self.packs[name] = mx.load(str(self.voice_files[name]))["voice"]
        return self.packs[name]


def load_kokoro(folder: Path, config: dict) -> KokoroModel:
    from mlx_audio.tts.utils import load_model  # optional: the audio extra

    if shutil.which("espeak-ng") is None:
        raise ModelLoadError(f"{folder}: Kokoro speaks phonemes from espeak-ng, which is not installed "
                             "(apt-get install espeak-ng / brew install espeak-ng)")
    voices = {name: folder / "voices" / f"{name}.safetensors" for name in read_voices(folder)}
    if not voices:
        raise ModelLoadError(f"{folder}: a Kokoro folder needs voices/NAME.safetensors style packs")
    try:
        net = load_model(folder, strict=True, model_type="kokoro")
    except (ValueError, FileNotFoundError) as exc:
        raise ModelLoadError(f"{folder}: mlx-audio cannot load this Kokoro folder: {exc}") from None
    return KokoroModel(net, voices, str(config.get("espeak_voice", "en-us")))


def split_sentences(text: str, max_chars: int = 300) -> list[str]:
    """Sentences (long ones cut at spaces), the units synthesized and streamed one at a time."""
    out = []
    for sentence in _SENTENCE_END.split(text):
        sentence = sentence.strip()
        while len(sentence) > max_chars:
            cut = sentence.rfind(" ", 0, max_chars)
            cut = cut if cut > 0 else max_chars
            out.append(sentence[:cut].strip())
            sentence = sentence[cut:].strip()
        if sentence:
            out.append(sentence)
    return out


def phonemize(text: str, espeak_voice: str, vocab: dict) -> str:
    """espeak-ng's IPA for `text`, kept to the characters the model knows, with the sentence's final
    punctuation (Kokoro pauses and intones on it)."""
    result = subprocess.run(["espeak-ng", "-q", "--ipa", "-v", espeak_voice, "--stdin"], input=text,
                            capture_output=True, text=True, timeout=_ESPEAK_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"espeak-ng failed: {result.stderr.strip()[:300]}")
    phonemes = " ".join(line.strip() for line in result.stdout.splitlines() if line.strip())
    if text[-1:] in ".!?,;:" and text[-1] in vocab:
        phonemes += text[-1]
    return "".join(c for c in phonemes if c in vocab)[:_MAX_PHONEMES]


class SpeechJob:
    """One request's text; each `advance(core)` speaks the next sentence and returns its float32
    samples (None once every sentence is spoken)."""

    def __init__(self, text: str, voice: str, speed: float = 1.0) -> None:
        self.sentences = split_sentences(text)
        self.voice, self.speed = voice, speed
        self.index = 0
        self.num_samples = 0

    def advance(self, core) -> np.ndarray | None:
        model: KokoroModel = core.model
        while self.index < len(self.sentences):
            sentence = self.sentences[self.index]
            self.index += 1
            phonemes = phonemize(sentence, model.espeak_voice, model.net.vocab)
            if not phonemes:
                continue  # nothing speakable (symbols only)
            pack = model.voice(self.voice)
            style = pack[min(len(phonemes), pack.shape[0]) - 1]  # packs hold one style per length
            audio = model.net(phonemes, style, speed=self.speed)
            samples = np.array(audio, dtype=np.float32).reshape(-1)
            self.num_samples += samples.size
            return samples
        return None

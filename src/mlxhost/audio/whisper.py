"""Whisper folders in any of three layouts, loaded into mlx-audio's Whisper model.

mlx-audio supplies the network and its 30-second-window decoder (`decode`, temperature, timestamp
rules); the tokenizer comes from the folder's tokenizer.json through transformers, so an MLX folder,
a Hugging Face folder and a faster-whisper folder all decode the same way. Nothing here reaches the
Hugging Face hub: every file is read from the folder.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_audio.stt.models.whisper.whisper import HFTokenizerWrapper, Model, ModelDimensions

from mlxhost.audio.ct2 import CT2FormatError, read_model_bin, whisper_from_ct2
from mlxhost.audio.detect import whisper_layout
from mlxhost.models.loader import ModelLoadError

log = logging.getLogger(__name__)


class WhisperNet(Model):
    """mlx-audio's Whisper with the folder's own tokenizer (its base class builds one through
    transformers' WhisperProcessor, which needs preprocessor files that faster-whisper folders lack)."""

    def __init__(self, dims: ModelDimensions, dtype: mx.Dtype, hf_tokenizer: Any) -> None:
        super().__init__(dims, dtype)
        self._hf_tokenizer = hf_tokenizer

    def get_tokenizer(self, language: str | None = None, task: str = "transcribe"):
        return HFTokenizerWrapper(self._hf_tokenizer, multilingual=self.is_multilingual,
                                  num_languages=self.num_languages, language=language, task=task)


@dataclass
class WhisperModel:
    """A loaded Whisper: what the transcription jobs (audio/transcribe.py) run on."""

    net: WhisperNet
    layout: str  # "mlx", "hf" or "ct2"
    kind = "whisper"
    task = "transcription"
    is_audio = True  # LoadedModel / server.load_served read these
    is_encoder = False
    is_vlm = False

    @property
    def multilingual(self) -> bool:
        return self.net.is_multilingual


def compute_dtype() -> mx.Dtype:
    # float16 halves the weights on a GPU; on the CPU float32 is the fast path (and the exact one).
    return mx.float16 if mx.default_device() == mx.gpu else mx.float32


def load_whisper(folder: str | Path, config: dict) -> WhisperModel:
    folder = Path(folder)
    layout = whisper_layout(config)
    start = time.perf_counter()
    if layout == "ct2":
        dims, weights, heads = _ct2_weights(folder, config)
    elif layout == "hf":
        dims, weights, heads = _hf_weights(folder, config)
    else:
        dims, weights, heads = _mlx_weights(folder, config)
    net = WhisperNet(ModelDimensions.from_dict(dims), compute_dtype(), load_tokenizer(folder))
    quantization = config.get("quantization") if layout == "mlx" else None
    if quantization:
        nn.quantize(net, **quantization, class_predicate=lambda p, m: f"{p}.scales" in weights)
    weights = net.sanitize({k: v if isinstance(v, mx.array) else mx.array(v) for k, v in weights.items()})
    try:
        net.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"{folder}: the weights do not fit a Whisper of this config: {exc}") from None
    if heads is not None:
        net.set_alignment_heads(heads)
    mx.eval(net.parameters())
    log.info("loaded Whisper %s (%s layout, %d+%d layers, vocab %d) in %.2f s", folder, layout,
             net.dims.n_audio_layer, net.dims.n_text_layer, net.dims.n_vocab, time.perf_counter() - start)
    return WhisperModel(net, layout)


def load_tokenizer(folder: Path):
    """The folder's Whisper tokenizer (tokenizer.json, else the vocab.json + merges.txt pair)."""
    from transformers import PreTrainedTokenizerFast  # lazy: transformers only when used

    special = {"eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    if (folder / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **special)
    elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        from transformers import WhisperTokenizerFast  # lazy: transformers only when used

        tokenizer = WhisperTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    else:
        raise ModelLoadError(f"{folder}: no tokenizer.json (nor vocab.json + merges.txt): copy the tokenizer "
                             "files of the matching openai/whisper-* model into the folder")
    return with_timestamp_tokens(tokenizer, folder)


def with_timestamp_tokens(tokenizer, folder: Path):
    """Older tokenizer files (faster-whisper's among them) stop at <|notimestamps|>: the model's 1501
    timestamp ids (<|0.00|> ... <|30.00|>, 0.02 s apart) follow it, so they are added in that place."""
    vocab = tokenizer.get_vocab()
    if "<|0.00|>" in vocab:
        return tokenizer
    no_timestamps = vocab.get("<|notimestamps|>")
    if no_timestamps is None or len(tokenizer) != no_timestamps + 1:
        raise ModelLoadError(f"{folder}: the tokenizer has no timestamp tokens and no <|notimestamps|> as "
                             "its last token to add them after")
    tokenizer.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(1501)], special_tokens=True)
    return tokenizer


def _mlx_weights(folder: Path, config: dict):
    for name in ("weights.safetensors", "model.safetensors", "weights.npz"):
        if (folder / name).is_file():
            weights = mx.load(str(folder / name))
            break
    else:
        raise ModelLoadError(f"{folder}: an MLX Whisper folder needs weights.safetensors or weights.npz")
    return config, weights, _heads_from(folder / "generation_config.json") or config.get("alignment_heads")


def _hf_weights(folder: Path, config: dict):
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: a Hugging Face Whisper folder needs its .safetensors weights")
    weights = {}
    for f in files:
        weights.update(mx.load(str(f)))
    weights.pop("proj_out.weight", None)  # tied to the token embedding
    return config, weights, _heads_from(folder / "generation_config.json")


def _ct2_weights(folder: Path, config: dict):
    path = folder / "model.bin"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: a faster-whisper (CTranslate2) folder needs model.bin")
    try:
        spec, variables = read_model_bin(path)
        if spec != "WhisperSpec":
            raise CT2FormatError(f"{path} holds a CTranslate2 {spec}, not a Whisper model")
        dims, weights = whisper_from_ct2(variables)
    except (CT2FormatError, KeyError) as exc:
        raise ModelLoadError(f"{folder}: {exc}") from None
    weights = {k: np.ascontiguousarray(v) for k, v in weights.items()}
    return dims, weights, config.get("alignment_heads")


def _heads_from(path: Path):
    try:
        return json.loads(path.read_text()).get("alignment_heads")
    except (OSError, ValueError):
        return None

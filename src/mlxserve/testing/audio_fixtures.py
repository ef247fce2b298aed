"""Tiny random-weight audio model folders for tests: a Whisper (MLX layout, or the faster-whisper
layout) and a Kokoro, built offline in a second or two. Their output is noise by design: tests check
the protocol and the audio's validity, real speech is the real-weights tier's job."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

# Whisper's special tokens after the byte-level vocabulary, in the English-only models' order.
_WHISPER_SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>",
                     "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
_TIMESTAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]


def whisper_tokenizer_json(path: Path) -> int:
    """A byte-level BPE with no merges plus Whisper's specials; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_WHISPER_SPECIALS + _TIMESTAMPS)
    tok.save(str(path))
    return tok.get_vocab_size()


def build_tiny_whisper(out: str | Path, seed: int = 0, n_text_ctx: int = 64) -> Path:
    """An English-only Whisper: 1 encoder + 1 decoder layer of width 64, mlx-whisper's folder layout."""
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n_vocab = whisper_tokenizer_json(out / "tokenizer.json")
    dims = {"n_mels": 80, "n_audio_ctx": 1500, "n_audio_state": 64, "n_audio_head": 2, "n_audio_layer": 1,
            "n_vocab": n_vocab, "n_text_ctx": n_text_ctx, "n_text_state": 64, "n_text_head": 2, "n_text_layer": 1}
    mx.random.seed(seed)
    model = Model(ModelDimensions(**dims), mx.float32)
    weights = {k: v for k, v in tree_flatten(model.parameters())}
    weights["decoder.positional_embedding"] = mx.random.normal((n_text_ctx, 64)) * 0.02
    mx.save_safetensors(str(out / "weights.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(dims, indent=1))
    return out


def build_tiny_kokoro(out: str | Path, seed: int = 0, voices=("af_test", "am_test")) -> Path:
    """A Kokoro with one layer where it can (its decoder's 512 and 1024 widths are fixed by mlx-audio)."""
    from mlx_audio.tts.models.kokoro.kokoro import Model, ModelConfig

    out = Path(out)
    (out / "voices").mkdir(parents=True, exist_ok=True)
    symbols = list(";:,.!?—…\"()“” ") + list("abcdefhijklmnopqrstuvwxyz") + list(
        "ɑɐɒæɓʙβɔɕçɗɖðʤəɘɚɛɜɝɞɟʄɡɠɢʛɦɧħɥʜɨɪʝɭɬɫɮʟɱɯɰŋɳɲɴøɵɸθœɶʘɹɺɾɻʀʁɽʂʃʈʧʉʊʋⱱʌɣɤʍχʎʏʑʐʒʔʡʕʢǀǁǂǃˈˌːˑʼʴʰʱʲʷˠˤ˞↓↑→↗↘'̩'ᵻ")
    vocab = {ch: i + 1 for i, ch in enumerate(dict.fromkeys(symbols))}
    config = {
        "model_type": "kokoro", "dim_in": 64, "dropout": 0.0, "hidden_dim": 512, "max_conv_dim": 512,
        "max_dur": 4, "multispeaker": True, "n_layer": 1, "n_mels": 80, "n_token": 178, "style_dim": 128,
        "text_encoder_kernel_size": 5, "sample_rate": 24000, "vocab": vocab,
        "plbert": {"hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 128,
                   "max_position_embeddings": 512, "num_hidden_layers": 1, "dropout": 0.0, "embedding_size": 32},
        "istftnet": {"upsample_kernel_sizes": [20, 12], "upsample_rates": [10, 6], "gen_istft_hop_size": 5,
                     "gen_istft_n_fft": 20, "resblock_dilation_sizes": [[1, 3, 5]], "resblock_kernel_sizes": [3],
                     "upsample_initial_channel": 512},
    }
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    # mlx-audio starts weight-normalized convolutions at all-ones directions: random, activations grow
    # ~20x per decoder block and the output is NaN. Random directions at half gain keep it finite.
    params = dict(tree_flatten(model.parameters()))
    model.load_weights([(k, mx.random.normal(v.shape)) for k, v in params.items() if k.endswith("weight_v")]
                       + [(k, v * 0.5) for k, v in params.items() if k.endswith("weight_g")], strict=False)
    mx.save_safetensors(str(out / "kokoro.safetensors"), _as_checkpoint(model))
    (out / "config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    rng = np.random.default_rng(seed)
    for name in voices:
        pack = (rng.standard_normal((510, 1, 256)) * 0.1).astype(np.float32)
        mx.save_safetensors(str(out / "voices" / f"{name}.safetensors"), {"voice": mx.array(pack)})
    return out


def _as_checkpoint(model) -> dict:
    """The parameters laid out as mlx-audio expects a Kokoro checkpoint on disk: where its `sanitize`
    turns a convolution weight from PyTorch's layout, the file holds that layout."""
    out = {}
    for key, value in tree_flatten(model.parameters()):
        (got,) = model.sanitize({key: value}).values() or (value,)
        out[key] = value.swapaxes(1, 2) if got.shape != value.shape else value
    return out

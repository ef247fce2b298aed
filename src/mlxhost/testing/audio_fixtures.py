"""Tiny random-weight audio model folders for tests: a Whisper (MLX layout, or the faster-whisper
layout) and a Kokoro, built offline in a second or two. Their output is noise by design: tests check
the protocol and the audio's validity, real speech is the real-weights tier's job."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

# Whisper's special tokens after the byte-level vocabulary, in the English-only models' order.
_WHISPER_SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>",
                     "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]
_TIMESTAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]


def whisper_tokenizer_json(path: Path) -> int:
    """A byte-level BPE with no merges plus Whisper's specials; returns the vocabulary size."""
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
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions  # optional: the audio extra

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
    from mlx_audio.tts.models.kokoro.kokoro import Model, ModelConfig  # optional: the audio extra

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


def build_tiny_whisper_ct2(out: str | Path, mlx_folder: str | Path, float16: bool = True) -> Path:
    """The faster-whisper (CTranslate2) layout of a tiny MLX Whisper folder: model.bin with fused
    projections and PyTorch-layout convolutions, a decoding-settings config.json, and a tokenizer.json
    without timestamp tokens (as faster-whisper's own folders ship it)."""
    out, mlx_folder = Path(out), Path(mlx_folder)
    out.mkdir(parents=True, exist_ok=True)
    dims = json.loads((mlx_folder / "config.json").read_text())
    w = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(mlx_folder / "weights.safetensors")).items()}
    variables: list[tuple[str, np.ndarray]] = []
    add = lambda name, value: variables.append((name, value))
    for side in ("encoder", "decoder"):
        for i in range(dims[f"n_{'audio' if side == 'encoder' else 'text'}_layer"]):
            b, c = f"{side}.blocks.{i}.", f"{side}/layer_{i}/"
            attn = [("self_attention", "attn", ("query", "key", "value"), "linear_1")]
            if side == "decoder":
                attn.append(("attention", "cross_attn", None, None))
            for ct2, mlx, fused, out_name in attn:
                add(c + f"{ct2}/layer_norm/gamma", w[b + f"{mlx}_ln.weight"])
                add(c + f"{ct2}/layer_norm/beta", w[b + f"{mlx}_ln.bias"])
                zero = np.zeros_like(w[b + f"{mlx}.query.bias"])
                if fused:  # self-attention: [q; k; v] in linear_0, output in linear_1
                    groups = [("linear_0", ("query", "key", "value")), ("linear_1", ("out",))]
                else:  # cross-attention: q in linear_0, [k; v] in linear_1, output in linear_2
                    groups = [("linear_0", ("query",)), ("linear_1", ("key", "value")), ("linear_2", ("out",))]
                for linear, names in groups:
                    add(c + f"{ct2}/{linear}/weight", np.concatenate([w[b + f"{mlx}.{n}.weight"] for n in names]))
                    add(c + f"{ct2}/{linear}/bias", np.concatenate(
                        [w.get(b + f"{mlx}.{n}.bias", zero) for n in names]))
            for leaf, name in (("gamma", "weight"), ("beta", "bias")):
                add(c + f"ffn/layer_norm/{leaf}", w[b + f"mlp_ln.{name}"])
            for j, name in enumerate(("mlp1", "mlp2")):
                add(c + f"ffn/linear_{j}/weight", w[b + f"{name}.weight"])
                add(c + f"ffn/linear_{j}/bias", w[b + f"{name}.bias"])
    for conv in ("conv1", "conv2"):
        add(f"encoder/{conv}/weight", w[f"encoder.{conv}.weight"].transpose(0, 2, 1))
        add(f"encoder/{conv}/bias", w[f"encoder.{conv}.bias"])
    for side, name in (("encoder", "ln_post"), ("decoder", "ln")):
        add(f"{side}/layer_norm/gamma", w[f"{side}.{name}.weight"])
        add(f"{side}/layer_norm/beta", w[f"{side}.{name}.bias"])
    add("encoder/position_encodings/encodings", np.zeros((dims["n_audio_ctx"], dims["n_audio_state"]), np.float32))
    add("decoder/embeddings/weight", w["decoder.token_embedding.weight"])
    add("decoder/position_encodings/encodings", w["decoder.positional_embedding"])
    scalars = [("encoder/num_heads", dims["n_audio_head"]), ("decoder/num_heads", dims["n_text_head"])]
    _write_model_bin(out / "model.bin", variables, scalars, float16)
    (out / "config.json").write_text(json.dumps({"alignment_heads": [[0, 0]], "lang_ids": [],
                                                 "suppress_ids": [], "suppress_ids_begin": [220]}))

    tok = json.loads(Tokenizer.from_file(str(mlx_folder / "tokenizer.json")).to_str())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] not in _TIMESTAMPS]
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


def _write_model_bin(path: Path, variables, scalars, float16: bool) -> None:
    """CTranslate2's binary layout (version 6), as audio/ct2.py reads it."""
    def string(text: str) -> bytes:
        raw = text.encode() + b"\0"
        return struct.pack("<H", len(raw)) + raw

    parts = [struct.pack("<I", 6), string("WhisperSpec"), struct.pack("<I", 3),
             struct.pack("<I", len(variables) + len(scalars))]
    for name, value in variables:
        value = value.astype(np.float16 if float16 else np.float32)
        parts += [string(name), struct.pack("<B", value.ndim), struct.pack(f"<{value.ndim}I", *value.shape),
                  struct.pack("<B", 4 if float16 else 0), struct.pack("<I", value.nbytes), value.tobytes()]
    for name, number in scalars:
        parts += [string(name), struct.pack("<B", 0), struct.pack("<B", 2), struct.pack("<I", 2),
                  struct.pack("<h", number)]
    parts += [struct.pack("<I", 1), string("decoder/projection/weight"), string("decoder/embeddings/weight")]
    path.write_bytes(b"".join(parts))

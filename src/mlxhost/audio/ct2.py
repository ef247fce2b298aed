"""faster-whisper / CTranslate2 Whisper folders: model.bin read with numpy, renamed to mlx-audio's Whisper.

model.bin (binary version 5 or 6) is: u32 version, string spec name ("WhisperSpec"), u32 revision,
u32 count, then per variable: string name, u8 rank, u32 dims, u8 dtype, u32 byte count, raw bytes;
then u32 count of aliases (string alias, string target). A string is a u16 length (with its NUL) and
the UTF-8 bytes and a NUL. Numbers are little-endian. int8 weights carry a per-row `weight_scale`.
Reading it takes no CTranslate2 install: the 75 MB tiny.en file is parsed in well under a second.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np

# CTranslate2's DataType enum, in its order.
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}


class CT2FormatError(ValueError):
    """A model.bin this reader does not understand (the message names the file and what is off)."""


def read_model_bin(path: str | Path) -> tuple[str, dict[str, np.ndarray]]:
    """(spec name, {variable name: array}) with aliases resolved to their targets' arrays."""
    data = Path(path).read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal pos
        (n,) = take("H")
        text = data[pos:pos + n - 1].decode("utf-8")
        pos += n
        return text

    try:
        (version,) = take("I")
        if version not in (5, 6):
            raise CT2FormatError(f"{path}: CTranslate2 binary version {version}; only 5 and 6 are read")
        spec = string()
        take("I")  # revision
        (count,) = take("I")
        variables: dict[str, np.ndarray] = {}
        for _ in range(count):
            name = string()
            (rank,) = take("B")
            shape = take("I" * rank) if rank else ()
            (dtype_id,) = take("B")
            (num_bytes,) = take("I")
            raw = data[pos:pos + num_bytes]
            pos += num_bytes
            variables[name] = _array(raw, dtype_id, shape, path, name)
        (num_aliases,) = take("I")
        for _ in range(num_aliases):
            alias, target = string(), string()
            variables[alias] = variables[target]
    except CT2FormatError:
        raise
    except (struct.error, ValueError, UnicodeDecodeError) as exc:  # a short read, a garbled name
        raise CT2FormatError(f"{path}: truncated or damaged CTranslate2 model file ({exc})") from None
    return spec, variables


def _array(raw: bytes, dtype_id: int, shape: tuple, path, name: str) -> np.ndarray:
    dtype = _DTYPES.get(dtype_id)
    if dtype is None:
        raise CT2FormatError(f"{path}: variable {name} has unknown dtype id {dtype_id}")
    if dtype == "bfloat16":  # numpy has no bfloat16: widen the upper 16 bits into float32
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return np.frombuffer(raw, dtype).reshape(shape)


def whisper_from_ct2(variables: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """(ModelDimensions fields, weights named as mlx-audio's Whisper names them) from a WhisperSpec."""
    out: dict[str, np.ndarray] = {}
    for name, value in variables.items():
        if name.endswith("weight_scale") or value.ndim == 0:
            continue
        scale = variables.get(name + "_scale")
        if scale is not None:  # int8: one scale per output row
            value = value.astype(np.float32) / scale.reshape(-1, *([1] * (value.ndim - 1)))
        for key, array in _rename(name, value):
            out[key] = array
    enc = variables["encoder/conv1/weight"]
    n_layers = lambda side: len({m.group(1) for n in variables if (m := re.match(rf"{side}/layer_(\d+)/", n))})
    dims = {
        "n_mels": int(enc.shape[1]),
        "n_audio_ctx": int(variables["encoder/position_encodings/encodings"].shape[0]),
        "n_audio_state": int(enc.shape[0]),
        "n_audio_head": int(variables["encoder/num_heads"]),
        "n_audio_layer": n_layers("encoder"),
        "n_vocab": int(variables["decoder/embeddings/weight"].shape[0]),
        "n_text_ctx": int(variables["decoder/position_encodings/encodings"].shape[0]),
        "n_text_state": int(variables["decoder/embeddings/weight"].shape[1]),
        "n_text_head": int(variables["decoder/num_heads"]),
        "n_text_layer": n_layers("decoder"),
    }
    return dims, out


_NORM = {"gamma": "weight", "beta": "bias"}
# CTranslate2 sub-layer -> mlx-audio names, per attention kind.
_SELF = {"layer_norm": "attn_ln", "linear_0": ("attn.query", "attn.key", "attn.value"), "linear_1": "attn.out"}
_CROSS = {"layer_norm": "cross_attn_ln", "linear_0": "cross_attn.query",
          "linear_1": ("cross_attn.key", "cross_attn.value"), "linear_2": "cross_attn.out"}
_FFN = {"layer_norm": "mlp_ln", "linear_0": "mlp1", "linear_1": "mlp2"}
_TOP = {"encoder/conv1": "encoder.conv1", "encoder/conv2": "encoder.conv2", "encoder/layer_norm": "encoder.ln_post",
        "decoder/layer_norm": "decoder.ln", "decoder/embeddings": "decoder.token_embedding"}


def _rename(name: str, value: np.ndarray):
    """Yields (mlx name, array) pairs for one CTranslate2 variable (a fused projection gives several)."""
    if name == "decoder/position_encodings/encodings":
        yield "decoder.positional_embedding", value
        return
    if name in ("encoder/position_encodings/encodings", "decoder/projection/weight"):
        return  # sinusoids are recomputed; the output projection is the tied embedding
    module, _, leaf = name.rpartition("/")
    leaf = _NORM.get(leaf, leaf)
    if module in _TOP:
        if module.startswith("encoder/conv") and leaf == "weight":
            value = value.transpose(0, 2, 1)  # (out, in, kernel) -> MLX's (out, kernel, in)
        yield f"{_TOP[module]}.{leaf}", value
        return
    m = re.fullmatch(r"(encoder|decoder)/layer_(\d+)/(self_attention|attention|ffn)/(\w+)", module)
    if m is None:
        raise CT2FormatError(f"unexpected CTranslate2 Whisper variable {name}")
    side, index, part, sub = m.groups()
    target = {"self_attention": _SELF, "attention": _CROSS, "ffn": _FFN}[part][sub]
    prefix = f"{side}.blocks.{index}."
    if isinstance(target, str):
        yield prefix + f"{target}.{leaf}", value
        return
    # Fused projections: rows are [query; key; value] or [key; value]; Whisper's key has no bias.
    for chunk, sub_name in zip(np.split(value, len(target), axis=0), target):
        if not (leaf == "bias" and sub_name.endswith(".key")):
            yield prefix + f"{sub_name}.{leaf}", chunk

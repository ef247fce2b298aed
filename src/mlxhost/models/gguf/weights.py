"""GGUF tensors -> MLX arrays under Hugging Face names.

Types MLX reads natively (Q4_0, Q4_1, Q8_0 and float) come through `mx.load` already in MLX's affine
layout (uint32-packed values, a scale and a bias per 32 weights) and stay quantized: no dequantize and
requantize round trip. Files holding any other type (K-quants, Q5_0, IQ*) are dequantized tensor by
tensor with the `gguf` package's numpy kernels, then kept as floats or quantized to MLX bits.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np

from mlxhost.models.gguf.arch import GEMMA_NORM_SHIFT, PERMUTED_QK, ROPE_TENSORS, hf_name, unpermute_rows
from mlxhost.models.gguf.reader import GGUFError, GGUFHeader, TensorInfo

log = logging.getLogger(__name__)

# Tensor types mx.load reads, and the MLX bits of the quantized ones (group size 32 for all).
NATIVE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
NATIVE_FLOATS = {"F32", "F16", "BF16"}
NATIVE_GROUP_SIZE = 32
DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class GGUFConvertConfig:
    dtype: str = "float16"  # unquantized weights, and the scales and biases of quantized ones
    bits: int | None = None  # quantize dequantized tensors to these MLX bits (4 or 8); None: keep floats
    group_size: int = 64  # with bits
    dequantize: bool = False  # dequantize natively-read types too (float weights everywhere)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.bits not in (None, 4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group size must be 32, 64 or 128, got {self.group_size}")

    @property
    def key(self) -> str:
        """What makes two conversions of one file differ (part of the cache key)."""
        return f"{self.dtype}-{self.bits or 0}-{self.group_size}-{int(self.dequantize)}"


@dataclass
class ConvertedWeights:
    arrays: dict  # Hugging Face name -> mx.array
    quantization: dict | None  # config.json's "quantization" entry (with per-layer exceptions)
    rope_tensors: dict  # rotary tensors (numpy) that become config entries
    how: str  # one line for the log: what was kept, what was dequantized


def can_load_natively(header: GGUFHeader) -> bool:
    return header.tensor_types <= NATIVE_FLOATS | set(NATIVE_BITS)


def convert_weights(header: GGUFHeader, arch: str, cfg: GGUFConvertConfig) -> ConvertedWeights:
    import mlx.core as mx  # lazy: mlx only when used

    names = {t.name for t in header.tensors}
    has_gate = any(n.endswith("ffn_gate.weight") for n in names)
    heads = int(header.arch_value("attention.head_count"))
    kv_heads = int(header.arch_value("attention.head_count_kv", heads))
    dtype = getattr(mx, cfg.dtype)
    native = not cfg.dequantize and can_load_natively(header)
    source = _native_source(header) if native else _dequantized_source(header)
    arrays, rope, layer_bits = {}, {}, {}
    for info in header.tensors:
        base = info.name.rsplit(".", 1)[0]
        if base in ROPE_TENSORS:
            rope[base] = np.asarray(source(info)["weight"], dtype=np.float32)
            continue
        target = hf_name(arch, info.name, has_gate)
        parts = source(info)  # {"weight": w} or, kept quantized, {"weight", "scales", "biases"}
        if arch in PERMUTED_QK and base.endswith((".attn_q", ".attn_k")):
            n = heads if base.endswith(".attn_q") else kv_heads
            parts = {k: unpermute_rows(v, n) for k, v in parts.items()}
        if arch == "gemma3" and info.name.endswith("norm.weight"):
            parts["weight"] = parts["weight"] - GEMMA_NORM_SHIFT
        if "scales" in parts:
            layer_bits[target[:-len(".weight")]] = NATIVE_BITS[_type_name(info)]
        elif cfg.bits and _quantizable(target, parts["weight"], cfg.group_size):
            w, scales, biases = mx.quantize(mx.array(parts["weight"]).astype(dtype), cfg.group_size, cfg.bits)
            parts = {"weight": w, "scales": scales, "biases": biases}
            layer_bits[target[:-len(".weight")]] = cfg.bits
        prefix = target.rsplit(".", 1)[0]
        new = {}
        for kind, value in parts.items():
            value = mx.array(value) if isinstance(value, np.ndarray) else value
            if value.dtype != mx.uint32:  # packed values stay; floats, scales and biases take the dtype
                value = value.astype(dtype)
            new[target if kind == "weight" else f"{prefix}.{kind}"] = value
        mx.eval(list(new.values()))  # tensor by tensor: one float copy at a time, not the whole model
        arrays.update(new)
    quantization = _quantization_entry(layer_bits, native, cfg)
    kept = ", ".join(sorted(header.tensor_types))
    if native:
        how = f"tensor types {kept} read by MLX; quantized ones kept as MLX {sorted(set(layer_bits.values()))}-bit"
    elif cfg.bits:
        how = f"tensor types {kept} dequantized, then quantized to MLX {cfg.bits}-bit (group {cfg.group_size})"
    else:
        how = f"tensor types {kept} dequantized to {cfg.dtype}"
    return ConvertedWeights(arrays, quantization, rope, how)


def _type_name(info: TensorInfo) -> str:
    from gguf import GGMLQuantizationType  # lazy: gguf only when used

    return GGMLQuantizationType(info.ggml_type).name


def _native_source(header: GGUFHeader):
    import mlx.core as mx  # lazy: mlx only when used

    loaded = {}
    for path in header.files:
        try:
            loaded.update(mx.load(str(path), format="gguf"))  # Ollama blobs have no suffix
        except (RuntimeError, ValueError) as exc:
            raise GGUFError(f"{path}: MLX cannot read it: {exc}") from None

    def source(info: TensorInfo) -> dict:
        base = info.name.rsplit(".", 1)[0]
        if _type_name(info) in NATIVE_BITS:
            return {k: loaded[f"{base}.{k}"] for k in ("weight", "scales", "biases")}
        return {"weight": loaded[info.name]}

    return source


def _dequantized_source(header: GGUFHeader):
    from gguf import GGMLQuantizationType  # lazy: gguf only when used
    from gguf.quants import dequantize  # lazy: gguf only when used

    maps = {path: np.memmap(path, dtype=np.uint8, mode="r") for path in header.files}

    def source(info: TensorInfo) -> dict:
        raw = maps[info.path][info.offset:info.offset + info.nbytes]
        rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        kind = GGMLQuantizationType(info.ggml_type)
        try:
            if kind.name == "BF16":  # numpy has no bfloat16: widen the 16 bits to a float32's top half
                values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                values = dequantize(np.asarray(raw).reshape(rows, -1), kind)
        except NotImplementedError:
            raise GGUFError(f"{info.path}: tensor {info.name}: type {kind.name} cannot be dequantized "
                            "by the installed gguf package") from None
        return {"weight": np.asarray(values, dtype=np.float32).reshape(info.shape)}

    return source


def _quantizable(name: str, weight, group_size: int) -> bool:
    # Linear and embedding matrices only: norms are vectors, and the last axis must split into groups.
    return name.endswith(".weight") and weight.ndim == 2 and weight.shape[-1] % group_size == 0


def _quantization_entry(layer_bits: dict, native: bool, cfg: GGUFConvertConfig) -> dict | None:
    """mlx-lm's config entry: the most common bits as the default, other layers listed by path."""
    if not layer_bits:
        return None
    group = NATIVE_GROUP_SIZE if native else cfg.group_size
    bits = Counter(layer_bits.values()).most_common(1)[0][0]
    entry = {"group_size": group, "bits": bits}
    for path, b in sorted(layer_bits.items()):
        if b != bits:
            entry[path] = {"group_size": group, "bits": b}
    return entry

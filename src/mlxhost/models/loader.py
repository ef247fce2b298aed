"""Loading a served model through mlx-lm: a local folder (MLX or Hugging Face layout) or a hub id."""

from __future__ import annotations

import json
import logging
import mmap
import struct
import time
from pathlib import Path

from mlxhost.audio.detect import audio_kind
from mlxhost.config import LOAD_STRATEGIES
from mlxhost.models.encoder import encoder_type, load_encoder
from mlxhost.models.loaded import LoadedModel, ModelLoadError, materialize
from mlxhost.models.source import resolve_source
from mlxhost.models.tokenizer_cache import load_tokenizer
from mlxhost.models.vlm import is_vlm_config, load_vlm, read_config

log = logging.getLogger(__name__)

_CHUNK_BYTES = 256 << 20


def load_model(source: str, strategy: str = "auto", remember: str | None = None) -> LoadedModel:
    """Loads weights and tokenizer; a hub id comes from the Hugging Face cache or is downloaded once.
    `strategy` is "auto" (choose_load_strategy by the weights' size) or one of LOAD_STRATEGIES.
    `remember`: a folder where a text model's loaded tokenizer is kept for the next start (tokenizer_cache.py).
    Every array the model holds is evaluated before this returns (`materialize`)."""
    from mlxhost.platform.quantized_rows import fold_on_cuda  # lazy: pulls in mlx

    loaded = _load(source, strategy, remember)
    materialize(loaded.model)
    if not getattr(loaded.model, "is_audio", False):  # audio models (audio/) are no nn.Module: nothing to fold
        fold_on_cuda(loaded.model)
    return loaded


def model_kind(config: dict | None) -> str:
    """Which library loads a folder with this config.json: "vlm" (vision-language models: mlx-vlm, its own
    weight layout and processor), "encoder" (BERT-style encoders: mlx-embeddings, as mlx-lm has none),
    "audio" (Whisper, Kokoro: mlx-audio, audio/) or "text" (mlx-lm)."""
    if config is not None and is_vlm_config(config):
        return "vlm"
    if config is not None and encoder_type(config) is not None:
        return "encoder"
    if audio_kind(config) is not None:
        return "audio"
    return "text"


def _load(source: str, strategy: str, remember: str | None = None) -> LoadedModel:
    if strategy != "auto" and strategy not in LOAD_STRATEGIES:
        raise ValueError(f"load strategy must be auto or one of {LOAD_STRATEGIES}, got {strategy!r}")
    # A local path as is; a hub id from the Hugging Face cache, else downloaded (models/source.py).
    folder = resolve_source(source)
    from mlxhost.models.gguf import gguf_folder  # lazy: pulls in numpy

    folder = gguf_folder(folder)  # a GGUF: the MLX folder converted from it once (models/gguf/)
    for path in sorted(folder.glob("*.safetensors")):
        check_safetensors(path)
    config = read_config(str(folder))
    kind = model_kind(config)
    if kind == "vlm":
        model, tokenizer = load_vlm(str(folder), config)
        return LoadedModel(model, tokenizer, config, source)
    if kind == "encoder":
        loaded = load_encoder(str(folder), config)
        loaded.source = source
        return loaded
    if kind == "audio":
        from mlxhost.audio.engine import load_audio_model  # cycle: audio.engine imports this module

        return load_audio_model(str(folder), config, source)
    files = weight_files(folder)
    if strategy == "auto":
        strategy = choose_load_strategy(sum(p.stat().st_size for p in files))
    loaders = {"mlx-lm": _load_mlx_lm, "chunked": _load_chunked, "mmap": _load_mmap}
    start = time.perf_counter()
    model, config = loaders[strategy](folder)
    weights_s = time.perf_counter() - start
    tokenizer = load_tokenizer(folder, config.get("eos_token_id"), Path(remember) if remember else None)
    tokenizer_s = time.perf_counter() - start - weights_s
    log.info("loaded %s: weights %.2f s (%s), tokenizer %.2f s", source, weights_s, strategy, tokenizer_s)
    return LoadedModel(model, tokenizer, config, source, strategy,
                       {"weights": weights_s, "tokenizer": tokenizer_s})


def choose_load_strategy(weight_bytes: int) -> str:
    """The strategy "auto" picks for a model whose weight files hold `weight_bytes` in all.

    Measured with `mlxhost bench load` (Linux, MLX CPU, 2 shared cores, ext4 on a virtio disk that
    reads ~0.6 GB/s cold; seconds from files to evaluated weights, mlx-lm / chunked / mmap, median):
      0.6B 4-bit 0.34 GB: cold 0.80 / - / 0.65 (3 runs; 1st run 1.15 / 0.94 / 0.81), warm 0.48 / - / 0.58
      0.6B bf16  1.19 GB: cold 1.34 / - / 2.17 (3 runs; 1st run 3.04 / 2.52 / 2.45), warm 1.05 / - / 1.18
      8B 4-bit   4.61 GB: cold 7.70 / 9.16 / 11.19, warm 3.93 / 4.93 / 5.15
      8B bf16   16.38 GB: cold 27.3 / - / 27.5 (1st run 37.4 / 32.6 / 32.2), warm* 16.1 / 25.9 / 20.7
    (*16 GB of page cache plus a 16 GB copy do not fit in 24 GB: "warm" still read 0.5-5.8 GB.)
    Peak RSS was the same for all three (mmap +1.1 GB on the 8B bf16: the 1.2 GB embedding is mapped
    whole before its pages are dropped). No alternative beat mlx-lm's pread-into-MLX-buffers beyond the
    run-to-run noise (~0.5 s small, ~10 s at 16 GB cold on this shared box), so every size keeps it.
    To re-measure on a Mac (unified memory; Metal buffers are the RSS; no posix_fadvise, so cold
    needs `sudo purge`): if mmap or chunked wins there for some sizes, return it below a threshold here.
    """
    return "mlx-lm"


def weight_files(folder: Path) -> list[Path]:
    """The files mlx-lm reads weights from (its glob, so every strategy sees the same tensors)."""
    return sorted(Path(folder).glob("model*.safetensors"))


# Each strategy: folder -> (model with evaluated parameters, config). mlx-lm builds, sanitizes and
# quantizes the model in all three, so they differ only in how the bytes reach the arrays.


def _load_mlx_lm(folder: Path):
    from mlx_lm.utils import load_model as mlx_lm_load_model  # lazy: mlx_lm only when used

    return mlx_lm_load_model(folder)


def _load_chunked(folder: Path):
    import mlx.core as mx  # lazy: mlx only when used
    from mlx.utils import tree_flatten  # lazy: mlx only when used
    from mlx_lm.utils import load_model as mlx_lm_load_model  # lazy: mlx_lm only when used

    model, config = mlx_lm_load_model(folder, lazy=True)
    chunk, chunk_bytes = [], 0
    for _, value in tree_flatten(model.parameters()):
        chunk.append(value)
        chunk_bytes += value.nbytes
        if chunk_bytes >= _CHUNK_BYTES:
            mx.eval(chunk)
            chunk, chunk_bytes = [], 0
    mx.eval(chunk)
    return model, config


def _load_mmap(folder: Path):
    import mlx.core as mx  # lazy: mlx only when used
    from mlx_lm.utils import load_model as mlx_lm_load_model  # lazy: mlx_lm only when used

    # lazy: mlx-lm's own file reads are never evaluated, our arrays replace them.
    model, config = mlx_lm_load_model(folder, lazy=True)
    weights = {}
    for path in weight_files(folder):
        weights.update(read_safetensors_mmap(path))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    # strict: a model whose sanitize is not a plain rename/drop fails loudly here instead of serving
    # half-replaced weights.
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model, config


# safetensors dtype -> (numpy dtype to read the bytes as, mlx dtype to view them as, or None)
_ST_DTYPES = {
    "F32": ("float32", None), "F16": ("float16", None), "BF16": ("uint16", "bfloat16"),
    "I64": ("int64", None), "I32": ("int32", None), "I16": ("int16", None), "I8": ("int8", None),
    "U64": ("uint64", None), "U32": ("uint32", None), "U16": ("uint16", None), "U8": ("uint8", None),
    "BOOL": ("bool", None),
}


def read_safetensors_mmap(path: Path) -> dict:
    """Every tensor of one safetensors file as an evaluated MLX array, read through a memory map.
    numpy has no bfloat16: BF16 bytes are copied as uint16 and viewed as bfloat16 (no conversion)."""
    import mlx.core as mx  # lazy: mlx only when used
    import numpy as np  # lazy: numpy only when used

    header_len, header = _read_header(path)
    tensors = sorted(((name, t) for name, t in header.items() if name != "__metadata__"),
                     key=lambda item: item[1]["data_offsets"][0])
    out = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_SEQUENTIAL)  # deeper kernel read-ahead on a cold page cache
        for name, t in tensors:
            if t["dtype"] not in _ST_DTYPES:
                raise ModelLoadError(f"{path}: tensor {name}: unsupported dtype {t['dtype']}")
            np_dtype, view_dtype = _ST_DTYPES[t["dtype"]]
            begin, end = (8 + header_len + int(o) for o in t["data_offsets"])
            host = np.frombuffer(mm, dtype=np_dtype, count=(end - begin) // np.dtype(np_dtype).itemsize,
                                 offset=begin).reshape(t["shape"])
            value = mx.array(host)  # a copy: the mapping can go
            del host
            out[name] = value.view(getattr(mx, view_dtype)) if view_dtype else value
            if hasattr(mmap, "MADV_DONTNEED"):
                # Unmap the copied pages (the page cache keeps them): resident memory stays at about
                # one copy of the weights instead of two.
                first = begin - begin % mmap.PAGESIZE
                mm.madvise(mmap.MADV_DONTNEED, first, end - first)
    mx.eval(list(out.values()))
    return out


def _read_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        return header_len, json.loads(f.read(header_len))


def check_safetensors(path: Path) -> None:
    """Raises ModelLoadError when a safetensors file is torn or truncated (mlx's own error names no file).
    Layout: an 8-byte little-endian header length, a JSON header, then the tensors' data."""
    size = path.stat().st_size
    if size < 8:
        raise ModelLoadError(f"{path}: truncated: {size} bytes, no 8-byte header length")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            raise ModelLoadError(f"{path}: truncated or not safetensors: {size} bytes, "
                                 f"header length says {header_len}")
        try:
            header = json.loads(f.read(header_len))
            ends = [int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ModelLoadError(f"{path}: bad safetensors header: {e}") from None
    needed = 8 + header_len + max(ends, default=0)
    if size < needed:
        raise ModelLoadError(f"{path}: truncated: {size} bytes, header says {needed}")

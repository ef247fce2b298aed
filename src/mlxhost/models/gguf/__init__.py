"""GGUF files (llama.cpp, Ollama, LM Studio) as a model source.

`convert_gguf` writes an MLX model folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) that mlx-lm loads like any other.
`prepare_gguf` does that once per file for serving: the folder is cached under the user cache dir,
keyed by the file's size, mtime and a hash of its header, so a second start loads the folder directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from platformdirs import user_cache_dir

from mlxhost.models.gguf.arch import check_architecture, make_config
from mlxhost.models.gguf.reader import GGUFError, find_gguf, read_header, split_files
from mlxhost.models.gguf.tokenizer import stop_token_ids, write_tokenizer
from mlxhost.models.gguf.weights import GGUFConvertConfig, convert_weights

__all__ = ["GGUFConvertConfig", "GGUFError", "convert_gguf", "find_gguf", "gguf_cache_dir", "gguf_folder", "prepare_gguf"]

log = logging.getLogger(__name__)

ENV_CACHE = "MLXHOST_GGUF_CACHE"
_FORMAT = 1  # bump when the converted folder's layout changes: old cache entries are then ignored
_HEAD_BYTES = 1 << 20


def convert_gguf(source: str | Path, out: str | Path, cfg: GGUFConvertConfig | None = None) -> Path:
    """Converts a GGUF (a file, the first or any part of a split set, or a folder holding one) into
    the MLX folder `out`, which must not exist or be empty."""
    import mlx.core as mx  # lazy: mlx only when used
    from mlx_lm.utils import make_shards  # lazy: mlx_lm only when used

    cfg = cfg or GGUFConvertConfig()
    path = _gguf_path(source)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty: name a new or empty folder")
    start = time.perf_counter()
    header = read_header(path)
    arch = check_architecture(header)  # before any weight is read
    out.mkdir(parents=True, exist_ok=True)
    weights = convert_weights(header, arch, cfg)
    log.info("%s: %s", path.name, weights.how)
    config = make_config(header, weights.rope_tensors)
    if weights.quantization is not None:
        config["quantization"] = weights.quantization
    config["torch_dtype"] = cfg.dtype
    stops = stop_token_ids(header)
    if stops:
        config["eos_token_id"] = stops if len(stops) > 1 else stops[0]
    shards = make_shards(weights.arrays)
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index = {}
    for name, shard in zip(names, shards):
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        index.update({k: name for k in shard})
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    write_tokenizer(header, out, config["max_position_embeddings"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    (out / "generation_config.json").write_text(json.dumps({k: v for k, v in generation.items() if v is not None}))
    log.info("converted %s to %s in %.1f s", path, out, time.perf_counter() - start)
    return out


def _gguf_path(source: str | Path) -> Path:
    source = Path(source)
    if not source.exists():
        raise GGUFError(f"{source}: no such file or folder")
    path = find_gguf(source)
    if path is None:
        raise GGUFError(f"{source}: not a GGUF file, nor a folder holding one")
    return path


def gguf_cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env).expanduser()

    return Path(user_cache_dir("mlxhost")) / "gguf"


def cache_key(path: Path, cfg: GGUFConvertConfig) -> str:
    """Size, mtime and the first MiB of every file, and the conversion settings: a changed or replaced
    file gets a new folder, an unchanged one is found without reading its tensors."""
    digest = hashlib.sha256(f"{_FORMAT}:{cfg.key}".encode())
    for part in split_files(path):
        stat = part.stat()
        digest.update(f"{part.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        with open(part, "rb") as f:
            digest.update(f.read(_HEAD_BYTES))
    return digest.hexdigest()[:16]


def serve_config() -> GGUFConvertConfig:
    """How a GGUF is converted for serving: MLXHOST_GGUF_DTYPE (float16), MLXHOST_GGUF_BITS (4 or 8:
    quantize K-quant files instead of keeping floats), MLXHOST_GGUF_DEQUANTIZE=1 (float weights
    everywhere: with float32 and OpenBLAS the fastest on a Linux CPU, docs/gguf.md)."""
    bits = os.environ.get("MLXHOST_GGUF_BITS")
    try:
        return GGUFConvertConfig(dtype=os.environ.get("MLXHOST_GGUF_DTYPE", "float16"),
                                 bits=int(bits) if bits else None,
                                 dequantize=os.environ.get("MLXHOST_GGUF_DEQUANTIZE", "") in ("1", "true"))
    except ValueError as exc:
        raise GGUFError(f"MLXHOST_GGUF_DTYPE / MLXHOST_GGUF_BITS: {exc}") from None


def gguf_folder(path: Path) -> Path:
    """`path` itself unless it is a GGUF file or a folder holding one; then its converted folder."""
    found = find_gguf(path)
    return path if found is None else prepare_gguf(found, serve_config())


def prepare_gguf(source: str | Path, cfg: GGUFConvertConfig | None = None,
                 cache: Path | None = None) -> Path:
    """The converted folder for a GGUF source, converting it on first use. Concurrent starts are
    safe: each converts into its own temporary folder and the first rename wins."""
    cfg = cfg or GGUFConvertConfig()
    path = _gguf_path(source)
    cache = Path(cache) if cache is not None else gguf_cache_dir()
    stem = path.name[:-len(".gguf")] if path.name.lower().endswith(".gguf") else path.name
    folder = cache / f"{stem}-{cache_key(path, cfg)}"
    if (folder / "config.json").is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{stem}-", dir=cache))
    try:
        convert_gguf(path, tmp, cfg)
        try:
            tmp.rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder

"""A text model's tokenizer, kept between starts.

mlx-lm's `load_tokenizer` took 1.2-1.6 s of every start with a 150k-token vocabulary (Qwen's), most of it in
Python: mlx-lm and transformers each parse tokenizer.json with `json`, and both walk the vocabulary. The
loaded wrapper, pickled once, reads back in about a third of that (the Rust tokenizer re-parses its own JSON).

The file's name is a digest of every file of the model's folder but its weights (contents, not dates), the eos
ids asked for, and the versions of Python and of the libraries that build a tokenizer (`_LIBRARIES`), so any
change that could change the tokenizer loads it afresh. A file that is missing, unreadable or from elsewhere is a fresh load, never an
error. The folder is the user's own cache (pickles run code when read: nothing else writes there).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# A folder's files that hold weights, not tokenizer data: not read into the digest.
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".npz", ".ckpt", ".h5", ".msgpack")
# What builds the tokenizer: transformers converts a SentencePiece or tiktoken vocabulary when a folder has no
# tokenizer.json, so those libraries (and protobuf, which reads .model files) count too.
_LIBRARIES = ("mlxhost", "mlx-lm", "transformers", "tokenizers", "sentencepiece", "tiktoken", "protobuf")
# Tokenizers kept at most: the most recently used stay (each is 1-40 MB).
_KEEP = 8
# Files read whole into the digest up to this size (tokenizer.json files run to ~35 MB); larger ones, of another
# kind (an ONNX export beside the weights), count by size and date.
_MAX_READ_BYTES = 64 << 20


def load_tokenizer(folder: Path, eos_token_ids: Any = None, cache_dir: Path | None = None) -> Any:
    """mlx-lm's `load_tokenizer(folder, eos_token_ids=...)`, read from `cache_dir` when this folder's tokenizer
    was loaded there before (None: no cache)."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer  # lazy: mlx_lm only when used

    path = None
    if cache_dir is not None:
        try:
            path = Path(cache_dir) / f"tokenizer-{tokenizer_key(folder, eos_token_ids)}.pickle"
            start = time.perf_counter()
            with open(path, "rb") as f:
                tokenizer = pickle.load(f)
            os.utime(path)  # recently used: kept when the folder is trimmed
            log.info("tokenizer: read back from an earlier start in %.2f s (%s)", time.perf_counter() - start, path)
            return tokenizer
        except FileNotFoundError:
            pass
        except Exception as exc:  # a torn or foreign file, a class that moved: load afresh and replace it
            log.debug("tokenizer cache: %s unreadable (%s): loading afresh", path, exc)
    tokenizer = mlx_lm_load_tokenizer(folder, eos_token_ids=eos_token_ids)
    if path is not None:
        _write(path, tokenizer)
    return tokenizer


def tokenizer_key(folder: Path, eos_token_ids: Any) -> str:
    digest = hashlib.sha256(f"{sys.version}|{eos_token_ids!r}".encode())
    for name in _LIBRARIES:
        try:
            digest.update(f"|{name}={metadata.version(name)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"|{name}=none".encode())
    for file in sorted(Path(folder).iterdir()):
        if not file.is_file() or file.name.endswith(_WEIGHT_SUFFIXES):
            continue
        stat = file.stat()
        if stat.st_size > _MAX_READ_BYTES:  # no tokenizer file is this large: its size and date stand for it
            digest.update(f"|{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
            continue
        digest.update(f"|{file.name}:".encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:24]


def _write(path: Path, tokenizer: Any) -> None:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    if type(inner).__module__.startswith("transformers_modules"):
        return  # a model's own tokenizer code (trust_remote_code): its class need not import in the next process
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _trim(path.parent)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokenizer-")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(tokenizer, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)  # whole or absent: a start that dies mid-write leaves no half file
        except BaseException:
            os.unlink(tmp)
            raise
    except Exception as exc:  # an unpicklable tokenizer (remote code), a read-only cache: no cache, no error
        log.debug("tokenizer cache: could not keep the tokenizer in %s: %s", path, exc)


def _trim(folder: Path) -> None:
    """Room for one more: the least recently used tokenizers past `_KEEP - 1` go, and temp files a start left
    behind when it died mid-write (an hour old: no start writes that long)."""
    now = time.time()
    for tmp in folder.glob(".tokenizer-*"):
        if now - tmp.stat().st_mtime > 3600:
            tmp.unlink(missing_ok=True)
    kept = sorted(folder.glob("tokenizer-*.pickle"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in kept[_KEEP - 1:]:
        old.unlink(missing_ok=True)

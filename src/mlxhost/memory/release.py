"""Hands freed memory back to the system after caches shrink or a model is unloaded.

Dropping the last reference to an MLX array returns its buffer to MLX's own cache, not to the system,
and glibc keeps freed heap pages of Python objects (and of the tokenizers, safetensors readers, ...)
in its arenas: after `DELETE /v1/cache` the process RSS stayed where the soak left it. So: collect
cycles, empty MLX's buffer cache (on the thread that owns the MLX stream: the engine thread, or the
thread unloading a stopped engine), then ask glibc to return free pages (`malloc_trim`, Linux only).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys

log = logging.getLogger(__name__)


def malloc_trim() -> bool:
    """glibc's `malloc_trim(0)`; False where there is none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


def freeze_heap() -> None:
    """Takes every object alive now out of the cyclic collector's scans (`gc.freeze`), once a model and
    its engine are up. A full collection over a server's start-up heap (model, tokenizer, FastAPI, ...)
    took ~140 ms on the 2-core CPU box, with the GIL held: a pause for every stream whenever one ran."""
    gc.collect()
    gc.freeze()


def give_back_memory(collect: bool = True) -> None:
    """Everything freed so far back to the system: MLX's buffer cache and the C heap's free pages."""
    if collect:
        # Frozen objects are never collected: an unloaded model's cycles need the heap thawed first.
        frozen = gc.get_freeze_count() > 0
        gc.unfreeze()
        gc.collect()
        if frozen:
            gc.freeze()
    try:
        import mlx.core as mx  # lazy: mlx only when used

        mx.clear_cache()
    except Exception as exc:  # e.g. no MLX backend in a test process: the heap still shrinks
        log.debug("mx.clear_cache failed: %s", exc)
    malloc_trim()

"""MLX-CUDA's on-disk kernel cache, kept in a folder that outlives a reboot.

MLX-CUDA compiles its run-time kernels with NVRTC (to the GPU's own machine code where NVRTC can, else PTX)
and writes each module's binary to MLX_PTX_CACHE_DIR, by default $TMPDIR/mlx/<mlx version>/ptx; a later
process loads a module from there instead of compiling it again (mlx/backend/cuda/jit_module.cpp). With the
modules on disk a warm-up takes seconds instead of minutes (docs/BENCHMARKS.md, "Compile stalls on MLX-CUDA").
Most Linux systems empty /tmp at boot (a tmpfs, or systemd-tmpfiles), so a rebooted machine compiled
everything again. The server points MLX at a folder in the user's cache instead, one per MLX version and GPU
architecture: a module's file name says neither, and a binary from another version or GPU must never load.
A folder named in MLX_PTX_CACHE_DIR wins. cuDNN graphs and CUDA graphs live in memory only.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from mlxhost.platform import backend

log = logging.getLogger(__name__)

CACHE_ENV = "MLX_PTX_CACHE_DIR"


def default_kernel_dir(version: str, arch: str, environ=os.environ) -> Path:
    """$XDG_CACHE_HOME/mlxhost/mlx-kernels/<version>-<arch> (XDG_CACHE_HOME defaults to ~/.cache)."""
    root = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "mlxhost" / "mlx-kernels" / f"{version}-{arch}"


def use_persistent_kernel_cache(environ=os.environ) -> Path | None:
    """Points MLX-CUDA's kernel cache at `default_kernel_dir` unless MLX_PTX_CACHE_DIR is set; returns the
    folder in use (None off CUDA, or when no folder can be written, where MLX keeps its own default). Must
    run before the process's first kernel compile: MLX reads the variable once, at that compile."""
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV])
    if not backend.is_cuda():
        return None
    import mlx.core as mx  # lazy: mlx only when used

    arch = str(mx.device_info().get("architecture", "gpu"))
    path = default_kernel_dir(mx.__version__, arch, environ)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        log.warning("MLX kernel cache: %s cannot be written (%s); MLX keeps its own under the temp folder", path, exc)
        return None
    environ[CACHE_ENV] = str(path)
    return path


def kernel_dir(environ=os.environ) -> Path:
    """The folder MLX-CUDA reads and writes compiled modules in: MLX_PTX_CACHE_DIR, else MLX's default."""
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV])

    import mlx.core as mx  # lazy: mlx only when used

    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def count_modules(path: Path | None) -> int:
    """Compiled modules in a kernel cache folder (one binary file each), for the start-up log."""
    if path is None or not path.is_dir():
        return 0
    return sum(1 for p in path.rglob("*.ptx") if ".staging-" not in str(p.relative_to(path)))

"""A fast BLAS for MLX's Linux CPU wheel, taken from the system when one is installed.

The `mlx[cpu]` wheel links the reference BLAS it ships, whose float32 matrix multiply is about ten times slower
than OpenBLAS's on the same cores (docs/gguf.md, "Speed on a Linux CPU"). Loading the system's OpenBLAS with
global symbol scope before `mlx.core` is imported makes MLX's BLAS calls bind to it, as `LD_PRELOAD` would,
without asking the user to set anything. Reads no MLX: it must run before the first `import mlx.core`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution

ENV = "MLXHOST_OPENBLAS"  # "0" keeps MLX's own BLAS; a path names the library to load; "1" or unset: search
INSTALL_HINT = "apt-get install libopenblas0-pthread"


@dataclass(frozen=True)
class BlasChoice:
    """What `use_system_blas` did: `loaded` is the library path in use, or None with `reason` saying why not."""

    loaded: str | None
    reason: str

    @property
    def slow(self) -> bool:
        """MLX's CPU backend multiplies with its reference BLAS: worth one line telling the user the fix."""
        return self.loaded is None and self.reason.startswith("no OpenBLAS")


def candidates(machine: str | None = None) -> list[str]:
    """Where Debian and Ubuntu put OpenBLAS (the pthread build first: MLX calls it from its own threads),
    then what the dynamic linker's cache knows."""
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get((machine or platform.machine()).lower(),
                                                         machine or platform.machine())
    found = [f"/usr/lib/{arch}-linux-gnu/openblas-{kind}/libopenblas.so.0" for kind in ("pthread", "openmp", "serial")]
    by_name = ctypes.util.find_library("openblas")
    return found + ([by_name] if by_name else [])


def _installed(name: str) -> bool:
    try:
        distribution(name)
    except PackageNotFoundError:
        return False
    return True


def _mlx_cpu_wheel() -> bool:
    # The CPU wheel ships as its own distribution; CUDA builds multiply elsewhere (both may be installed
    # after switching extras: then MLX computes on the GPU and is left as it is).
    return _installed("mlx-cpu") and not any(_installed(n) for n in ("mlx-cuda", "mlx-cuda-12", "mlx-cuda-13"))


def use_system_blas(environ: dict | None = None) -> BlasChoice:
    """Loads the system's OpenBLAS for MLX's CPU wheel when there is one; never raises."""
    environ = os.environ if environ is None else environ
    wanted = environ.get(ENV, "")
    if wanted.lower() in ("1", "on", "true", "yes"):  # asked for OpenBLAS, not for a file named "1"
        wanted = ""
    if not sys.platform.startswith("linux"):
        return BlasChoice(None, "not Linux")
    if wanted == "0":
        return BlasChoice(None, f"{ENV}=0")
    if "openblas" in environ.get("LD_PRELOAD", ""):
        return BlasChoice(environ["LD_PRELOAD"], "preloaded (LD_PRELOAD)")
    if not _mlx_cpu_wheel():
        return BlasChoice(None, "MLX is not the CPU wheel")
    if "mlx.core" in sys.modules:
        return BlasChoice(None, "mlx.core was imported first")
    paths = [wanted] if wanted else [p for p in candidates() if os.path.isabs(p) is False or os.path.exists(p)]
    errors = []
    for path in paths:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:  # a broken or hidden file: try the next, then keep MLX's own
            errors.append(f"{path}: {exc}")
            continue
        return BlasChoice(path, "system OpenBLAS")
    if errors:
        return BlasChoice(None, f"no OpenBLAS could be loaded ({'; '.join(errors)})")
    return BlasChoice(None, f"no OpenBLAS on this machine ({INSTALL_HINT} makes float32 matmul ~10x faster)")

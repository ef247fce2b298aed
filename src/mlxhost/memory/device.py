"""Read what the machine and this process hold in memory, without ever raising.

Every probe is guarded: a server that cannot read a number falls back to a conservative guess and
starts, instead of crashing before it has served anything. Parsers take text so tests need no OS.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryReadings:
    """One snapshot, in bytes. On CUDA the device fields describe GPU memory, the rest host RAM."""

    total_ram: int
    available_ram: int
    process_rss: int
    # Metal: max_recommended_working_set_size (what the GPU can use before Metal starts paging);
    # CUDA: the device's total memory; CPU: None (host RAM is the only limit).
    working_set_hint: int | None
    backend: str  # "metal" | "cuda" | "cpu"
    # CUDA only: free device memory. Host RAM says nothing about a discrete GPU's memory.
    device_free: int | None = None
    # MLX's own allocator counters, None when this MLX build lacks them.
    mlx_active: int | None = None
    mlx_peak: int | None = None
    mlx_cache: int | None = None

    @property
    def held_by_process(self) -> int:
        """Bytes this process already holds in the pool the budget is drawn from.

        On CUDA that is MLX's device memory. On unified memory RSS may or may not count Metal
        buffers, so take the larger of RSS and MLX's counters: never both, which would double count.
        """
        mlx = (self.mlx_active or 0) + (self.mlx_cache or 0)
        if self.backend == "cuda" and self.device_free is not None:
            return mlx
        return max(self.process_rss, mlx)

    @property
    def available_now(self) -> int:
        """Free memory in the pool the budget is drawn from (device memory on CUDA, else RAM)."""
        if self.backend == "cuda" and self.device_free is not None:
            return self.device_free
        return self.available_ram

    @property
    def obtainable(self) -> int:
        """What this process could hold in total right now: free memory plus what it already has.

        Adding back our own holdings makes the number the same before and after loading weights.
        """
        return self.available_now + self.held_by_process

    @property
    def pool_total(self) -> int:
        """Size of the memory pool the budget is drawn from (device memory on CUDA, else RAM)."""
        if self.backend == "cuda" and self.working_set_hint:
            return self.working_set_hint
        return self.total_ram


# ---------------------------------------------------------------- parsers (pure, tested on samples)


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo -> {field: bytes}. Values are in kB (KiB, despite the label)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+(?:\(\w+\))?):\s+(\d+)(?:\s+kB)?\s*$", line)
        if m:
            scale = 1024 if line.rstrip().endswith("kB") else 1
            out[m.group(1)] = int(m.group(2)) * scale
    return out


def parse_status_rss(text: str) -> int | None:
    """/proc/<pid>/status -> VmRSS in bytes, None if absent."""
    m = re.search(r"^VmRSS:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def parse_vm_stat(text: str) -> int | None:
    """macOS `vm_stat` output -> available bytes (free + inactive + speculative pages).

    Inactive pages are reclaimable without swapping and speculative ones are read-ahead, so together
    with free pages they approximate what Linux calls MemAvailable. Purgeable pages are left out:
    they are already counted inside active/inactive, adding them would count them twice.
    """
    page = re.search(r"page size of (\d+) bytes", text)
    if not page:
        return None
    counts = {}
    for name in ("free", "inactive", "speculative"):
        m = re.search(rf"^Pages {name}:\s+(\d+)\.?\s*$", text, re.MULTILINE)
        if not m:
            return None
        counts[name] = int(m.group(1))
    return sum(counts.values()) * int(page.group(1))


# ---------------------------------------------------------------- probes (guarded)


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _run(args: list[str]) -> str | None:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    out = _run(["sysctl", "-n", "hw.memsize"])  # macOS
    try:
        return int(out.strip()) if out else 0
    except ValueError:
        return 0


def _process_rss() -> int:
    if sys.platform.startswith("linux"):
        text = _read_text("/proc/self/status")
        rss = parse_status_rss(text) if text else None
        if rss:
            return rss
    try:  # optional dependency: accurate current RSS on every OS
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - missing or broken psutil is not an error here
        pass
    out = _run(["ps", "-o", "rss=", "-p", str(os.getpid())])  # KiB on both Linux and macOS
    try:
        if out and out.strip():
            return int(out.strip()) * 1024
    except ValueError:
        pass
    # Last resort: peak RSS (bytes on macOS, KiB on Linux); larger than current, but never crash.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _available_ram(total: int, rss: int) -> int:
    if sys.platform.startswith("linux"):
        text = _read_text("/proc/meminfo")
        info = parse_meminfo(text) if text else {}
        if "MemAvailable" in info:
            return info["MemAvailable"]
    elif sys.platform == "darwin":
        out = _run(["vm_stat"])
        avail = parse_vm_stat(out) if out else None
        if avail is not None:
            return avail
    # Unknown OS or unreadable: assume everyone else holds nothing. Optimistic, so say so in the log.
    return max(0, total - rss)


def _mlx_counter(mx, name: str) -> int | None:
    fn = getattr(mx, name, None)
    if fn is None:
        return None
    try:
        return int(fn())
    except Exception:  # noqa: BLE001 - a counter we cannot read is simply unknown
        return None


def _gpu_probe(mx) -> tuple[str, int | None, int | None]:
    """(backend, working_set_hint, device_free). mx.metal / mx.cuda may be missing or may throw."""
    try:
        on_gpu = mx.default_device().type == mx.DeviceType.gpu
    except Exception:  # noqa: BLE001
        on_gpu = False
    for backend in ("metal", "cuda"):
        sub = getattr(mx, backend, None)
        try:
            available = bool(sub is not None and sub.is_available())
        except Exception:  # noqa: BLE001
            available = False
        if not (available and on_gpu):
            continue
        info = _device_info(mx, sub)
        if backend == "metal":
            hint = info.get("max_recommended_working_set_size") or info.get("memory_size")
            return "metal", _as_int(hint), None
        hint = info.get("total_memory") or info.get("memory_size")
        return "cuda", _as_int(hint), _as_int(info.get("free_memory"))
    return "cpu", None, None


def _device_info(mx, sub) -> dict:
    # mlx >= 0.30 has mx.device_info(device); older Metal builds only mx.metal.device_info().
    for call in (lambda: mx.device_info(mx.gpu), lambda: sub.device_info()):
        try:
            info = call()
            if isinstance(info, dict):
                return info
        except Exception:  # noqa: BLE001
            continue
    return {}


def _as_int(value) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def read_memory() -> MemoryReadings:
    """Read the machine and this process now. Never raises; unknown numbers fall back safely."""
    total = total_ram()
    rss = _process_rss()
    available = _available_ram(total, rss)
    if total:
        available = min(available, total)  # a container's MemAvailable can exceed its sysconf total
    try:
        import mlx.core as mx  # lazy: mlx only when used
    except Exception:  # noqa: BLE001 - budget still works from OS numbers alone
        mx = None
    backend, hint, device_free = _gpu_probe(mx) if mx is not None else ("cpu", None, None)
    counters = {n: _mlx_counter(mx, f"get_{n}_memory") if mx is not None else None
                for n in ("active", "peak", "cache")}
    return MemoryReadings(
        total_ram=total,
        available_ram=available,
        process_rss=rss,
        working_set_hint=hint,
        backend=backend,
        device_free=device_free,
        mlx_active=counters["active"],
        mlx_peak=counters["peak"],
        mlx_cache=counters["cache"],
    )

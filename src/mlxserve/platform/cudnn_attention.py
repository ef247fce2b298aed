"""`--cudnn-attention`: whether MLX-CUDA runs multi-token attention through cuDNN, decided before the
first forward of the process.

cuDNN builds an execution graph for every new (query length, key length, mask) shape and keeps the last
256. Measured on an H200 (MLX-CUDA 0.32.4, random Qwen3-0.6B 4-bit, 2026-11-25): a 5-token forward at a
new offset 45-71 ms against 6 ms for a shape seen before; a 37-token suffix after 4k tokens 72-80 ms
against 13 ms. Speculative verification meets a new key length at every step. Without cuDNN, MLX's unfused
attention needs no graph (new-offset 5-token forward 8-17 ms) but a 4k prefill of shapes seen before takes
95 ms instead of 46. Served traffic rarely repeats a shape (every prompt, suffix after a prefix hit and
batch of prompts prefilled together has its own lengths), so `auto` turns cuDNN off. Measured under load
on an H100 (random Qwen3-0.6B 4-bit, 2026-11-25, docs/BENCHMARKS.md run 13): a burst of 8 prompts of
180-1,900 tokens got TTFT max 897 ms off against 1,535 ms on, c=1 TTFT 28 ms against 60 ms, and 16-64
streams the same aggregate (within 4%). `on` keeps it for workloads that repeat long prompts' shapes.
MLX reads MLX_CUDA_USE_CUDNN_SDPA once, at its first attention call, so the choice holds for the whole
process: the first engine decides, and an explicit environment variable wins.
"""

from __future__ import annotations

import logging
import os

from mlxserve.platform.backend import is_cuda

log = logging.getLogger(__name__)

ENV = "MLX_CUDA_USE_CUDNN_SDPA"
SETTINGS = ("auto", "on", "off")


def wants_cudnn(setting: str) -> bool:
    """Only `on` takes cuDNN; `auto` is off (new shapes cost more than cuDNN saves, see above)."""
    if setting not in SETTINGS:
        raise ValueError(f"cudnn_attention must be one of {SETTINGS}, got {setting!r}")
    return setting == "on"


def apply_cudnn_attention(setting: str, environ=os.environ, on_cuda: bool | None = None) -> str:
    """Set MLX's switch for this process where it matters (MLX-CUDA); returns what is in force, for logs
    and `/v1/status`: "on", "off", "env:<value>" (set by the user) or "n/a" (not CUDA)."""
    if on_cuda is None:
        on_cuda = is_cuda()
    if not on_cuda:
        return "n/a"
    if ENV in environ and environ.get("_MLXSERVE_SET_" + ENV) != environ[ENV]:
        return f"env:{environ[ENV]}"
    value = "1" if wants_cudnn(setting) else "0"
    if environ.get(ENV) != value:
        if environ.get("_MLXSERVE_SET_" + ENV) is not None:
            # Read once per process: a later engine asking otherwise cannot change it any more.
            log.warning("--cudnn-attention: cuDNN attention stays %s for this process (chosen by the first model)",
                        "on" if environ[ENV] == "1" else "off")
            return "on" if environ[ENV] == "1" else "off"
        environ[ENV] = value
        environ["_MLXSERVE_SET_" + ENV] = value  # ours, not the user's
        log.info("MLX-CUDA attention: cuDNN %s (--cudnn-attention %s)", "on" if value == "1" else "off", setting)
    return "on" if value == "1" else "off"

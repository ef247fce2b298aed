"""`--cudnn-attention`: whether MLX-CUDA runs multi-token attention through cuDNN, decided before the
first forward of the process.

cuDNN builds an execution graph for every new (query length, key length, mask) shape and keeps the last
256. A new shape's graph costs several times the forward it serves, and speculative verification meets a
new key length at every step; without cuDNN, MLX's unfused attention needs no graph, but a long prefill of
shapes seen before runs at about half the speed. Served traffic rarely repeats a shape (every prompt, suffix
after a prefix hit and batch of prompts prefilled together has its own lengths), so `auto` turns cuDNN off:
under load that lowered burst and single-stream TTFT and left throughput as it was (docs/BENCHMARKS.md,
"cuDNN attention"). `on` keeps it for workloads that repeat long prompts' shapes.
MLX reads MLX_CUDA_USE_CUDNN_SDPA once, at its first attention call, so the choice holds for the whole
process: the first engine decides, and an explicit environment variable wins.
"""

from __future__ import annotations

import logging
import os

from mlxhost.platform.backend import is_cuda

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
    if ENV in environ and environ.get("_MLXHOST_SET_" + ENV) != environ[ENV]:
        return f"env:{environ[ENV]}"
    value = "1" if wants_cudnn(setting) else "0"
    if environ.get(ENV) != value:
        if environ.get("_MLXHOST_SET_" + ENV) is not None:
            # Read once per process: a later engine asking otherwise cannot change it any more.
            log.warning("--cudnn-attention: cuDNN attention stays %s for this process (chosen by the first model)",
                        "on" if environ[ENV] == "1" else "off")
            return "on" if environ[ENV] == "1" else "off"
        environ[ENV] = value
        environ["_MLXHOST_SET_" + ENV] = value  # ours, not the user's
        log.info("MLX-CUDA attention: cuDNN %s (--cudnn-attention %s)", "on" if value == "1" else "off", setting)
    return "on" if value == "1" else "off"

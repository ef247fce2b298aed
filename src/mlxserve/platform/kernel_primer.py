"""MLX-CUDA's indexing kernels compiled at launch, beside the model's load, instead of inside the first requests.

MLX-CUDA compiles its gather, take-along-axis and scatter kernels with NVRTC at first use: one module per
pair of dtypes (`gather_bfloat16_uint32_1`, `scatter_int32_int32_Assign_1`, ...), 2-3 s each on an H200
host, however small the arrays. A server's start-up forwards feed int32 token ids, so with an empty kernel
cache a request still met new pairs: its first decode step (sampled ids are uint32: 5.3 s), the first
prompts prefilled together (`gather_axis_bfloat16_int32` and `gather_int32_int32_1`: 7.9 s), the first
batch of 32 (two scatters) (docs/BENCHMARKS.md, "Start-up on MLX-CUDA"). These processes run each pair once
on tiny arrays while the server loads its model, and publish the modules into the kernel cache through a
staging folder (platform/tile_compile.py), where the server's MLX finds them at first use.

Started by server/app.py on MLX-CUDA only; a module already in the cache is not compiled again, so a warm
restart starts no process.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

PROCESSES = 3  # NVRTC compiles on one core; more processes side by side slowed each other on an H200 host


def modules(act: str, quantized: bool) -> list[tuple[str, str, str]]:
    """(kind, array dtype, index dtype) of each module, those the first requests meet first."""
    src = [act, "uint32"] if quantized else [act]  # quantized embeddings gather packed uint32 rows
    first = [("gather", s, "uint32") for s in src]  # a decode step's ids: sampled, uint32
    first += [("gather_axis", act, "int32"), ("gather", "int32", "int32")]  # prompts prefilled together
    first += [("scatter", "int32", "int32"), ("scatter", "uint32", "int32")]  # larger batches
    first += [("gather", s, "int32") for s in src]  # prompt ids (the start-up forwards compile these too)
    first += [("gather_axis", act, "uint32"), ("gather", "int32", "uint32"), ("scatter", act, "int32")]
    return first


def module_name(kind: str, dtype: str, index: str) -> str:
    """MLX-CUDA's name of the module (mlx/backend/cuda/indexing.cpp), one index array."""
    return {"gather": f"gather_{dtype}_{index}_1", "gather_axis": f"gather_axis_{dtype}_{index}",
            "scatter": f"scatter_{dtype}_{index}_Assign_1"}[kind]


def model_dtypes(source: str | None) -> tuple[str, bool]:
    """The activations' dtype and whether the weights are quantized, from a local folder's config.json
    (bfloat16 and quantized when there is none to read: MLX's usual serving format)."""
    try:
        config = json.loads((Path(source) / "config.json").read_text()) if source else None
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict):
        return "bfloat16", True
    text = config.get("text_config", config)
    dtype = str(text.get("torch_dtype") or config.get("torch_dtype") or text.get("dtype") or "bfloat16")
    act = dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16"
    return act, bool(config.get("quantization") or config.get("quantization_config"))


def start(source: str | None, cache: Path) -> list[subprocess.Popen]:
    """The processes compiling what `cache` lacks (none when it has every module)."""
    act, quantized = model_dtypes(source)
    todo = [m for m in modules(act, quantized) if not (cache / f"{module_name(*m)}.ptx").exists()]
    if not todo:
        return []
    groups = [todo[i::PROCESSES] for i in range(min(PROCESSES, len(todo)))]  # the first modules first in each
    log.info("MLX kernel cache: %d indexing modules compile in %d processes beside the model's load",
             len(todo), len(groups))
    return [subprocess.Popen([sys.executable, "-m", __name__, json.dumps({"cache_dir": str(cache), "modules": g})],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            for g in groups]


def run(kind: str, dtype: str, index: str):
    """The op that makes MLX compile the module, on tiny arrays."""
    import mlx.core as mx

    src = mx.zeros((4, 8), dtype=getattr(mx, dtype))
    if kind == "gather":
        return mx.take(src, mx.array([1, 2], dtype=getattr(mx, index)), axis=0)
    if kind == "gather_axis":
        return mx.take_along_axis(src, mx.zeros((4, 2), dtype=getattr(mx, index)), axis=1)
    src[mx.array([1, 2], dtype=getattr(mx, index))] = mx.ones((2, 8), dtype=src.dtype)
    return src


def main(argv: list[str] | None = None) -> int:
    from mlxserve.platform.tile_compile import publish, start_staged

    spec, cache, staging, linked = start_staged(argv)
    import shutil

    import mlx.core as mx

    try:
        for kind, dtype, index in spec["modules"]:
            mx.eval(run(kind, dtype, index))
            publish(staging, cache, linked)  # each module as soon as it is compiled
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

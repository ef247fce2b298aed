"""MLX-CUDA's run-time kernels a server meets first, compiled at launch beside the model's load instead of inside
its first forwards and requests.

MLX-CUDA compiles its gather, take-along-axis and scatter kernels with NVRTC at first use: one module per
pair of dtypes (`gather_bfloat16_uint32_1`, `scatter_int32_int32_Assign_1`, ...), 2-3 s each on an H200
host, however small the arrays. So is each fused kernel of an mx.compile'd function, named after its graph and
dtypes, never the arrays' sizes. A server's first forwards (the KV probe, the memory profile) compiled three
modules after its load, 8-12 s of its cold start: the embedding's gathers at int32 prompt ids and mlx-lm's fused
swiglu (the one function those forwards compile, read off the CPU's compiled-kernel cache). The first requests
met more: the first decode step (sampled ids are uint32: 5.3 s), the first prompts prefilled together
(`gather_axis_bfloat16_int32` and `gather_int32_int32_1`: 7.9 s), the first batch of 32 (two scatters)
(docs/BENCHMARKS.md, "Start-up on MLX-CUDA", D). These processes run each module's op once on tiny arrays while
the server loads its model, the first forwards' three first and side by side, and publish the modules into the
kernel cache through a staging folder (platform/tile_compile.py), where the server's MLX finds them at first use.

Started by server/app.py on MLX-CUDA only; a module already in the cache is not compiled again, so a warm
restart starts no process. A fused kernel's name carries a hash MLX computes, so a marker file in the cache
(`.primed/`) says it was compiled.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlxhost.models.torch_free import follow_parent
from mlxhost.platform.tile_compile import publish, start_staged

log = logging.getLogger(__name__)

# Three processes, so the three modules the first forwards need compile side by side (the count was not
# measured against others; four warm-up processes side by side slowed each other, BENCHMARKS.md D).
PROCESSES = 3
# The server's wait for the first forwards' modules at most: they took 3-7 s after the processes' start.
WAIT_S = 20.0


def modules(act: str, quantized: bool) -> list[tuple[str, str, str]]:
    """(kind, array dtype, index dtype) of each module a cold server was seen to compile in its first forwards or
    on the request path (BENCHMARKS.md D), or a sampling filter's graph holds, in the order they are first met.
    Kind "compiled": the fused kernel of mlx-lm's swiglu at the activations' dtype (index dtype unused)."""
    src = [act, "uint32"] if quantized else [act]  # quantized embeddings gather packed uint32 rows
    first = first_forward_modules(act, quantized)
    first += [("gather", s, "uint32") for s in src]  # a decode step's ids: sampled, uint32
    first += [("gather_axis", act, "int32"), ("gather", "int32", "int32")]  # prompts prefilled together
    first += [("scatter", "int32", "int32"), ("scatter", "uint32", "int32")]  # batches of 32
    # Top-k sampling (mlx-lm's apply_top_k: put_along_axis at argpartition's uint32 indices), read off its graph
    # on the CPU; top-p's take_along_axis is the int32 pair above. Their fused (mx.compile) kernels are not primed.
    return first + [("scatter_axis", act, "uint32")]


def first_forward_modules(act: str, quantized: bool) -> list[tuple[str, str, str]]:
    """The modules the server's first forwards compile: the embedding's gathers at int32 prompt ids (its packed
    rows too, when quantized) and the fused swiglu. Three processes take one each, first."""
    return [("gather", s, "int32") for s in ([act, "uint32"] if quantized else [act])] + [("compiled", act, "")]


def module_name(kind: str, dtype: str, index: str) -> str:
    """MLX-CUDA's name of the module (mlx/backend/cuda/indexing.cpp), one index array; for a fused kernel, the
    marker this module writes once it is compiled."""
    return {"gather": f"gather_{dtype}_{index}_1", "gather_axis": f"gather_axis_{dtype}_{index}",
            "scatter": f"scatter_{dtype}_{index}_Assign_1",
            "scatter_axis": f"scatter_axis_{dtype}_{index}_Assign",
            "compiled": f"swiglu_{dtype}"}[kind]


def failed_marker(cache: Path, module: tuple[str, str, str]) -> Path:
    """The file a process leaves where MLX refused to compile the module this launch: nobody waits for it."""
    return cache / ".primed" / f"{module_name(*module)}.failed"


def cached(cache: Path, module: tuple[str, str, str]) -> bool:
    """Whether `cache` holds the module: MLX's binary, or the marker of a fused kernel."""
    if module[0] == "compiled":
        return (cache / ".primed" / module_name(*module)).exists()
    return (cache / f"{module_name(*module)}.ptx").exists()


def model_dtypes(source: str | None) -> tuple[str, bool]:
    """The activations' dtype and whether the weights are quantized, from a local folder's config.json
    (bfloat16 and quantized when there is none to read: MLX's usual serving format)."""
    try:
        config = json.loads((Path(source) / "config.json").read_text()) if source else None
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict):
        return "bfloat16", True
    text = config.get("text_config")
    text = text if isinstance(text, dict) else config
    # transformers writes "dtype" now, "torch_dtype" before; a VLM's text model may name it in either place.
    dtype = next((d for d in (text.get("dtype"), text.get("torch_dtype"), config.get("dtype"),
                              config.get("torch_dtype")) if isinstance(d, str)), "bfloat16")
    act = dtype if dtype in ("bfloat16", "float16", "float32") else "bfloat16"
    return act, bool(config.get("quantization") or config.get("quantization_config"))


def start(source: str | None, cache: Path) -> list[subprocess.Popen]:
    """The processes compiling what `cache` lacks (none when it has every module). Each is waited for by a
    thread of its own, which logs a failure: nothing else needs their result."""
    act, quantized = model_dtypes(source)
    todo = [m for m in modules(act, quantized) if not cached(cache, m)]
    if not todo:
        return []
    for m in todo:  # an earlier launch's failure says nothing about this one's
        failed_marker(cache, m).unlink(missing_ok=True)
    groups = [todo[i::PROCESSES] for i in range(min(PROCESSES, len(todo)))]
    log.info("MLX kernel cache: %d modules compile in %d processes beside the model's load",
             len(todo), len(groups))
    procs = [subprocess.Popen([sys.executable, "-m", __name__, json.dumps({"cache_dir": str(cache), "modules": g})],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
             for g in groups]
    for proc in procs:
        threading.Thread(target=_reap, args=(proc,), name="mlxhost-kernel-primer", daemon=True).start()
    return procs


def wait_first(procs: list[subprocess.Popen], source: str | None, cache: Path, timeout_s: float = WAIT_S) -> None:
    """Before the server's first forward: until `cache` holds the modules it compiles (first_forward_modules), or
    no process is left to compile them, at most `timeout_s`. They compile side by side here, one after another
    in the server: waiting for them is never longer than compiling them."""
    if not procs:
        return
    todo = first_forward_modules(*model_dtypes(source))
    started = time.perf_counter()
    while not all(cached(cache, m) or failed_marker(cache, m).exists() for m in todo):
        if time.perf_counter() - started > timeout_s or all(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    waited = time.perf_counter() - started
    if all(cached(cache, m) for m in todo):
        log.info("MLX kernel cache: the first forwards' modules compiled beside the load (waited %.1f s)", waited)
    else:
        log.info("MLX kernel cache: the first forwards compile what is not there yet (waited %.1f s)", waited)


def _reap(proc: subprocess.Popen) -> None:
    if proc.wait() not in (0, -15):  # -15: stopped with the server (stop)
        log.warning("MLX kernel cache: a process compiling kernels at launch exited with %d; the server compiles "
                    "what it did not", proc.returncode)


def stop(procs: list[subprocess.Popen]) -> None:
    """Ends the processes still running (a server that failed to start)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()


def _swiglu(gate, x):
    """mlx-lm's swiglu (mlx_lm.models.activations), op for op: MLX names a fused kernel by its graph, so this
    compiles the very module the server's forwards load (a test compares the two). Importing mlx-lm's own would
    import the mlx_lm package, and with it transformers: 4-5 s on a cold machine, before this process's most
    awaited module. Compiled at the call: a primer process runs it once."""
    import mlx.core as mx  # lazy: mlx only when used
    import mlx.nn as nn  # lazy: mlx only when used

    return mx.compile(lambda g, y: nn.silu(g) * y, shapeless=True)(gate, x)


def run(kind: str, dtype: str, index: str):
    """The op that makes MLX compile the module, on tiny arrays."""
    import mlx.core as mx  # lazy: mlx only when used

    src = mx.zeros((4, 8), dtype=getattr(mx, dtype))
    if kind == "compiled":
        return _swiglu(src, src + 1)
    if kind == "gather":
        return mx.take(src, mx.array([1, 2], dtype=getattr(mx, index)), axis=0)
    if kind == "gather_axis":
        return mx.take_along_axis(src, mx.zeros((4, 2), dtype=getattr(mx, index)), axis=1)
    if kind == "scatter_axis":
        return mx.put_along_axis(src, mx.zeros((4, 2), dtype=getattr(mx, index)), mx.array(1, dtype=src.dtype), axis=1)
    src[mx.array([1, 2], dtype=getattr(mx, index))] = mx.ones((2, 8), dtype=src.dtype)
    return src


def main(argv: list[str] | None = None) -> int:
    follow_parent()  # the server kept torch out: so does this process (mlx-lm's import pulls in transformers)
    spec, cache, staging, linked = start_staged(argv)  # before MLX's first compile, which reads the folder
    import mlx.core as mx

    failed = 0
    try:
        for module in map(tuple, spec["modules"]):
            if cached(cache, module):  # the server or another process's
                continue
            try:
                mx.eval(run(*module))
            except Exception as exc:  # one pair MLX refuses does not hold back the others
                print(f"kernel primer: {' '.join(module)}: {exc}", file=sys.stderr)
                failed += 1
                failed_marker(cache, module).parent.mkdir(exist_ok=True)
                failed_marker(cache, module).touch()
                continue
            # Now, not at the end: the server finds each module at first use while the others compile.
            publish(staging, cache, linked)
            if module[0] == "compiled":  # after its binary: the marker says the module is there
                (cache / ".primed").mkdir(exist_ok=True)
                (cache / ".primed" / module_name(*module)).touch()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

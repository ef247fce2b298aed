"""A text model's first forwards compiled at launch, in a process beside the model's load, on weights of zeros.

With an empty kernel cache, the server's first forwards on MLX-CUDA (the KV probe, then the memory profile's 1-
and 2-token forwards) compile every run-time module a forward of the model needs: the fused kernels of its
mx.compile'd functions (mlx-lm's swiglu, for one) and its embedding's gathers. NVRTC takes 2-3 s a module, and the
server ran them after its load: 8-12 s of an 8B's cold start, and of a 0.6B's (docs/BENCHMARKS.md, "Start-up on
MLX-CUDA"). A module's name follows the graph and the dtypes, never the values, so this process builds the same
model from its folder with every parameter zeros (no weight is read from disk), runs the same forwards while the
server loads, and publishes the modules into the kernel cache (tile_compile.publish). The server waits for it
before its own first forward (`wait`), which then finds every module on disk.

Started by server/app.py on MLX-CUDA only, beside the indexing kernels' processes (kernel_primer.py). A marker per
model and KV layout (`.primed/<key>` in the cache) says a process ran to the end for it, so a warm restart starts
none. Its zeros take as much device memory as the weights, for a few seconds: it runs only where twice the weights
fit in free device memory with room to spare.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

from mlxhost.models.loader import model_kind, weight_files
from mlxhost.models.torch_free import follow_parent
from mlxhost.platform.tile_compile import publish, start_staged

log = logging.getLogger(__name__)

# Free device memory a start needs beyond twice the weights: the server's load, its activations, this process's.
HEADROOM_BYTES = 4 << 30
# The exit code of a process that found no room for its zeros and compiled nothing.
SKIPPED = 3
# How long the server waits for the process at most. Its forwards compile what the server's would, started earlier,
# so waiting is no longer than compiling; the bound only covers a process that hangs.
WAIT_S = 60.0


def model_folder(source: str | None) -> Path | None:
    """The local folder of a text model in MLX's safetensors layout (a path, or a hub id already in the Hugging
    Face cache), or None: GGUF files, vision, encoder and audio models are not primed."""
    if not source:
        return None
    from mlxhost.models.source import cached_snapshot, looks_local  # lazy: pulls in huggingface_hub

    folder = Path(source).expanduser() if looks_local(source) else cached_snapshot(source)
    if folder is None or not (folder / "config.json").is_file() or not any(folder.glob("model*.safetensors")):
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return folder if isinstance(config, dict) and model_kind(config) == "text" else None


def prime_key(folder: Path, kv: dict) -> str:
    """The marker's name: the model's config and the KV layout its caches get (the kernel cache's own folder is
    already one per MLX version and GPU architecture)."""
    text = (folder / "config.json").read_text() + json.dumps(kv, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def start(source: str | None, cache: Path, kv: dict) -> subprocess.Popen | None:
    """The process compiling the model's first forwards into `cache`, or None where there is nothing to do (a
    warm cache, a model it cannot build). `kv`: the engine's kv_bits, kv_group_size and kv_quant_mode."""
    folder = model_folder(source)
    if folder is None or (cache / ".primed" / prime_key(folder, kv)).exists():
        return None
    spec = {"cache_dir": str(cache), "folder": str(folder), "kv": kv}
    log.info("MLX kernel cache: the model's first forwards compile in a process beside its load")
    return subprocess.Popen([sys.executable, "-m", __name__, json.dumps(spec)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)


def wait(proc: subprocess.Popen | None, timeout_s: float = WAIT_S) -> None:
    """Before the server's first forward: until the process ends, at most `timeout_s` (then it is stopped, and
    the server compiles what it had not)."""
    if proc is None:
        return
    started = time.perf_counter()
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        log.warning("MLX kernel cache: the process compiling the model's first forwards ran past %.0f s; stopped",
                    timeout_s)
        return
    if code == SKIPPED:
        log.info("MLX kernel cache: no room for the model twice in device memory; its first forwards compile "
                 "in the server")
    elif code != 0:
        log.warning("MLX kernel cache: the process compiling the model's first forwards exited with %d; the "
                    "server compiles them itself", code)
    else:
        log.info("MLX kernel cache: the model's first forwards compiled beside its load (waited %.1f s for them)",
                 time.perf_counter() - started)


def fits(weights: int, free: int | None) -> bool:
    """Whether zeros the size of the weights can sit beside the server's own load."""
    return free is not None and 2 * weights + HEADROOM_BYTES <= free


def run_forwards(model, make_cache) -> None:
    """What the server's start-up runs first: the KV probe's 1-token forward and the memory profile's 1- and
    2-token forwards (kv/kinds/probe.py, memory/profile.py), logits included."""
    import mlx.core as mx  # lazy: mlx only when used

    for tokens in (1, 2):
        cache = make_cache(model)
        mx.eval(model(mx.zeros((1, tokens), dtype=mx.int32), cache=cache), [c.state for c in cache])


def build_zeros(folder: Path):
    """mlx-lm's model for `folder`, as its load builds it (sanitized, quantized as the config says), with zeros
    where the weights would be; on MLX-CUDA its quantized layers fold rows as the server's do."""
    import mlx.core as mx  # lazy: mlx only when used
    from mlx.utils import tree_map  # lazy: mlx only when used
    from mlx_lm.utils import load_model  # lazy: mlx_lm only when used

    from mlxhost.platform.quantized_rows import fold_on_cuda  # lazy: pulls in mlx

    model, _ = load_model(folder, lazy=True)  # lazy: the file reads it sets up are never evaluated
    model.update(tree_map(lambda a: mx.zeros(a.shape, a.dtype), model.parameters()))
    mx.eval(model.parameters())
    fold_on_cuda(model)
    return model


def main(argv: list[str] | None = None) -> int:
    follow_parent()  # the server kept torch out for this model: so does this process (it builds the same one)
    spec, cache, staging, linked = start_staged(argv)  # before MLX's first compile, which reads the folder
    import mlx.core as mx  # lazy: after the staging folder is set

    from mlxhost.kv.kinds.kv_quant import plan_kv_quant  # lazy: pulls in mlx

    folder, kv = Path(spec["folder"]), spec["kv"]
    try:
        weights = sum(p.stat().st_size for p in weight_files(folder))
        free = mx.device_info().get("free_memory")
        if not fits(weights, free):
            return SKIPPED
        model = build_zeros(folder)
        from mlx_lm.models.cache import make_prompt_cache  # lazy: mlx_lm only when used

        plan = plan_kv_quant(model, kv.get("kv_bits"), kv.get("kv_group_size", 64), kv.get("kv_quant_mode", "auto"))
        run_forwards(model, plan.make_cache if plan is not None else make_prompt_cache)
        publish(staging, cache, linked)
        (cache / ".primed").mkdir(exist_ok=True)
        (cache / ".primed" / prime_key(folder, kv)).touch()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

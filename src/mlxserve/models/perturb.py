"""A model's copy with noise on its weights: a draft model of a chosen acceptance rate for tests and
benchmarks (the target itself drafts at 100%; more noise, lower acceptance)."""

from __future__ import annotations

import pathlib
import shutil


def perturb_weights(weights: dict, noise: float, seed: int = 0) -> dict:
    """`weights` name -> mx.array; every float matrix gets Gaussian noise of `noise` times its own std.
    Quantized tensors (integer) and 1-D parameters (norm gains) are kept as they are."""
    import mlx.core as mx

    key = mx.random.key(seed)
    out = {}
    for name, w in sorted(weights.items()):
        if w.ndim >= 2 and mx.issubdtype(w.dtype, mx.floating) and not name.endswith((".scales", ".biases")):
            key, sub = mx.random.split(key)
            std = mx.std(w.astype(mx.float32))
            w = (w.astype(mx.float32) + noise * std * mx.random.normal(w.shape, key=sub)).astype(w.dtype)
        out[name] = w
    return out


def perturbed_copy(source, out_dir, noise: float, seed: int = 0) -> pathlib.Path:
    """A copy of the model folder `source` at `out_dir` with `perturb_weights` applied (float weights)."""
    import mlx.core as mx

    src, out = pathlib.Path(source), pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    for f in sorted(src.glob("*.safetensors")):
        weights = perturb_weights(mx.load(str(f)), noise, seed)
        mx.save_safetensors(str(out / f.name), weights, metadata={"format": "mlx"})
    return out

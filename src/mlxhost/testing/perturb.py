"""Draft models made from a target, for tests and benchmarks of speculative decoding with random weights
(where no real small model of the same family exists): the target with noise on its weights (the target
itself drafts at 100%; more noise, lower acceptance), or its first layers only (a cheaper draft)."""

from __future__ import annotations

import json
import pathlib
import re
import shutil


def perturb_weights(weights: dict, noise: float, seed: int = 0) -> dict:
    """`weights` name -> mx.array; every float matrix gets Gaussian noise of `noise` times its own std,
    and quantized ones relative noise of `noise` on their group scales. 1-D parameters (norm gains) and
    the packed integers are kept as they are."""
    import mlx.core as mx  # lazy: mlx only when used

    key = mx.random.key(seed)
    out = {}
    for name, w in sorted(weights.items()):
        if w.ndim >= 2 and mx.issubdtype(w.dtype, mx.floating) and not name.endswith(".biases"):
            key, sub = mx.random.split(key)
            x = w.astype(mx.float32)
            if name.endswith(".scales"):
                x = x * (1 + noise * mx.random.normal(w.shape, key=sub))
            else:
                x = x + noise * mx.std(x) * mx.random.normal(w.shape, key=sub)
            w = x.astype(w.dtype)
        out[name] = w
    return out


def perturbed_copy(source, out_dir, noise: float, seed: int = 0) -> pathlib.Path:
    """A copy of the model folder `source` at `out_dir` with `perturb_weights` applied (float weights)."""
    import mlx.core as mx  # lazy: mlx only when used

    src, out = pathlib.Path(source), pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    for f in sorted(src.glob("*.safetensors")):
        weights = perturb_weights(mx.load(str(f)), noise, seed)
        mx.save_safetensors(str(out / f.name), weights, metadata={"format": "mlx"})
    return out


def truncated_copy(source, out_dir, num_layers: int) -> pathlib.Path:
    """A copy of `source` keeping its first `num_layers` decoder layers (embeddings, final norm and LM
    head as they are): a draft that costs num_layers / all of the target's layers."""
    import mlx.core as mx  # lazy: mlx only when used

    src, out = pathlib.Path(source), pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    layer = re.compile(r"(?:^|\.)layers\.(\d+)\.")
    kept = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, w in mx.load(str(f)).items():
            m = layer.search(name)
            if m is None or int(m.group(1)) < num_layers:
                kept[name] = w
    mx.save_safetensors(str(out / "model.safetensors"), kept, metadata={"format": "mlx"})
    return out

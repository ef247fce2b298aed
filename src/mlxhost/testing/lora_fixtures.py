"""LoRA adapter folders for tests and benchmarks, made with mlx-lm's own LoRA code.

`train_adapter` runs a few optimizer steps of `mlx_lm.tuner`'s LoRA layers on a few tokens and saves the
result as `mlx_lm.lora` does (adapters.safetensors + adapter_config.json); `random_adapter` skips the
training (benchmarks only need the shapes); `to_peft` writes the same weights in PEFT's layout.
"""

from __future__ import annotations

import json
from pathlib import Path

_DEFAULT_STEPS = 4


def _lora_model(model_dir: str | Path, seed: int, rank: int, scale: float, keys, num_layers: int):
    import mlx.core as mx  # lazy: mlx only when used
    import mlx_lm  # lazy: mlx_lm only when used
    from mlx_lm.tuner.utils import linear_to_lora_layers  # lazy: mlx_lm only when used

    model, _ = mlx_lm.load(str(model_dir))
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys:
        params["keys"] = list(keys)
    mx.random.seed(seed)
    linear_to_lora_layers(model, num_layers, params)
    return model, params


def _save(model, params: dict, num_layers: int, out: str | Path) -> Path:
    import mlx.core as mx  # lazy: mlx only when used
    from mlx.utils import tree_flatten  # lazy: mlx only when used

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}, indent=2))
    return out


def train_adapter(model_dir: str | Path, out: str | Path, seed: int = 0, rank: int = 4, scale: float = 10.0,
                  keys: tuple[str, ...] | None = None, num_layers: int = 16, steps: int = _DEFAULT_STEPS,
                  learning_rate: float = 2e-2) -> Path:
    """Fine-tunes LoRA layers (the last `num_layers` blocks, `keys` or every linear layer) for `steps` Adam
    steps on a fixed token sequence of this seed; saved in mlx-lm's format at `out`."""
    import mlx.core as mx  # lazy: mlx only when used
    import mlx.nn as nn  # lazy: mlx only when used
    import mlx.optimizers as optim  # lazy: mlx only when used

    model, params = _lora_model(model_dir, seed, rank, scale, keys, num_layers)
    vocab = model.args.vocab_size
    ids = mx.array([[(seed * 131 + i * 17) % (vocab - 10) + 10 for i in range(32)]])

    def loss(m):
        return nn.losses.cross_entropy(m(ids[:, :-1]), ids[:, 1:]).mean()

    opt = optim.Adam(learning_rate=learning_rate)
    step = nn.value_and_grad(model, loss)
    for _ in range(steps):
        _, grads = step(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    return _save(model, params, num_layers, out)


def random_adapter(model, out: str | Path, seed: int = 0, rank: int = 8, scale: float = 2.0,
                   keys: tuple[str, ...] | None = None, num_layers: int | None = None) -> Path:
    """An untrained adapter on every linear layer of every block (or those whose name ends in one of `keys`;
    or of the last `num_layers` blocks only, as mlx_lm.lora's `--num-layers`), A and B random (mlx-lm starts
    B at zero, which would change nothing). `model`: a loaded mlx-lm model, or a model folder. Benchmarks
    need only the shapes."""
    import mlx.core as mx  # lazy: mlx only when used

    from mlxhost.lora.layers import linear_dims  # lazy: pulls in mlx

    if isinstance(model, (str, Path)):
        import mlx_lm  # lazy: mlx_lm only when used

        model, _ = mlx_lm.load(str(model))
    key = mx.random.key(seed)
    weights = {}
    num_blocks = len(model.layers)
    first = num_blocks - min(num_layers, num_blocks) if num_layers else 0
    for path, layer in model.named_modules():
        dims = linear_dims(layer)
        if dims is None or ".layers." not in path or (keys and not any(path.endswith(k) for k in keys)):
            continue
        if int(path.split(".layers.", 1)[1].split(".", 1)[0]) < first:
            continue
        key, ka, kb = mx.random.split(key, 3)
        bound = 1 / dims[0] ** 0.5  # mlx-lm's init of A
        weights[f"{path}.lora_a"] = mx.random.uniform(-bound, bound, (dims[0], rank), key=ka)
        weights[f"{path}.lora_b"] = mx.random.normal((rank, dims[1]), key=kb) * 0.02
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    params = {"rank": rank, "scale": scale, "dropout": 0.0, **({"keys": list(keys)} if keys else {})}
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": num_blocks - first, "lora_parameters": params}, indent=2))
    return out


def to_peft(mlx_dir: str | Path, out: str | Path, lora_alpha: float | None = None) -> Path:
    """The adapter at `mlx_dir` (mlx-lm's format) in PEFT's: transposed A/B under PEFT's names, scale as
    lora_alpha / r (the same scale unless `lora_alpha` says otherwise)."""
    import mlx.core as mx  # lazy: mlx only when used

    mlx_dir, out = Path(mlx_dir), Path(out)
    config = json.loads((mlx_dir / "adapter_config.json").read_text())
    params = config["lora_parameters"]
    rank = params["rank"]
    weights = mx.load(str(mlx_dir / "adapters.safetensors"))
    peft = {}
    targets = set()
    for name, w in weights.items():
        module, leaf = name.rsplit(".", 1)
        targets.add(module.rsplit(".", 1)[-1])
        peft[f"base_model.model.{module}.lora_{leaf[-1].upper()}.weight"] = mx.contiguous(w.T)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapter_model.safetensors"), peft)
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": lora_alpha if lora_alpha is not None else params["scale"] * rank,
        "target_modules": sorted(targets), "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}, indent=2))
    return out

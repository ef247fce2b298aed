"""Where a tensor-parallel decode step's time goes, outside mlxhost: mlx-lm's own model, one rank and then
the same model sharded over the local ranks (`Model.shard()`), random weights built in memory.

Per decode step (batch 1, the generate_step pattern: build step n+1, launch it, then wait for step n):
  build_ms: building the step's graph (no evaluation), on the host;
  host_ms: building it and launching it (mx.async_eval): what async_eval adds is where it waits;
  step_ms: the whole pipelined step (what a server's single stream gets);
  synced_ms: build, launch and wait for the same step alone (host and device one after the other).
usage: python tools/tp_step_probe.py [--backend nccl|ring] [--ranks 2] [--shape qwen3-32b|qwen3-8b|tiny]
       [--bits 4] [--mlp-only]    (--bits with qwen3-32b holds both copies at once: an H200, not an H100)
(the shapes of `mlxhost bench distributed`)
Prints one JSON line per rank and layout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from allsum_probe import rank_parser, run  # noqa: E402

from mlxhost.bench.distributed import shapes  # noqa: E402  (the bench's random Qwen3 shapes)


def _model(shape: str, bits: int = 0):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import qwen3

    c = shapes()[shape]
    args = qwen3.ModelArgs(model_type="qwen3", rms_norm_eps=1e-6, vocab_size=c.vocab_size or 151936,
                           hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                           num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                           intermediate_size=c.intermediate_size, head_dim=c.head_dim,
                           max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=False,
                           rope_theta=c.rope_theta)
    mx.random.seed(0)
    model = qwen3.Model(args)
    # Replaced before anything is evaluated (the model's own float32 initial values never are), then one
    # parameter at a time: the float32 draws of the whole 32B shape at once would not fit on one GPU.
    new = [(path, (mx.random.normal(p.shape) * 0.02).astype(mx.bfloat16))
           for path, p in nn.utils.tree_flatten(model.parameters())]
    model.update(nn.utils.tree_unflatten(new))
    for _, p in new:
        mx.eval(p)
    del new
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        mx.eval(model.parameters())
    return model


def _shard_mlp(model, group) -> None:
    """Tensor parallel for the MLP only (attention stays whole on every rank): one all-reduce a block
    instead of two, for more weights read per rank."""
    from mlx.nn.layers.distributed import shard_linear

    for layer in model.model.layers:
        layer.mlp.gate_proj = shard_linear(layer.mlp.gate_proj, "all-to-sharded", group=group)
        layer.mlp.up_proj = shard_linear(layer.mlp.up_proj, "all-to-sharded", group=group)
        layer.mlp.down_proj = shard_linear(layer.mlp.down_proj, "sharded-to-all", group=group)


def _decode(model, steps: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.arange(16)[None], cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)
    build, host, total = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        nxt = mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)
        build.append(time.perf_counter() - start)
        mx.async_eval(nxt)
        host.append(time.perf_counter() - start)
        y.item()
        total.append(time.perf_counter() - start)
        y = nxt
    mx.eval(y)
    synced = []
    for _ in range(max(steps // 2, 1)):
        start = time.perf_counter()
        y = mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)
        mx.eval(y)
        synced.append(time.perf_counter() - start)
    med = lambda xs: round(sorted(xs[2:] or xs)[len(xs[2:] or xs) // 2] * 1e3, 2)  # noqa: E731
    return {"build_ms": med(build), "host_ms": med(host), "step_ms": med(total), "synced_ms": med(synced)}


def worker(args) -> None:
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend=args.backend)
    model = _model(args.shape, args.bits)
    base = {"shape": args.shape, "bits": args.bits}
    if group.rank() == 0:  # one rank alone: the others wait at the barrier below
        print(json.dumps({"layout": "1 rank", "rank": 0, **base, **_decode(model, args.steps)}), flush=True)
    mx.eval(mx.distributed.all_sum(mx.ones(1), group=group))  # a barrier
    if args.mlp_only:
        _shard_mlp(model, group)
        layout = f"tp{group.size()} mlp only"
    else:
        model.shard(group)
        layout = f"tp{group.size()}"
    mx.eval(model.parameters())
    print(json.dumps({"layout": layout, "rank": group.rank(), **base, **_decode(model, args.steps)}), flush=True)


def main() -> int:
    p = rank_parser(__doc__)
    p.add_argument("--shape", default="qwen3-32b", choices=sorted(shapes()))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--bits", type=int, default=0, help="quantize the random weights (0: bfloat16)")
    p.add_argument("--mlp-only", action="store_true", help="shard the MLP only (attention whole on each rank)")
    return run(p.parse_args(), worker, __file__)


if __name__ == "__main__":
    sys.exit(main())

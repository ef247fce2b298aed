"""`mlxhost bench kvquant`: what `--kv-bits` buys, in-process on the engine core, float KV vs 8 vs 4 bits.

(a) throughput: `--concurrency` greedy requests at once (random prompts of `--prompt-tokens`, `--max-tokens`
    new tokens each); aggregate tok/s over the whole run and decode tok/s once every row has joined, after a
    warm-up batch of the same size (MLX-CUDA compiles kernels per shape). "same as float": the mean share of
    a row's greedy tokens produced before it first differs from the float-KV run's row (random weights
    have near-tied logits, so this is a rough accuracy signal only).
(b) capacity: how many `--context-tokens`-long contexts fit in one KV memory budget (the float run's budget
    share for KV, or `--kv-memory-gb`): by the engine's admission arithmetic (bytes per token from its
    probe) and by measurement (MLX active memory held by `--num-contexts` such contexts in the decode batch,
    the 256-position buffer steps included).

Each quantized setting prints how attention reads its KV: "quantized attention" (MLX's quantized matmuls) or
"dequantized per layer" (where those kernels reject the model's shapes, as MLX-CUDA's do).

The prefix cache is off (random prompts never hit; its blocks would blur the memory reading) and the
memory mode is dedicated, so every setting sees the same budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import shutil
import tempfile
import time

from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import default_json_path
from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.testing.demo import SHAPES, build_model_folder, ensure_demo_model

_MIB = 1 << 20
COLUMNS = [
    ("kv", "KV", ""), ("attention", "attention", ""), ("bytes_per_token", "bytes/token", "d"),
    ("agg_tok_s", "agg tok/s", ".1f"), ("decode_tok_s", "decode tok/s", ".1f"),
    ("same_as_float", "same as float", ".2f"),
    ("measured_mib_per_context", "MiB/context", ".1f"), ("contexts_admitted", "contexts (admission)", "d"),
    ("contexts_measured", "contexts (measured)", "d"), ("capacity_vs_float", "vs float", ".2f"),
]


def _label(bits: int | None) -> str:
    return f"{bits}-bit" if bits else "float"


def _make_core(loaded, args, bits: int | None, max_num_seqs: int, **kw):
    import mlx.core as mx  # lazy: mlx only when used

    from mlxhost.engine.core import EngineCore  # lazy: pulls in mlx_lm

    gc.collect()
    mx.clear_cache()
    config = EngineConfig(enable_prefix_cache=False, memory_mode="dedicated", memory_refresh_s=0.0,
                          max_num_seqs=max_num_seqs, prefill_step_size=args.prefill_step_size,
                          kv_bits=bits, kv_group_size=args.kv_group_size, **kw)
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=1 << 20)


def _prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _run_batch(core, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"kvq-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        core.add_request(Request(rid, p, params))
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    start = time.perf_counter()
    all_joined = None
    decode_tokens = 0
    while core.has_work:
        for out in core.step():
            if out.error:
                raise RuntimeError(out.error)
            tokens[out.request_id] += out.new_token_ids
            if all_joined is not None:
                decode_tokens += len(out.new_token_ids)
        if all_joined is None and all(tokens.values()):
            all_joined = time.perf_counter()
    end = time.perf_counter()
    total = sum(len(t) for t in tokens.values())
    decode_s = end - all_joined if all_joined is not None else 0.0
    return {"num_tokens": total, "wall_s": end - start, "agg_tok_s": total / (end - start),
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
            "tokens": [tokens[rid] for rid in ids]}


def _agreement(rows: list[list[int]], reference: list[list[int]]) -> float:
    """Mean share of each row's tokens generated before it first differs from the reference row."""
    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    return sum(common(a, b) / max(len(b), 1) for a, b in zip(rows, reference)) / max(len(rows), 1)


def _measure_contexts(core, prompts: list[list[int]], max_tokens: int) -> int:
    """MLX active bytes the decode batch holds once every context has joined (above the idle core)."""
    import mlx.core as mx  # lazy: mlx only when used

    mx.synchronize()
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"ctx-{i}", p, params))
    while core.runner.batch.num_live < len(prompts):
        for out in core.step():
            if out.error:
                raise RuntimeError(out.error)
    mx.synchronize()
    gc.collect()
    held = mx.get_active_memory() - base
    for i in range(len(prompts)):
        core.abort(f"ctx-{i}")
    return held


def run_kvquant_bench(args: argparse.Namespace) -> dict:
    path = _model_path(args)
    try:
        loaded = load_model(path)
    finally:
        if path.startswith(tempfile.gettempdir()) and "mlxhost-kvq-" in path:
            shutil.rmtree(path, ignore_errors=True)  # built for this run (GBs for 8B shapes); loaded now
    vocab = min(len(loaded.tokenizer), args.vocab)
    settings = [None if s in ("none", "float", "0") else int(s) for s in args.kv_bits.split(",")]
    prompts = _prompts(0, args.concurrency, args.prompt_tokens, vocab)
    warm = _prompts(1, args.concurrency, args.prompt_tokens, vocab)
    contexts = _prompts(2, args.num_contexts, args.context_tokens, vocab)
    # Every context stays in the batch until the last one has joined (one prefill chunk per step).
    hold_tokens = args.num_contexts * (-(-args.context_tokens // args.prefill_step_size)) + 8
    rows, float_tokens, budget_bytes = [], None, None
    if args.kv_memory_gb:
        budget_bytes = int(args.kv_memory_gb * (1 << 30))
    for bits in settings:
        core = _make_core(loaded, args, bits, args.concurrency)
        if budget_bytes is None:
            if core.budget is None:
                raise SystemExit("no memory budget could be computed here: pass --kv-memory-gb")
            budget_bytes = core.budget.kv  # the first setting's (float KV when listed first)
        per_token = core.probe.bytes_per_token
        # How attention reads the KV (a backend whose quantized matmuls reject the shapes dequantizes per
        # layer), and why some layers (or all) stay float.
        quant = core.kv_quant.status() if core.kv_quant is not None else None
        if quant is not None:
            print(f"{_label(bits)}: {quant['quantized_layers']}/{quant['num_layers']} layers quantized, "
                  f"{quant['attention'] or 'float attention'}" + (f"; {quant['note']}" if quant["note"] else ""),
                  flush=True)
        _run_batch(core, warm, min(args.max_tokens, 16))
        run = _run_batch(core, prompts, args.max_tokens)
        if bits is None:
            float_tokens = run["tokens"]
        same = _agreement(run["tokens"], float_tokens) if float_tokens is not None else None
        del core
        core = _make_core(loaded, args, bits, args.num_contexts,
                          kv_budget_tokens=args.num_contexts * (args.context_tokens + hold_tokens))
        held = _measure_contexts(core, contexts, hold_tokens)
        del core
        per_context = held / args.num_contexts
        rows.append({"kv": _label(bits), "kv_bits": bits, "bytes_per_token": per_token,
                     "agg_tok_s": run["agg_tok_s"], "decode_tok_s": run["decode_tok_s"],
                     "num_tokens": run["num_tokens"], "wall_s": run["wall_s"], "same_as_float": same,
                     "kv_quantization": quant, "attention": quant["attention"] if quant else None,
                     "measured_mib_per_context": per_context / _MIB,
                     "contexts_admitted": budget_bytes // (per_token * args.context_tokens),
                     "contexts_measured": int(budget_bytes // per_context) if per_context > 0 else None})
        print(format_table(rows[-1:], COLUMNS), flush=True)
        if args.output_json:  # each setting as it completes: a run cut short still leaves its rows
            write_json(args.output_json, {"config": {"kv_budget_bytes": budget_bytes}, "rows": rows, "partial": True})
    base = next((r for r in rows if r["kv_bits"] is None), None)
    for r in rows:
        r["capacity_vs_float"] = r["contexts_admitted"] / base["contexts_admitted"] if base else None
        r["measured_vs_float"] = (r["contexts_measured"] / base["contexts_measured"]
                                  if base and base["contexts_measured"] else None)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    return {"config": {**config, "kv_budget_bytes": budget_bytes}, "rows": rows}


def _model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if args.shape == "tiny" and args.bits is None:
        return str(ensure_demo_model())
    # Random weights in a real model's shape, quantized in memory as `mlxhost demo-model` does.
    config = dataclasses.replace(SHAPES[args.shape], quantize_bits=args.bits,
                                 quantize_with_converter=args.shape == "tiny")
    return str(build_model_folder(tempfile.mkdtemp(prefix=f"mlxhost-kvq-{args.shape}-"), config))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: --shape)")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                        help="without --model: random weights in this shape (tiny: the demo model)")
    parser.add_argument("--bits", type=int, default=None, help="with --shape: quantize the weights to this many bits")
    parser.add_argument("--kv-bits", default="none,8,4", help="settings to compare, comma-separated (none: float)")
    parser.add_argument("--kv-group-size", type=int, default=EngineConfig().kv_group_size,
                        help="must divide the head dim (the tiny demo model's is 32)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight for the tok/s measurement")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of each request")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--context-tokens", type=int, default=8192, help="capacity: tokens of one context")
    parser.add_argument("--num-contexts", type=int, default=2, help="capacity: contexts held for the measurement")
    parser.add_argument("--kv-memory-gb", type=float, default=None,
                        help="capacity: the KV memory budget (default: the first setting's budget share for KV)")
    parser.add_argument("--prefill-step-size", type=int, default=2048, help="the engine's prefill chunk")
    parser.add_argument("--vocab", type=int, default=2000, help="prompt token ids are drawn below this")
    parser.add_argument("--output-json", default=None, help="result file (default: bench-results/kvquant-*.json)")


def run(args: argparse.Namespace) -> int:
    args.output_json = args.output_json or default_json_path("kvquant")
    result = run_kvquant_bench(args)
    print(format_table(result["rows"], COLUMNS))
    print(f"KV budget for (b): {result['config']['kv_budget_bytes'] / (1 << 30):.2f} GiB, "
          f"{args.context_tokens}-token contexts")
    path = write_json(args.output_json, result)
    print(f"wrote {path}")
    return 0

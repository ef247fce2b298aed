"""`mlxhost bench lora`: aggregate tok/s of N streams spread over K LoRA adapters against N streams on the
base model, one engine in-process (as `bench engine`), same prompts' shape, same engine.

The adapters are random (rank `--rank` on every linear layer of every block, or `--keys`, or the last
`--num-layers` blocks as mlx_lm.lora adapts by default): throughput
depends on their shapes, not their values. Each level runs the base, then the adapters (request i under
adapter i mod K), `--repeats` times in turn, each run with prompts of its own so no prefix-cache hit favours
either; the table shows each mode's median run, so a busy machine's swings hit both modes alike.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from mlxhost.bench.engine import run_one
from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import ServeBenchConfig, add_load_arguments, default_json_path, summarize_level
from mlxhost.bench.serve_request import RequestResult, make_prompt
from mlxhost.config import EngineConfig, LoraSpec
from mlxhost.lora.adapters import adapter_id, read_adapter
from mlxhost.models.loader import load_model
from mlxhost.platform.backend import default_prefill_step_size
from mlxhost.testing.demo import ensure_demo_model
from mlxhost.testing.lora_fixtures import random_adapter

TABLE_COLUMNS = [
    ("mode", "mode", ""), ("concurrency", "conc", "d"), ("num_adapters", "adapters", "d"),
    ("num_requests", "reqs", "d"), ("ttft_p50_ms", "ttft p50", ".1f"), ("itl_p50_ms", "itl p50", ".2f"),
    ("agg_tok_s", "agg tok/s (median run)", ".1f"), ("vs_base", "vs base", ".2f"), ("num_errors", "errors", "d"),
]


async def _level(engine, loaded, cfg: ServeBenchConfig, c: int, tag: str, adapters: list[str]) -> dict:
    n = cfg.num_requests_for(c)
    prompts = [make_prompt(cfg.seed, tag, i, cfg.prompt_tokens) for i in range(n)]
    results: list[RequestResult | None] = [None] * n
    pending = iter(range(n))

    async def worker():
        for i in pending:
            adapter = adapters[i % len(adapters)] if adapters else ""
            results[i] = await run_one(engine, loaded.tokenizer, cfg, prompts[i], loaded.eos_token_ids,
                                       adapter=adapter)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(c, n))))
    return summarize_level(cfg, c, results, time.perf_counter() - start)


async def run_lora_bench(cfg: ServeBenchConfig, model_path: str | None, engine_config: EngineConfig,
                         num_adapters: int, rank: int, keys: tuple[str, ...] | None, repeats: int = 3,
                         num_layers: int | None = None) -> dict:
    from mlxhost.server.app import make_engine, resolve_max_model_len  # lazy: pulls in fastapi

    loaded = load_model(model_path or str(ensure_demo_model()))
    levels = []
    with tempfile.TemporaryDirectory(prefix="mlxhost-bench-lora-") as tmp:
        specs = [LoraSpec(f"bench{i}", str(random_adapter(loaded.model, Path(tmp) / f"a{i}", seed=i, rank=rank,
                                                           keys=keys, num_layers=num_layers)))
                 for i in range(num_adapters)]
        ids = [adapter_id(s.name, read_adapter(s.path)) for s in specs]
        engine = make_engine(loaded, engine_config, resolve_max_model_len(loaded, engine_config), specs)
        engine.start(asyncio.get_running_loop())
        adapter_bytes, layout = await engine.call(lambda core: (core.runner.lora.nbytes, core.runner.lora.layout))
        print(f"LoRA layout: {layout}, {adapter_bytes / 1e6:.1f} MB of adapters", flush=True)
        try:
            for adapter in ["", *ids]:  # a cold engine's first forwards are not measured
                await run_one(engine, loaded.tokenizer, cfg, make_prompt(cfg.seed, "warmup", 0, cfg.prompt_tokens),
                              loaded.eos_token_ids, adapter=adapter)
            for pos, c in enumerate(cfg.concurrency):
                runs: dict[str, list[dict]] = {"base": [], "lora": []}
                for r in range(repeats):
                    for mode, adapters in (("base", []), ("lora", ids)):
                        level = await _level(engine, loaded, cfg, c, f"L{pos}c{c}{mode}{r}", adapters)
                        level.update(mode=mode, num_adapters=len(adapters))
                        runs[mode].append(level)
                        print(f"c={c} run {r} {mode}: {level['agg_tok_s']:.1f} tok/s", flush=True)
                medians = {mode: sorted(rs, key=lambda lv: lv["agg_tok_s"])[len(rs) // 2] for mode, rs in runs.items()}
                for mode, level in medians.items():
                    base = medians["base"]["agg_tok_s"]
                    levels.append({**level, "vs_base": level["agg_tok_s"] / base if base else 0.0,
                                   "runs_agg_tok_s": [lv["agg_tok_s"] for lv in runs[mode]]})
        finally:
            engine.stop()
    return {"config": {"model": model_path, "num_adapters": num_adapters, "rank": rank, "keys": keys,
                       "num_layers": num_layers, "repeats": repeats, "layout": layout,
                       "adapter_bytes": adapter_bytes, **cfg.__dict__}, "levels": levels}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or hub id (default: the demo model)")
    add_load_arguments(parser, [16])
    parser.add_argument("--num-adapters", type=int, default=4, help="adapters the streams are spread over")
    parser.add_argument("--rank", type=int, default=8, help="rank of each random adapter")
    parser.add_argument("--keys", default=None, metavar="NAME,...",
                        help="layers adapted, by the end of their name (e.g. self_attn.q_proj,self_attn.v_proj); "
                             "default: every linear layer of every block")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="adapt only the last N blocks (mlx_lm.lora's default is 16); default: all")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode per level, taken in turn")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the engine's --max-num-seqs (batch limit)")
    parser.add_argument("--warmup", choices=("on", "auto", "off"), default="on",
                        help="the engine's warm-up (default on: kernels compiled before any run, so the first runs "
                             "of both modes are not measured while a background warm-up still compiles)")
    parser.add_argument("--label", default="lora", help="name of the default JSON file")
    parser.add_argument("--output-json", default=None,
                        help="result file (default: bench-results/serve-lora-<time>.json)")


def run(args: argparse.Namespace) -> int:
    cfg = ServeBenchConfig(url="http://in-process", model=args.model or "demo", concurrency=args.concurrency,
                           prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                           num_requests=args.num_requests, label=args.label, output_json=args.output_json)
    engine_config = EngineConfig(max_num_seqs=args.max_num_seqs, prefill_step_size=default_prefill_step_size(),
                                 warmup=args.warmup)
    keys = tuple(k.strip() for k in args.keys.split(",") if k.strip()) if args.keys else None
    result = asyncio.run(run_lora_bench(cfg, args.model, engine_config, args.num_adapters, args.rank, keys,
                                        args.repeats, args.num_layers))
    print(format_table(result["levels"], TABLE_COLUMNS))
    path = write_json(args.output_json or default_json_path(args.label), result)
    print(f"wrote {path}")
    return 0 if all(lv["num_errors"] == 0 for lv in result["levels"]) else 1

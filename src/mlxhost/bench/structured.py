"""`mlxhost bench structured`: aggregate tok/s with every row under a JSON schema vs unconstrained.

Both passes run the same prompts through the async engine at the same concurrency; every request writes
exactly `--max-tokens` tokens (free rows ignore EOS, constrained rows follow a schema of at least
`--min-items` array items, far longer than that), so the tok/s compare like for like. Each constrained
row gets its own schema (string bounds differ), so no two rows share a compiled grammar. The engine
reports the CPU time spent filling masks per step, which overlaps the device's forward.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from mlxhost.bench.engine import run_one
from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import ServeBenchConfig, add_load_arguments, default_json_path, summarize_level
from mlxhost.bench.serve_request import make_prompt
from mlxhost.config import EngineConfig
from mlxhost.engine.request import SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.testing.demo import ensure_demo_model


def row_schema(i: int, min_items: int) -> dict:
    item = {"type": "object", "additionalProperties": False, "required": ["name", "count", "ok"],
            "properties": {"name": {"type": "string", "maxLength": 8 + i % 16},
                           "count": {"type": "integer", "minimum": 0, "maximum": 999 + i},
                           "ok": {"type": "boolean"}}}
    return {"type": "array", "items": item, "minItems": min_items}


async def _pass(engine, loaded, cfg: ServeBenchConfig, concurrency: int, params: list[SamplingParams], tag: str):
    n = len(params)
    prompts = [make_prompt(cfg.seed, tag, i, cfg.prompt_tokens) for i in range(n)]
    results: list = [None] * n
    pending = iter(range(n))

    async def worker():
        for i in pending:
            results[i] = await run_one(engine, loaded.tokenizer, cfg, prompts[i], loaded.eos_token_ids, params[i])

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return summarize_level(cfg, concurrency, results, time.perf_counter() - start)


async def run_structured_bench(cfg: ServeBenchConfig, model_path: str | None, engine_config: EngineConfig,
                               min_items: int) -> dict:
    from mlxhost.server.app import make_engine, resolve_max_model_len  # lazy: pulls in fastapi
    from mlxhost.structured.grammar import json_schema_constraint  # lazy: pulls in llguidance

    loaded = load_model(model_path or str(ensure_demo_model()))
    engine = make_engine(loaded, engine_config, resolve_max_model_len(loaded, engine_config))
    engine.start(asyncio.get_running_loop())
    rows = []
    try:
        for c in cfg.concurrency:
            n = cfg.num_requests_for(c)
            free = [SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)] * n
            constrained = [SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0,
                                          constraint=json_schema_constraint(row_schema(i, min_items)))
                           for i in range(n)]
            # Warm-up: kernels for this batch size, and every grammar compiled once (its first use
            # compiles on the engine thread, which a long-running server pays once per schema).
            await _pass(engine, loaded, cfg, c, [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                                constraint=p.constraint) for p in constrained], "w")
            before = await engine.call(lambda core: core.grammar.stats())
            level_free = await _pass(engine, loaded, cfg, c, free, f"free{c}")
            level_json = await _pass(engine, loaded, cfg, c, constrained, f"json{c}")
            after = await engine.call(lambda core: core.grammar.stats())
            steps = after["num_mask_steps"] - before["num_mask_steps"]
            mask_ms = ((after["mask_ms_per_step"] * after["num_mask_steps"]
                        - before["mask_ms_per_step"] * before["num_mask_steps"]) / steps) if steps else 0.0
            ratio = level_json["agg_tok_s"] / level_free["agg_tok_s"] if level_free["agg_tok_s"] else None
            rows.append({"concurrency": c, "free_tok_s": level_free["agg_tok_s"], "json_tok_s": level_json["agg_tok_s"],
                         "ratio": ratio, "mask_ms_per_step": mask_ms, "num_errors": level_free["num_errors"]
                         + level_json["num_errors"], "free": level_free, "json": level_json})
            print(f"c={c}: free {level_free['agg_tok_s']:.1f} tok/s, json {level_json['agg_tok_s']:.1f} tok/s "
                  f"({ratio:.2f}x), masks {mask_ms:.2f} ms/step", flush=True)
    finally:
        engine.stop()
    return {"config": {"model": model_path, "min_items": min_items, **cfg.__dict__}, "levels": rows}


COLUMNS = [("concurrency", "c", "d"), ("free_tok_s", "free tok/s", ".1f"), ("json_tok_s", "json tok/s", ".1f"),
           ("ratio", "json/free", ".2f"), ("mask_ms_per_step", "mask ms/step", ".2f"), ("num_errors", "errors", "d")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or hub id (default: the demo model)")
    add_load_arguments(parser, [16])
    parser.add_argument("--min-items", type=int, default=64, help="array items each schema requires (keeps "
                        "constrained rows writing until max_tokens)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the engine's --max-num-seqs (batch limit)")
    parser.add_argument("--label", default="structured", help="name shown in the default JSON name")
    parser.add_argument("--output-json", default=None,
                        help="result file (default: bench-results/serve-<label>-<time>.json)")


def run(args: argparse.Namespace) -> int:
    cfg = ServeBenchConfig(url="http://in-process", model=args.model or "demo", concurrency=args.concurrency,
                           prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                           num_requests=args.num_requests, label=args.label, output_json=args.output_json)
    result = asyncio.run(run_structured_bench(cfg, args.model, EngineConfig(max_num_seqs=args.max_num_seqs),
                                              args.min_items))
    print(format_table(result["levels"], COLUMNS))
    path = write_json(args.output_json or default_json_path(args.label), result)
    print(f"wrote {path}")
    return 0 if all(lv["num_errors"] == 0 for lv in result["levels"]) else 1

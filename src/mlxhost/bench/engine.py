"""`mlxhost bench engine`: the same load as `bench serve`, in-process through the async engine.

Comparing the two tables gives the HTTP layer's cost: same prompts, same metrics, no sockets.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from types import SimpleNamespace

from mlxhost.bench.decode_gap import GAP_COLUMNS, run_gap_bench
from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import TABLE_COLUMNS, ServeBenchConfig, add_load_arguments, default_json_path, summarize_level
from mlxhost.bench.serve_request import RequestResult, make_prompt
from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.platform.backend import default_prefill_step_size
from mlxhost.serving.chat_output import OutputSpec
from mlxhost.serving.prepare import Prepared
from mlxhost.testing.demo import SHAPES, build_model_folder, ensure_demo_model

# What a traced request names as its model (tracing.RequestTracer.watch reads `.name`).
_BENCH_MODEL = SimpleNamespace(name="bench")


async def run_one(engine, tokenizer, cfg: ServeBenchConfig, prompt: str, eos,
                  params: SamplingParams | None = None, adapter: str = "", tracer=None) -> RequestResult:
    """One request through the async engine (under a LoRA adapter's id, if given), timed like `bench serve`
    times one over HTTP. With `tracer` (tracing.RequestTracer) it is traced as the server traces a request."""
    ids = tokenizer.encode(prompt)
    params = params or SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=cfg.ignore_eos)
    if tracer is None:
        return await _timed(engine.generate(Request(uuid.uuid4().hex, ids, params, eos, adapter=adapter)), len(ids))
    request = Request(f"cmpl-{uuid.uuid4().hex}", ids, params, eos, adapter=adapter)
    with tracer.server_span("POST /v1/completions"):
        outputs = tracer.watch(_BENCH_MODEL, Prepared(request, OutputSpec()), engine.generate(request))
        return await _timed(outputs, len(ids))


async def _timed(outputs, num_prompt_tokens: int) -> RequestResult:
    res = RequestResult(num_prompt_tokens=num_prompt_tokens)
    start = time.perf_counter()
    first = last = None
    async for out in outputs:
        now = time.perf_counter()
        if out.error:
            res.error = out.error
            return res
        if first is None:
            first = now
            res.ttft_s = now - start
        else:
            res.itl_s.append(now - last)
        last = now
        res.num_chunks += 1
        res.num_completion_tokens = out.num_output_tokens
    res.e2e_s = time.perf_counter() - start
    res.decode_s = (last - first) if first is not None else None
    return res


async def run_engine_bench(cfg: ServeBenchConfig, model_path: str | None, engine_config: EngineConfig,
                           tracing: str = "off") -> dict:
    """The load's levels; `tracing` "on" traces every request into memory, "ab" runs each level four times on one
    engine, untraced, traced, traced, untraced (drift cancels), and reports one row per mode."""
    from mlxhost.server.app import make_engine, resolve_max_model_len  # lazy: pulls in fastapi

    tracer = provider = exporter = None
    if tracing != "off":
        from mlxhost.tracing import make_memory_tracing  # lazy: the optional otel extra

        tracer, provider, exporter = make_memory_tracing()
    rounds = {"off": [None], "on": [tracer], "ab": [None, tracer, tracer, None]}[tracing]
    loaded = load_model(model_path or str(ensure_demo_model()))
    engine = make_engine(loaded, engine_config, resolve_max_model_len(loaded, engine_config))
    engine.start(asyncio.get_running_loop())
    levels = []
    try:
        for traced in rounds[:2]:  # warms the traced path as well as the engine
            await run_one(engine, loaded.tokenizer, cfg, make_prompt(cfg.seed, "warmup", 0, cfg.prompt_tokens),
                          loaded.eos_token_ids, tracer=traced)
        for pos, c in enumerate(cfg.concurrency):
            runs: dict[bool, tuple[list, float]] = {}
            for k, traced in enumerate(rounds):
                if provider is not None:
                    provider.force_flush()  # the last round's spans leave before this one is timed
                # Prompts of their own in every round: none hits the prefix cache of an earlier one.
                results, wall_s = await _run_level(engine, loaded, cfg, f"L{pos}c{c}r{k}", c, traced)
                before = runs.get(traced is not None, ([], 0.0))
                runs[traced is not None] = (before[0] + results, before[1] + wall_s)
            for on, (results, wall_s) in sorted(runs.items()):
                levels.append(summarize_level(cfg, c, results, wall_s))
                if tracing != "off":
                    levels[-1]["tracing"] = "on" if on else "off"
                print(f"level c={c}{' tracing ' + levels[-1]['tracing'] if tracing != 'off' else ''}: "
                      f"{levels[-1]['agg_tok_s']:.1f} tok/s", flush=True)
    finally:
        engine.stop()
        if provider is not None:
            provider.shutdown()
    result = {"config": {"model": model_path, "tracing": tracing, **cfg.__dict__}, "levels": levels}
    if exporter is not None:
        result["num_spans"] = len(exporter.get_finished_spans())
    return result


async def _run_level(engine, loaded, cfg: ServeBenchConfig, tag: str, c: int, tracer) -> tuple[list, float]:
    """One level's requests, `c` at a time: their results and the wall time they took."""
    n = cfg.num_requests_for(c)
    prompts = [make_prompt(cfg.seed, tag, i, cfg.prompt_tokens) for i in range(n)]
    results: list = [None] * n
    pending = iter(range(n))

    async def worker():
        for i in pending:
            results[i] = await run_one(engine, loaded.tokenizer, cfg, prompts[i], loaded.eos_token_ids, tracer=tracer)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(c, n))))
    return results, time.perf_counter() - start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder or hub id (default: the demo model)")
    add_load_arguments(parser, [1, 16])
    parser.add_argument("--max-num-seqs", type=int, default=64, help="the engine's --max-num-seqs (batch limit)")
    parser.add_argument("--prefill-step-size", type=int, default=None,
                        help="the engine's --prefill-step-size (prompt tokens per step; default: the server's, "
                             "2048 on MLX-CUDA, 512 elsewhere)")
    parser.add_argument("--long-prompt", type=int, default=None, metavar="TOKENS",
                        help="instead: the decode gap of --streams streams while a prompt of TOKENS prefills beside "
                             "them, once per --max-decode-gap value (bench/decode_gap.py)")
    parser.add_argument("--streams", type=int, default=4, help="with --long-prompt: streams decoding meanwhile")
    parser.add_argument("--max-decode-gap", type=float, nargs="+", default=[0.0, 1.0], metavar="SECONDS",
                        help="with --long-prompt: the engine's --max-decode-gap values to compare (0: whole chunks)")
    parser.add_argument("--warm-rounds", type=int, default=1,
                        help="with --long-prompt: untimed rounds before each timed one (shapes compile there)")
    parser.add_argument("--shape", default=None, choices=["tiny", "qwen3-0.6b", "qwen3-8b"],
                        help="a random model of this shape (testing/demo.py SHAPES) instead of --model")
    parser.add_argument("--tracing", choices=("off", "on", "ab"), default="off",
                        help="trace each request as the server does, into memory (the otel extra): on; ab runs "
                             "each level untraced, traced, traced, untraced and gives a row to each")
    parser.add_argument("--label", default="engine", help="name shown in the table and the default JSON name")
    parser.add_argument("--output-json", default=None,
                        help="result file (default: bench-results/serve-<label>-<time>.json)")


def run(args: argparse.Namespace) -> int:
    cfg = ServeBenchConfig(url="http://in-process", model=args.model or "demo", concurrency=args.concurrency,
                           prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                           num_requests=args.num_requests, label=args.label, output_json=args.output_json)

    step = args.prefill_step_size if args.prefill_step_size is not None else default_prefill_step_size()
    engine_config = EngineConfig(max_num_seqs=args.max_num_seqs, prefill_step_size=step)
    if args.long_prompt is not None:
        return run_gap(args, engine_config)
    result = asyncio.run(run_engine_bench(cfg, args.model, engine_config, args.tracing))
    columns = TABLE_COLUMNS if args.tracing == "off" else [TABLE_COLUMNS[0], ("tracing", "tracing", ""),
                                                           *TABLE_COLUMNS[1:]]
    print(format_table(result["levels"], columns))
    path = write_json(args.output_json or default_json_path(args.label), result)
    print(f"wrote {path}")
    return 0 if all(lv["num_errors"] == 0 for lv in result["levels"]) else 1


def run_gap(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        model = (str(build_model_folder(tmp, SHAPES[args.shape])) if args.shape
                 else args.model or str(ensure_demo_model()))
        rows = asyncio.run(run_gap_bench(model, engine_config, args.max_decode_gap, args.streams, args.prompt_tokens,
                                         args.long_prompt, warm_rounds=args.warm_rounds))
    print(format_table(rows, GAP_COLUMNS))
    result = {"config": {"model": args.shape or args.model or "demo", "streams": args.streams,
                         "prefill_step_size": engine_config.prefill_step_size,
                         "warm_rounds": args.warm_rounds}, "rounds": rows}
    path = write_json(args.output_json or default_json_path(f"{args.label}-gap"), result)
    print(f"wrote {path}")
    return 0

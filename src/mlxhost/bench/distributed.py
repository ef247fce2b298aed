"""`mlxhost bench distributed`: one model served by 1 rank vs split over N ranks (tensor or pipeline
parallel), same load, one run: time to ready, greedy output against 1 rank, aggregate tok/s at each
concurrency level, slow steps after ready, and (optionally) the TTFT of a long prompt and a rank killed
mid-stream.

Each layout is a fresh `mlxhost serve` subprocess (`1`: a plain server, `tp2`: --tensor-parallel 2,
`pp2`: --pipeline-parallel 2), measured with `bench serve`'s harness, then stopped. Models are
random-weight folders of real shapes (built once under --model-root), so no download is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from mlxhost.bench.compare import _free_port
from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import ServeBenchConfig, default_json_path, int_list, run_level, run_serve_bench
from mlxhost.testing.demo import (
    EOS_TOKEN,
    PAD_TOKEN,
    SHAPES,
    _pad_vocab,
    _vocab_size,
    build_model_folder,
    build_tokenizer,
)

GREEDY_PROMPTS = ["The history of the river begins", "def fibonacci(n):", "Once upon a time, in a small town",
                  "The three laws of motion are"]


def shapes() -> dict:
    # Qwen3-32B's shape (config.json of Qwen/Qwen3-32B), random weights.
    qwen3_32b = dataclasses.replace(SHAPES["qwen3-8b"], hidden_size=5120, num_hidden_layers=64,
                                    num_attention_heads=64, num_key_value_heads=8, intermediate_size=25600)
    return {"tiny": SHAPES["tiny"], "qwen3-8b": SHAPES["qwen3-8b"], "qwen3-32b": qwen3_32b}


# Qwen2-family shapes: the 8B shape's sizes in a family mlx-lm pipelines itself (its pipeline runs over
# send/recv backends only; Qwen3 and Qwen2 pipeline through distributed/pipeline.py on any backend).
QWEN2_SHAPES = {"qwen2-8b": {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                             "num_key_value_heads": 8, "intermediate_size": 12288, "vocab_size": 151936}}


def parse_layout(text: str) -> tuple[int, int]:
    """`1`, `tpN` or `ppN` -> (tensor parallel, pipeline parallel)."""
    m = re.fullmatch(r"(tp|pp)?(\d+)", text)
    if not m or int(m.group(2)) < 1 or (m.group(1) is None and m.group(2) != "1"):
        raise argparse.ArgumentTypeError(f"a layout is 1, tpN or ppN, not {text!r}")
    n = int(m.group(2))
    return (n, 1) if m.group(1) == "tp" else (1, n) if m.group(1) == "pp" else (1, 1)


def ensure_shape(root: Path, shape: str, bits: int | None) -> Path:
    folder = root / f"{shape}-{bits or 'float'}bit"
    if (folder / "config.json").exists():
        return folder
    print(f"building {folder} (random weights)", flush=True)
    if shape in QWEN2_SHAPES:
        return _build_qwen2(folder, QWEN2_SHAPES[shape], bits)

    config = dataclasses.replace(shapes()[shape], quantize_bits=bits or None, quantize_with_converter=False)
    return build_model_folder(folder, config)


def _build_qwen2(folder: Path, dims: dict, bits: int | None) -> Path:
    import mlx.core as mx  # lazy: mlx only when used
    import mlx.nn as nn  # lazy: mlx only when used
    from mlx_lm.models import qwen2  # lazy: mlx_lm only when used
    from mlx_lm.utils import save_config, save_model  # lazy: mlx_lm only when used

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    tokenizer_json = json.loads((folder / "tokenizer.json").read_text())
    _pad_vocab(folder, tokenizer_json, _vocab_size(tokenizer_json), dims["vocab_size"])  # every id has a text
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **dims, "rms_norm_eps": 1e-6,
              "rope_theta": 1_000_000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "max_position_embeddings": 40960, "eos_token_id": tok.token_to_id(EOS_TOKEN),
              "pad_token_id": tok.token_to_id(PAD_TOKEN), "bos_token_id": None, "torch_dtype": "bfloat16"}
    mx.random.seed(0)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    # Small random weights (std 0.02 as a checkpoint's init): the default init makes huge activations.
    model.update(nn.utils.tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(mx.bfloat16),
                                   model.parameters()))
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits}
    mx.eval(model.parameters())
    save_model(folder, model)
    save_config(config, config_path=folder / "config.json")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    return folder


@dataclasses.dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    ready_s: float
    log_offset: int  # where the log stood at ready: what follows is traffic
    trace_path: Path | None = None
    trace_offset: int = 0  # step-trace lines written before ready (start-up and warm-up steps)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def serving(model: Path, layout: tuple[int, int], args, log_path: Path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlxhost.server.cli", "serve", str(model), "--port", str(port), "--served-model-name",
           "bench", "--max-num-seqs", str(args.max_num_seqs), "--memory-mode", "dedicated", "--no-web-ui",
           "--log-level", "info", *args.server_flag]
    tp, pp = layout
    if tp > 1:
        cmd += ["--tensor-parallel", str(tp), "--backend", args.backend]
    if pp > 1:
        cmd += ["--pipeline-parallel", str(pp), "--backend", args.pp_backend]
    # MLX-CUDA keeps compiled kernels on disk. "fresh": an empty cache of its own, so the layout's start-up and
    # warm-up compile everything, as a first start on a machine would; "shared": the servers' own cache, which
    # the layouts run before filled (a restart's case).
    kernels = tempfile.mkdtemp(prefix="mlx-kernels-")
    env = {**os.environ, "MLX_PTX_CACHE_DIR": kernels} if args.kernel_cache == "fresh" else dict(os.environ)
    trace_path = log_path.with_suffix(".steps.tsv")  # rank 0's engine steps (engine/loop.py's step trace)
    trace_path.unlink(missing_ok=True)
    env["MLXHOST_STEP_TRACE"] = str(trace_path)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = started + args.startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up within {args.startup_timeout:.0f} s; see {log_path}")
            time.sleep(0.25)
        yield Server(url, proc, log_path, time.monotonic() - started, log_path.stat().st_size, trace_path,
                     _count_lines(trace_path))
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: a graceful stop, which also stops the other ranks
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(kernels, ignore_errors=True)


def greedy(url: str, max_tokens: int) -> list[str]:
    """Each prompt alone, greedy: a layout's output must equal 1 rank's."""
    texts = []
    for prompt in GREEDY_PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=120, trust_env=False,
                       json={"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                             "ignore_eos": True})
        r.raise_for_status()
        texts.append(r.json()["choices"][0]["text"])
    return texts


async def measure(url: str, args) -> dict:
    cfg = ServeBenchConfig(url=url, model="bench", concurrency=args.concurrency, prompt_tokens=args.prompt_tokens,
                           max_tokens=args.max_tokens, num_requests=args.num_requests, warmup=args.warmup,
                           endpoint="chat")
    if args.waves:  # fewer requests per level than bench serve's four waves: a shorter run
        levels = []
        if args.warmup:
            await run_level(dataclasses.replace(cfg, num_requests=args.warmup), 1, tag="warmup")
        for pos, c in enumerate(args.concurrency):
            levels.append(await run_level(dataclasses.replace(cfg, num_requests=max(args.waves * c, 2)), c,
                                          tag=f"L{pos}c{c}"))
        result = {"levels": levels}
    else:
        result = {"levels": (await run_serve_bench(cfg))["levels"]}
    if args.long_prompt_tokens:  # TTFT of a long prompt, alone: the prefill's speed-up (or cost) from splitting
        long_cfg = dataclasses.replace(cfg, concurrency=[1], prompt_tokens=args.long_prompt_tokens, max_tokens=4,
                                       num_requests=args.long_requests)
        result["long"] = await run_level(long_cfg, 1, tag="long")
    return result


def _count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def trace_stats(server: Server) -> dict:
    """From rank 0's step trace after ready: the longest step, and the median step of a lone decoding
    stream (the c=1 level's step time; 1 rank against N shows what the collectives add per step)."""
    if server.trace_path is None or not server.trace_path.exists():
        return {}
    lines = server.trace_path.read_text().splitlines()
    head = lines[0].split("\t") if lines else []
    rows = [dict(zip(head, line.split("\t"))) for line in lines[max(server.trace_offset, 1):]]
    steps = [float(r["step_ms"]) for r in rows if r.get("step_ms")]
    lone = sorted(float(r["step_ms"]) for r in rows
                  if r.get("decoding") == "1" and r.get("chunks") == "0" and r.get("step_ms"))
    return {"num_steps": len(steps), "max_step_ms": round(max(steps), 1) if steps else None,
            "lone_decode_step_ms": round(lone[len(lone) // 2], 2) if lone else None}


def step_stats(log_text: str) -> dict:
    """Warm-up time and the engine steps over 1 s that the log reports (`slow engine step: X s`)."""
    slow = [float(x) for x in re.findall(r"slow engine step: ([\d.]+) s", log_text)]
    warm = re.findall(r"warm-up finished ([\d.]+) s after it started", log_text)
    return {"num_slow_steps": len(slow), "max_slow_step_s": max(slow, default=None),
            "warmup_s": float(warm[-1]) if warm else None}


async def _stream_until_end(url: str, i: int, state: dict) -> None:
    body = {"model": "bench", "prompt": f"stream {i}: tell a long story", "max_tokens": 4000, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    outcome = "closed without an error event"
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), trust_env=False) as client:
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("error"):
                        outcome = "error event"
                        break
                    state["tokens"][i] = state["tokens"].get(i, 0) + 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        outcome = f"{type(exc).__name__}"
    state["outcomes"][i] = outcome


async def kill_test(server: Server, streams: int, bound_s: float) -> dict:
    """Streams running, then rank 1 killed: each stream must end with an error event and the server exit."""
    m = re.search(r"started \d+ local rank\(s\) over \w+: pids ([\d, ]+)", server.log())
    if not m:
        return {"error": "no rank pids in the log"}
    victim = int(m.group(1).split(",")[0])
    state: dict = {"tokens": {}, "outcomes": {}}
    tasks = [asyncio.create_task(_stream_until_end(server.url, i, state)) for i in range(streams)]
    deadline = time.monotonic() + bound_s
    while len(state["tokens"]) < streams and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    await asyncio.wait(tasks, timeout=bound_s)
    streams_ended_s = time.monotonic() - killed
    code = None
    while time.monotonic() - killed < bound_s and (code := server.proc.poll()) is None:
        await asyncio.sleep(0.1)
    return {"streams": streams, "streaming_before_kill": len(state["tokens"]),
            "outcomes": [state["outcomes"].get(i, "still open") for i in range(streams)],
            "streams_ended_s": round(streams_ended_s, 2), "exit_code": code,
            "exit_s": round(time.monotonic() - killed, 2) if code is not None else None}


def row(shape: str, layout: str, result: dict, reference: list[str] | None) -> dict:
    r = {"shape": shape, "layout": layout, "ready_s": result.get("ready_s"), **result.get("steps", {})}
    for level in result.get("levels", []):
        r[f"c{level['concurrency']}_tok_s"] = level["agg_tok_s"]
    r["num_errors"] = sum(lv["num_errors"] for lv in result.get("levels", [])) + \
        (result["long"]["num_errors"] if "long" in result else 0)
    if "long" in result:
        r["ttft_long_ms"] = result["long"]["ttft_p50_ms"]
    r["greedy_same"] = None if reference is None or layout == "1" else result.get("greedy") == reference
    if r["greedy_same"] is False:  # how far they agree: leading words equal to 1 rank's, of all
        same = sum(_common_prefix(a.split(), b.split()) for a, b in zip(result["greedy"], reference))
        r["greedy_words_same"] = f"{same}/{sum(len(b.split()) for b in reference)}"
    return r


def _common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def table_columns(concurrency: list[int]) -> list[tuple]:
    return [("shape", "shape", ""), ("layout", "layout", ""), ("ready_s", "ready s", ".0f"),
            ("warmup_s", "warm-up s", ".1f"), *[(f"c{c}_tok_s", f"c={c} tok/s", ".1f") for c in concurrency],
            ("lone_decode_step_ms", "c=1 step ms", ".1f"), ("max_step_ms", "max step ms", ".0f"),
            ("num_slow_steps", "steps >1 s", "d"), ("greedy_same", "greedy = 1 rank", ""),
            ("num_errors", "errors", "d")]


def run(args: argparse.Namespace) -> int:
    root = Path(args.model_root)
    root.mkdir(parents=True, exist_ok=True)
    rows, raw = [], []
    columns = table_columns(args.concurrency)
    for shape in args.shapes:
        model = ensure_shape(root, shape, args.bits)
        reference = None
        for name, layout in args.layouts:
            print(f"{shape}: layout {name}", flush=True)
            log_path = root / f"server-{shape}-{name}.log"
            try:
                with serving(model, layout, args, log_path) as server:
                    result = {"ready_s": round(server.ready_s, 1)}
                    result.update(asyncio.run(measure(server.url, args)))
                    # After the load: a server warming up in the background (1 rank on MLX-CUDA) runs some
                    # shapes through other kernels until its tiled kernels are ready, and on random weights'
                    # near-ties that alone can pick other tokens.
                    result["greedy"] = greedy(server.url, args.greedy_tokens)
                    if name == "1":
                        reference = result["greedy"]
                    result["steps"] = {**step_stats(server.log()[server.log_offset:]), **trace_stats(server)}
                    result["steps"]["warmup_s"] = step_stats(server.log())["warmup_s"]
                    if args.kill_test and name != "1":
                        result["kill"] = asyncio.run(kill_test(server, args.kill_streams, args.kill_bound))
                        print(f"kill test: {result['kill']}", flush=True)
            except (RuntimeError, httpx.HTTPError) as exc:  # one layout that cannot start must not cost the others
                tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
                print(f"{shape} {name} failed: {exc}\n{tail}", flush=True)
                rows.append({"shape": shape, "layout": name, "num_errors": -1, "error": str(exc)})
                raw.append({"shape": shape, "layout": name, "error": str(exc), "log_tail": tail})
                continue
            rows.append(row(shape, name, result, reference))
            raw.append({"shape": shape, "layout": name, **result})
            print(format_table(rows[-1:], columns), flush=True)
    print()
    print(format_table(rows, columns))
    path = write_json(args.output_json or default_json_path("distributed"), {"rows": rows, "runs": raw,
                                                                             "bits": args.bits})
    print(f"wrote {path}")
    return 0 if all(r["num_errors"] == 0 and r.get("greedy_same") is not False for r in rows) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    layouts = lambda s: [(x, parse_layout(x)) for x in names(s)]  # noqa: E731
    parser.add_argument("--shapes", type=names, default=["qwen3-8b"],
                        help="comma list of: tiny, qwen3-8b, qwen3-32b, qwen2-8b (random weights, built under "
                             "--model-root; qwen2-8b is the 8B sizes in a family mlx-lm pipelines)")
    parser.add_argument("--bits", type=int, default=4, help="quantize the shapes to this many bits (0: bf16/float)")
    parser.add_argument("--layouts", type=layouts, default=layouts("1,tp2"),
                        help="comma list of 1, tpN, ppN; 1 first: the others' greedy output is compared with it")
    parser.add_argument("--backend", default="nccl", choices=["ring", "nccl", "jaccl", "mpi"],
                        help="mx.distributed backend of tensor-parallel layouts")
    parser.add_argument("--pp-backend", default="nccl", choices=["ring", "nccl", "jaccl", "mpi"],
                        help="backend of pipeline-parallel layouts (over NCCL stages hand off by all-gather)")
    parser.add_argument("--model-root", default="bench-models", help="where the shape folders are built and kept")
    parser.add_argument("--concurrency", type=int_list, default=[1, 16, 32], help="comma list of concurrency levels")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--num-requests", type=int, default=None, help="per level (default: 4 waves)")
    parser.add_argument("--waves", type=int, default=0,
                        help="requests per level = waves x concurrency (at least 2; 0: bench serve's four waves)")
    parser.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    parser.add_argument("--greedy-tokens", type=int, default=32, help="tokens of each greedy comparison")
    parser.add_argument("--long-prompt-tokens", type=int, default=0, help="TTFT of a prompt this long (0: skip)")
    parser.add_argument("--long-requests", type=int, default=3, help="long prompts timed one at a time (median)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="the servers' batch limit")
    parser.add_argument("--kill-test", action="store_true",
                        help="after each multi-rank layout's load: kill rank 1 under streams, time the exit")
    parser.add_argument("--kill-streams", type=int, default=8, help="streams open when rank 1 is killed")
    parser.add_argument("--kill-bound", type=float, default=60.0, help="seconds the streams and the exit may take")
    parser.add_argument("--kernel-cache", choices=["shared", "fresh"], default="shared",
                        help="MLX-CUDA's on-disk kernel cache: the servers' own (shared by the layouts, in order) "
                             "or an empty one per layout")
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                        help="extra flag for every server (repeatable; e.g. --server-flag=--warmup=on)")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds a server may take to come up")
    parser.add_argument("--output-json", default=None, help="result file (default: bench-results/distributed-*.json)")

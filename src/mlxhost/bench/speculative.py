"""`mlxhost bench speculative`: decode speed with speculative decoding off, by prompt lookup (ngram) and
by draft models of several acceptance rates, single stream and concurrent, in-process on the engine core.

Random weights have no real small sibling, so the drafts are made from the target
(testing/perturb.py): `self` (the target drafting for itself: 100% acceptance, and a draft as costly as
the target), `noise:X` (the target with noise on its weights: lower acceptance, same cost) and
`layers:N` (its first N layers: cheap, acceptance whatever it turns out to be). `eagle3[:STEPS]` and
`mtp[:STEPS]` are draft heads fed the target's hidden states, trained here for STEPS steps on the target's
own greedy continuations of random prompts (testing/spec_heads.py); `dflash[:STEPS]` a DFlash drafter
(random weights, or trained STEPS steps). `auto` is `--speculative auto` (prompt lookup behind the policy that
turns drafting off where it does not pay), `off` a second plain run (the run-to-run spread). `oracle` replays the
greedy output the `off` run recorded (every draft accepted, no drafting cost: the machinery's ceiling where the
verify rounds as the plain step does, which on random weights on MLX-CUDA needs `--peaked`; `--oracle-recording`
keeps the file). The acceptance column is measured, not chosen. Workloads: `random` (random-token prompts) and
`echo` (a passage repeated in the prompt: what prompt lookup is for; a random model continues it only as far as
its own output loops).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import tempfile
import time
from pathlib import Path

from mlxhost.bench.report import format_table, write_json
from mlxhost.bench.serve import default_json_path, int_list
from mlxhost.config import EngineConfig
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.spec.oracle import save_recording
from mlxhost.models.loader import load_model
from mlxhost.platform.cudnn_attention import apply_cudnn_attention
from mlxhost.testing.demo import SHAPES, build_model_folder
from mlxhost.testing.perturb import perturbed_copy, truncated_copy

_COLUMNS = [
    ("workload", "workload", ""), ("concurrency", "c", "d"), ("mode", "speculative", ""),
    ("acceptance", "accepted", ".2f"), ("tokens_per_step", "tok/row-step", ".2f"), ("plain_steps", "plain steps", "d"),
    ("tok_s", "tok/s", ".1f"),
    ("speedup", "vs off", ".2f"),
]


_HEADS = ("eagle3", "mtp")
_HIDDEN = (*_HEADS, "dflash")  # proposers fed the target's hidden states, `--speculative KIND`


def build_models(shape: str, bits: int | None, drafts: list[str], root: Path,
                 peaked: bool = False) -> tuple[Path, dict[str, Path]]:
    """The target folder (a random model of `shape`, `peaked`: testing/demo.py make_peaked_weights) and one
    folder per draft spec."""
    from mlxhost.testing.spec_heads import build_dflash_folder, build_head_folder  # lazy: pulls in mlx_lm

    config = SHAPES[shape]
    if peaked:
        config = dataclasses.replace(config, peaked=True, tie_word_embeddings=False)
    if bits is not None:
        config = dataclasses.replace(config, quantize_bits=bits, quantize_with_converter=False)
    target = build_model_folder(root / "target", config)
    out = {}
    for spec in drafts:
        kind, _, value = spec.partition(":")
        if kind == "self":
            out[spec] = target
        elif kind == "noise":
            out[spec] = perturbed_copy(target, root / spec.replace(":", "-"), float(value))
        elif kind == "layers":
            out[spec] = truncated_copy(target, root / spec.replace(":", "-"), int(value))
        elif kind in _HEADS:
            out[spec] = build_head_folder(root / spec.replace(":", "-"), target, kind,
                                          train_steps=int(value) if value else 300)
        elif kind == "dflash":
            out[spec] = build_dflash_folder(root / spec.replace(":", "-"), target, train_steps=int(value or 0))
        elif kind not in ("oracle", "auto", "off"):  # the oracle's recording comes from the `off` run
            raise SystemExit(f"unknown draft {spec!r}: use self, noise:X, layers:N, eagle3[:STEPS], mtp[:STEPS], "
                             "dflash[:STEPS], oracle, auto or off")
    return target, out


def make_prompts(workload: str, n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        if workload == "echo":
            passage = [rng.randrange(3, vocab) for _ in range(32)]
            prompts.append((passage * (length // 32 + 1))[:length])
        else:
            prompts.append([rng.randrange(3, vocab) for _ in range(length)])
    return prompts


def run_wave(core, prompts: list[list[int]], max_tokens: int, outputs: dict | None = None) -> tuple[int, float]:
    """All prompts at once; returns (completion tokens, seconds). `outputs`: filled with prompt -> tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = {}
    for i, p in enumerate(prompts):
        ids[f"b{time.monotonic_ns()}-{i}"] = tuple(p)
        core.add_request(Request(list(ids)[-1], p, params))
    n, start = 0, time.perf_counter()
    while core.has_work:
        for out in core.step():
            if out.error:
                raise RuntimeError(out.error)
            n += len(out.new_token_ids)
            if outputs is not None:
                outputs.setdefault(ids[out.request_id], []).extend(out.new_token_ids)
    return n, time.perf_counter() - start


def measure(loaded, mode: str, draft_dir: Path | None, args, workload: str, c: int, vocab: int,
            recorded: dict | None = None) -> dict:
    """One mode's row; `recorded`: filled with each prompt's greedy output (the `off` run, for `oracle`)."""
    from mlxhost.engine.core import EngineCore  # lazy: pulls in mlx_lm

    if mode in ("ngram", "auto"):
        spec = {"speculative": mode}
    else:
        spec = {"draft_model": str(draft_dir)} if draft_dir else {}
    if mode.partition(":")[0] in (*_HIDDEN, "oracle"):
        spec["speculative"] = mode.partition(":")[0]
    config = EngineConfig(max_num_seqs=max(c, 1), enable_prefix_cache=False, num_draft_tokens=args.num_draft_tokens,
                          spec_max_batch=args.spec_max_batch, **spec)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=args.prompt_tokens + args.max_tokens + 64)
    # The measured wave's own prompts first: greedy, they take the same steps again, so every kernel
    # MLX-CUDA compiles for a new shape (seconds each, e.g. a quantized matmul's tile) is ready.
    run_wave(core, make_prompts(workload, c, args.prompt_tokens, vocab, seed=2), args.max_tokens)
    before = core.spec_stats()
    n, seconds = run_wave(core, make_prompts(workload, c, args.prompt_tokens, vocab, seed=2), args.max_tokens,
                          recorded)
    after = core.spec_stats()
    row = {"workload": workload, "concurrency": c, "mode": mode, "tok_s": n / seconds, "tokens": n,
           "seconds": seconds}
    if after["mode"] != "off":
        drafted = after["num_drafted"] - before["num_drafted"]
        accepted = after["num_accepted"] - before["num_accepted"]
        row.update(acceptance=accepted / drafted if drafted else 0.0, drafted=drafted, accepted=accepted,
                   spec_steps=after["num_steps"] - before["num_steps"],
                   plain_steps=after["num_plain_steps"] - before["num_plain_steps"],
                   row_pauses=after["num_row_pauses"] - before["num_row_pauses"])
        if row["spec_steps"]:  # tokens a row emits per speculative step (1 without speculation)
            row["tokens_per_step"] = (after["num_emitted"] - before["num_emitted"]) / (row["spec_steps"] * c)
    return row


def run_spec_bench(args) -> dict:
    # One attention path for every row, the "off" baseline included (MLX decides once per process).
    print(f"cuDNN attention: {apply_cudnn_attention(args.cudnn_attention)}", flush=True)
    drafts = [d for d in args.drafts.split(",") if d]
    with tempfile.TemporaryDirectory(prefix="mlxhost-bench-spec-") as tmp:
        t0 = time.perf_counter()
        target, draft_dirs = build_models(args.shape, args.bits, drafts, Path(tmp), args.peaked)
        print(f"built target and {len(drafts)} drafts in {time.perf_counter() - t0:.1f} s", flush=True)
        loaded = load_model(str(target))
        vocab = min(len(loaded.tokenizer), 2000)
        rows, kept = [], {}
        for workload in args.workloads.split(","):
            for c in args.concurrency:
                modes = ["off", "ngram"] + [d for d in drafts if workload != "echo" or d in ("oracle", "auto", "off")]
                level, recorded = [], {}
                for mode in modes:
                    if mode == "oracle":  # replays what `off` just decoded (every level's prompts so far)
                        kept.update(recorded)
                        draft_dirs[mode] = save_recording(args.oracle_recording or Path(tmp) / "oracle.json", kept)
                    row = measure(loaded, mode, draft_dirs.get(mode), args, workload, c, vocab,
                                  recorded if mode == "off" and "oracle" in drafts else None)
                    gc.collect()  # the last core's draft model and caches, before the next loads its own
                    row["speedup"] = row["tok_s"] / (level[0]["tok_s"] if level else row["tok_s"])
                    level.append(row)
                    rows.append(row)
                    print(format_table([row], _COLUMNS), flush=True)
                    # Written as it goes: a run cut short by a time limit keeps what it measured.
                    write_json(json_path(args), {"config": _config(args), "rows": rows})
    return {"config": _config(args), "rows": rows}


def _config(args) -> dict:
    # Values the JSON cannot hold (objects the shared bench flags parse into) as their text.
    return {k: v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v)
            for k, v in vars(args).items() if k != "func"}


def json_path(args) -> str:
    if args.output_json is None:
        args.output_json = str(default_json_path("speculative"))
    return args.output_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="tiny", choices=["tiny", "qwen3-0.6b", "qwen3-8b"],
                        help="target: a random model of this shape (testing/demo.py SHAPES)")
    parser.add_argument("--bits", type=int, default=None, help="quantize the target (and drafts) to this many bits")
    parser.add_argument("--peaked", action="store_true",
                        help="a target whose greedy token wins by a wide logit margin (same shapes and cost), for "
                             "every row: the oracle stays a ceiling where the verify forward rounds differently from "
                             "the plain step (MLX-CUDA); its output walks one fixed cycle through the vocabulary")
    parser.add_argument("--drafts", default="self,noise:0.03,noise:0.1,layers:1,eagle3,mtp",
                        help="draft models, comma-separated: self, noise:X (target + noise), layers:N (first N layers),"
                             " eagle3[:STEPS] / mtp[:STEPS] (a head trained STEPS steps on the target's output),"
                             " dflash[:STEPS] (a DFlash drafter), oracle (replays the off run's output: the ceiling),"
                             " auto"
                             " (--speculative auto: ngram behind the policy), off (plain again: the spread)")
    parser.add_argument("--oracle-recording", default=None,
                        help="with --drafts ...,oracle: where the `off` run's greedy output is recorded for the oracle "
                             "to replay (JSON, prompt -> tokens; default: a temporary file). It serves again with "
                             "`mlxhost serve --speculative oracle --speculative-model FILE`")
    parser.add_argument("--workloads", default="random,echo",
                        help="comma list of: random (random-token prompts), echo (a passage repeated in the prompt)")
    parser.add_argument("--concurrency", type=int_list, default=[1, 16], help="comma list of concurrency levels")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of each request")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="most tokens a row drafts per step")
    parser.add_argument("--cudnn-attention", choices=["auto", "on", "off"], default="auto",
                        help="MLX-CUDA: cuDNN attention for every row, the baseline too (auto: off, as serve)")
    parser.add_argument("--spec-max-batch", type=int, default=EngineConfig.spec_max_batch,
                        help="speculate only while at most this many requests decode (the server's --spec-max-batch); "
                             "set it to the largest concurrency to measure speculation at every level")
    parser.add_argument("--output-json", default=None, help="result file (default: bench-results/speculative-*.json)")


def run(args: argparse.Namespace) -> int:
    result = run_spec_bench(args)
    print(format_table(result["rows"], _COLUMNS))
    path = write_json(json_path(args), result)
    print(f"wrote {path}")
    return 0

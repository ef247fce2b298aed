"""`mlxhost` command line: parses flags into configs and calls the pieces. Kept thin."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import logging
import os
import sys

from mlxhost import __version__
from mlxhost.server import foreign_flags
from mlxhost.server.serve_command import add_serve_command
from mlxhost.server.settings import ArgumentParser, HelpFormatter

log = logging.getLogger(__name__)


def _demo_model(args) -> int:
    # lazy: keeps the command line's start-up short (each command imports what it runs)
    from mlxhost.testing.demo import SHAPES, build_model_folder, ensure_demo_model
    from mlxhost.testing.families import FAMILIES, FAMILY_SHAPES, build_family_folder
    from mlxhost.testing.vlm_demo import CLI_SHAPES as VLM_SHAPES, build_vlm_folder

    if args.shape in FAMILIES or args.shape in FAMILY_SHAPES:
        if args.path is None or args.bits is not None or args.peaked:
            raise SystemExit("family shapes need a PATH and take no --bits or --peaked")
        print(build_family_folder(args.path, args.shape))
        return 0
    if args.shape in VLM_SHAPES:
        if args.path is None or args.bits is not None or args.peaked:
            raise SystemExit("VLM shapes need a PATH and take no --bits or --peaked")
        # lazy: keeps the command line's start-up short
        from mlxhost.models.extras import MissingExtraError, require_vision

        try:
            require_vision(f"--shape {args.shape}")
        except MissingExtraError as e:
            raise SystemExit(f"mlxhost demo-model: {e}") from None
        print(build_vlm_folder(args.path, shape=args.shape))
        return 0
    from mlxhost.server.progress import StageLog  # lazy: keeps the command line's start-up short

    progress = StageLog("demo model")
    if args.shape == "tiny" and args.bits is None and not args.peaked:
        path = ensure_demo_model(args.path, progress=progress)
        progress.done()
        print(path)
        return 0
    if args.path is None:
        raise SystemExit("a PATH is needed with --shape, --bits or --peaked")
    config = dataclasses.replace(SHAPES[args.shape], quantize_bits=args.bits, group_size=args.group_size,
                                 quantize_with_converter=args.shape == "tiny")
    if args.peaked:
        config = dataclasses.replace(config, peaked=True, tie_word_embeddings=False)
    path = build_model_folder(args.path, config, progress=progress)
    progress.done()
    print(path)
    return 0


def _convert(args) -> int:
    from mlxhost.models import convert  # lazy: keeps the command line's start-up short
    from mlxhost.models.loader import ModelLoadError  # lazy: keeps the command line's start-up short
    from mlxhost.models.source import resolve_source  # lazy: keeps the command line's start-up short

    try:  # the same checks and the same one hub request as `serve`; a hub id is converted from its download
        args.hf_path = str(resolve_source(args.hf_path))
    except ModelLoadError as e:
        print(f"mlxhost convert: {e}", file=sys.stderr)
        return 2
    return convert.run(args)


def make_parser(with_bench: bool = True) -> argparse.ArgumentParser:
    """The whole command line; `with_bench=False` leaves out the bench commands' flags, whose modules take
    seconds to import (a mistyped `serve` path is reported faster)."""
    # Every parser shows each flag's default in --help and says an error in one line (settings.py).
    make = functools.partial(ArgumentParser, formatter_class=HelpFormatter)
    parser = make(prog="mlxhost", description="MLX-native OpenAI-compatible server")
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log verbosity")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=make)

    add_serve_command(sub)

    from mlxhost.models import catalog, pull  # lazy: keeps the command line's start-up short

    pull_cmd = sub.add_parser("pull", help="download a model from the Hugging Face hub into its cache")
    pull.add_arguments(pull_cmd)
    pull_cmd.set_defaults(func=pull.run)
    list_cmd = sub.add_parser("list", help="models on this machine: size, bits, family, whether mlxhost serves it")
    list_cmd.add_argument("--model-dir", action="append", default=[], metavar="DIR",
                          help="also list the model folders inside DIR (repeatable; default: MLXHOST_MODEL_DIR)")
    list_cmd.add_argument("--no-hf-cache", action="store_true", help="skip the Hugging Face cache")
    list_cmd.add_argument("--server", default="http://127.0.0.1:8000", metavar="URL",
                          help="also list what the server at URL serves (its /v1/models); '' to skip")
    list_cmd.set_defaults(func=catalog.run_list)

    from mlxhost.testing.families import FAMILIES, FAMILY_SHAPES  # lazy: keeps the command line's start-up short

    demo = sub.add_parser("demo-model", help="build the offline demo model (tiny, random weights)")
    demo.add_argument("path", nargs="?", default=None, help="output folder (default: the user cache dir)")
    demo.add_argument("--shape", default="tiny",
                      choices=["tiny", "qwen3-0.6b", "qwen3-8b", "qwen2-vl-tiny", "qwen2.5-vl-tiny", "qwen3-vl-tiny",
                               "qwen2.5-vl-3b", "qwen3-vl-2b", "gemma3-tiny", *FAMILIES, *FAMILY_SHAPES],
                      help="a real model's shape with random weights (for benchmarks); *-vl-*, gemma3-tiny: "
                           "vision-language; tiny test fixtures of each mlx-lm family: " + ", ".join(FAMILIES)
                           + "; bfloat16 text models for GPU benchmarks: " + ", ".join(FAMILY_SHAPES))
    demo.add_argument("--bits", type=int, default=None, help="quantize to this many bits")
    demo.add_argument("--group-size", type=int, default=64, help="quantization group size (with --bits)")
    demo.add_argument("--peaked", action="store_true",
                      help="text shapes: greedy tokens win by a wide logit margin (same shapes and cost; for "
                           "benchmarks of speculative decoding, see docs/speculative.md)")
    demo.set_defaults(func=_demo_model)

    from mlxhost.agents import launch  # lazy: keeps the command line's start-up short

    launch_cmd = sub.add_parser("launch", help="run a coding agent (claude, codex, opencode, qwen) against a served"
                                               " model, starting a server if none answers; -- ARGS go to the agent")
    launch.add_arguments(launch_cmd)
    launch_cmd.set_defaults(func=launch.run)

    conv = sub.add_parser("convert", help="quantize a Hugging Face model (block-wise, via mlx-lm), or turn a GGUF"
                                          " file into an MLX model folder",
                          description="Quantize a Hugging Face model folder or hub id block-wise (via mlx-lm), or"
                                      " turn a GGUF file (llama.cpp, Ollama, LM Studio) into an MLX model folder:"
                                      " Q4_0, Q4_1 and Q8_0 tensors stay quantized as they are, other types"
                                      " (K-quants, Q5_0, IQ*) are dequantized, then quantized to --bits.")
    conv.add_argument("hf_path", metavar="SOURCE",
                      help="Hugging Face model folder or hub id, or a .gguf file (or a folder holding one)")
    conv.add_argument("out", metavar="OUT", help="output folder (must not exist, or be empty)")
    conv.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 5, 6, 8],
                      help="bits per weight; a GGUF takes 4 or 8, for the tensors that had to be dequantized")
    conv.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128],
                      help="weights sharing one scale and bias")
    conv.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                      help="dtype of the unquantized weights and of the scales (default: the model's; float16 for"
                           " a GGUF)")
    conv.set_defaults(func=_convert)

    from mlxhost.export import coreml as coreml_export  # no coremltools/torch import until it runs

    export = sub.add_parser("export", help="export a model folder for another runtime").add_subparsers(
        dest="export", required=True, parser_class=make)
    coreml_cmd = export.add_parser("coreml", help="Core ML package for macOS/iOS apps: KV cache as state, flexible"
                                                  " shapes, fused SDPA, optional int4 (the `coreml` extra)")
    coreml_export.add_arguments(coreml_cmd)
    coreml_cmd.set_defaults(func=coreml_export.run)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True,
                                                                      parser_class=make)
    for name, help_text in () if not with_bench else (
        ("serve", "streaming HTTP load against an OpenAI-compatible server"),
        ("engine", "the engine in-process, no HTTP"),
        ("decode", "one stream: mlx-lm generate_step vs the engine core vs the async engine"),
        ("compare", "mlxhost vs mlx_lm.server, same model and load, one run"),
        ("prefix", "TTFT with a shared prefix: cold vs prefix-cache hit"),
        ("burst", "TTFT of each prompt of a mixed-length burst, per --max-num-prefill-rows / step size"),
        ("memory", "memory over a long generation with/without --kv-prealloc; peak of a burst with"
                   " admission on/off"),
        ("load", "weight-loading strategies: load time and peak RSS, cold/warm page cache"),
        ("multimodal", "multi-turn TTFT about one image/video: vision cache, KV cache, both"),
        ("kvquant", "--kv-bits: aggregate tok/s at 16 concurrent and long contexts per memory budget,"
                    " float vs 8-bit vs 4-bit KV"),
        ("structured", "aggregate tok/s with every row under a JSON schema vs free; mask time"),
        ("distributed", "one model on 1 rank vs split over N (--tensor-parallel): tok/s, long-prompt"
                        " TTFT"),
        ("speculative", "decode tok/s with speculative decoding off / ngram / draft models of"
                        " several acceptance rates, single stream and concurrent"),
        ("lora", "aggregate tok/s of N streams over K LoRA adapters vs N streams on the base model"),
        ("batch", "interactive TTFT while a Batch API job runs vs the idle server"),
        ("prewarm", "an agent's first-turn TTFT, cold vs pre-warmed as `mlxhost launch` does it"),
        ("plot", "PNG charts of `bench serve` result files, side by side (the `plot` extra)"),
        ("coreml", "an exported Core ML package on this Mac: prompt TTFT and extend tok/s per context"
                   " (macOS only)"),
    ):
        module = importlib.import_module(f"mlxhost.bench.{name}")
        command = bench.add_parser(name, help=help_text)
        module.add_arguments(command)
        command.set_defaults(func=module.run)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # lazy: importlib.metadata only when used

    def of(name: str) -> str:
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            return f"{name} not installed"

    return f"mlxhost {__version__} ({of('mlx')}, {of('mlx-lm')}, {of('mlx-vlm')})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # First, before anything imports mlx.core: MLX's CPU wheel then multiplies with the system's OpenBLAS.
    from mlxhost.platform.blas import use_system_blas

    blas = use_system_blas()
    from mlxhost.agents.launch import split_agent_args  # lazy: keeps the command line's start-up short

    argv, agent_args = split_agent_args(argv)  # `launch ... -- ARGS`: ARGS reach the agent untouched
    parser = make_parser(with_bench="bench" in argv)
    argv, notes = foreign_flags.rewrite_serve_argv(parser, argv)
    args = foreign_flags.parse(parser, argv)
    if agent_args:
        args.agent_args = agent_args
    settings_parser = getattr(args, "settings_parser", None)
    if settings_parser is not None:
        # serve: MLXHOST_<FLAG> and --config become its defaults, then the flags are parsed again over them.
        from mlxhost.server.settings import settings_defaults

        try:
            settings_parser.set_defaults(**settings_defaults(settings_parser,
                                                             args.config or os.environ.get("MLXHOST_CONFIG"),
                                                             notes=notes))
        except ValueError as e:
            settings_parser.error(str(e))
        args = foreign_flags.parse(parser, argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for note in notes:
        log.info(note)
    from mlxhost.server.banner import blas_hint  # lazy: keeps the command line's start-up short

    # Plain data (bench writes its args to JSON): serve's banner tells a CPU user without OpenBLAS how to get it.
    args.speed_hint = blas_hint(blas)
    log.debug("BLAS for MLX's CPU backend: %s%s", blas.reason, f" ({blas.loaded})" if blas.loaded else "")
    if args.log_level == "info":  # HTTP clients log a line per request (hub look-ups, downloads): debug only
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

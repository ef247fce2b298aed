"""`mlxhost serve`: its flags, the configs they become, and the run (port, app, banner, serve)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import platformdirs

from mlxhost.config import (
    LOAD_STRATEGIES,
    SERVE_MAX_DECODE_GAP_S,
    EngineConfig,
    MediaConfig,
    SecurityConfig,
    ServerConfig,
    parse_memory,
)
from mlxhost.engine.spec.registry import proposer_names
from mlxhost.platform.backend import default_prefill_step_size
from mlxhost.server.settings import fraction, size
from mlxhost.structured.tool_formats import TOOL_PARSER_NAMES, get_tool_parser


def add_serve_command(sub) -> argparse.ArgumentParser:
    """The `serve` subcommand on the parser's subcommands `sub`. Its argument groups are --help's sections and
    docs/flags.md's tables (server/flags_doc.py)."""
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help="local model folder, .gguf file or Hugging Face id (default: the built-in demo model)")
    serve.add_argument("--config", default=None, metavar="YAML",
                       help="settings file: any flag below as a key (dashes or underscores); environment variables"
                            " MLXHOST_<FLAG> override it, flags override both (default: MLXHOST_CONFIG)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the `model` clients send (default: folder name or id)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="log verbosity")
    serve.add_argument("--no-web-ui", action="store_true", help="no chat page and dashboard at /")
    serve.add_argument("--shutdown-timeout", type=float, default=ServerConfig().shutdown_timeout_s, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, how long running streams may finish before they end with an error"
                            " event (a second signal ends them at once: their error events get up to 2 s to leave)")
    serve.add_argument("--load-strategy", default="auto", choices=("auto",) + LOAD_STRATEGIES,
                       help="how weights are read: mlx-lm (its own load), chunked (a few hundred MB at a time), mmap"
                            " (memory-mapped, copied tensor by tensor); auto: by total weight size (models/loader.py)")
    serve.add_argument("--cpu-weights", default="auto", choices=("auto", "float32", "keep"),
                       help="text model weights on MLX's CPU backend: auto serves them as float32 (dequantized) when"
                            " that takes at most a quarter of RAM, MLX's fastest CPU layout; keep: as loaded."
                            " Metal and CUDA always keep them")

    serve.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSER_NAMES,
                       help="how the model writes tool calls (default: read off its chat template / model type)")
    serve.add_argument("--fim", default="auto", choices=("auto", "on", "off"),
                       help="fill-in-the-middle (`suffix` on /v1/completions and /api/generate) for models with its"
                            " marker tokens: auto (those named as code models), on (any), off (docs/api.md)")
    _add_models_flags(serve.add_argument_group("several models"))
    _add_engine_flags(serve)
    from mlxhost.distributed.config import add_distributed_flags  # lazy: keeps the command line's start-up short

    add_distributed_flags(serve.add_argument_group("distributed (docs/distributed.md)"))
    _add_media_flags(serve.add_argument_group("images and video in requests"))
    _add_security_flags(serve.add_argument_group("security (docs/security.md)"))
    _add_mcp_flags(serve.add_argument_group("MCP tools (docs/mcp.md)"))
    _add_team_flags(serve.add_argument_group("batches and tracing (docs/batch.md, docs/tracing.md)"))
    serve.set_defaults(func=_serve, settings_parser=serve)  # main() fills its defaults from env and --config
    return serve


def _add_models_flags(p) -> None:
    p.add_argument("--model", dest="extra_models", action="append", default=[], metavar="[NAME=]PATH",
                   help="serve several models, each loaded on first use (repeatable; instead of MODEL)")
    p.add_argument("--model-dir", action="append", default=[], metavar="DIR",
                   help="serve every model folder inside DIR, named after its folder, each loaded on first use"
                        " (repeatable)")
    p.add_argument("--models-config", default=None, metavar="YAML",
                   help="models to serve: name, path, pinned, ttl, aliases, engine settings (format in"
                        " models/specs.py; docs/serving.md)")
    p.add_argument("--lora", action="append", default=[], metavar="[BASE:]NAME=PATH",
                   help="serve the LoRA adapter at PATH (mlx-lm's or PEFT's format) as model NAME on the base "
                        "model, batched with it (repeatable; docs/lora.md)")
    p.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                   help="most models loaded at once; the least recently used idle unpinned one is unloaded"
                        " (default: no limit)")
    p.add_argument("--max-loaded-memory", type=size, default=None, metavar="SIZE",
                   help="most weight bytes loaded at once (8GB, 50%%) (default: what the memory budget leaves)")


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p = parser.add_argument_group("batching and scheduling")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, metavar="N",
                   help="requests decoded together; more wait in a FIFO queue")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="context length; a prompt + max_tokens beyond it is a 400 (default: the model's"
                        " max_position_embeddings)")
    p.add_argument("--prefill-step-size", type=int, default=None, metavar="TOKENS",
                   help=f"prompt tokens per engine step; longer prompts are split so running streams keep flowing "
                        f"(default: 2048 on MLX-CUDA, {d.prefill_step_size} elsewhere)")
    p.add_argument("--max-decode-gap", type=float, default=SERVE_MAX_DECODE_GAP_S, metavar="SECONDS",
                   help="while streams decode, a long prompt's prefill chunks shrink (sized from measured step "
                        "times) so each stream's next token comes within this many seconds; a prompt with nothing "
                        "else running still prefills whole chunks. 0: whole chunks always")
    p.add_argument("--max-num-prefill-rows", type=int, default=d.max_num_prefill_rows, metavar="N",
                   help="prompts prefilled together in one forward, sharing the step's tokens fairly (plain-KV"
                        " families; sliding-window, recurrent-state and vision models prefill one prompt at a time);"
                        " 1: one prompt at a time, oldest first")
    p.add_argument("--prefill-wait-steps", type=int, default=d.prefill_wait_steps, metavar="N",
                   help="while rows decode, let a new prompt wait up to N engine steps for others, so several "
                        "prefill in one forward (fewer, fuller prefill steps; TTFT up by at most N decode steps); "
                        "never while nothing decodes, no longer once --max-num-prefill-rows prompts wait; 0: at once")
    p.add_argument("--priority-aging-steps", type=int, default=d.priority_aging_steps, metavar="N",
                   help="a waiting request's priority class (the `priority` field, an API key's class) improves by "
                        "one every N engine steps, so no class starves; 0: no aging")
    p.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens, metavar="N",
                   help="max_tokens when a request names none (capped by the context left)")
    p.add_argument("--warmup", choices=["auto", "background", "on", "off"], default=d.warmup,
                   help="run the decode batch sizes and traffic's paths once: background (while serving, between "
                        "requests), on (before serving); auto: background on CUDA, which compiles per shape, else off")
    p.add_argument("--decode-buckets", choices=["auto", "on", "off"], default=d.decode_buckets,
                   help="pad the decode batch to a few fixed sizes (auto: on for CUDA, which compiles per shape, so"
                        " warm-up covers ~10 sizes)")
    p.add_argument("--cudnn-attention", choices=["auto", "on", "off"], default=d.cudnn_attention,
                   help="MLX-CUDA: multi-token attention through cuDNN, which builds a graph per new shape (40-80 ms)"
                        "; auto: off (served prompts rarely repeat a shape), on: MLX's default."
                        " MLX_CUDA_USE_CUDNN_SDPA in the environment wins")
    p = parser.add_argument_group("memory and caches (docs/caching.md)")
    p.add_argument("--memory-mode", choices=["desktop", "dedicated"], default=d.memory_mode,
                   help="desktop: leave room for other apps, follow free memory while running; dedicated: a"
                        " server box, take --memory-utilization of the GPU working set (RAM on CPU)")
    p.add_argument("--memory-utilization", type=fraction, default=d.memory_utilization, metavar="SHARE",
                   help="dedicated mode: share of the GPU working set (RAM on CPU) this server may use")
    p.add_argument("--kv-budget-tokens", type=int, default=None, metavar="TOKENS",
                   help="KV tokens running requests may hold at once; more wait (default: from the memory budget)")
    p.add_argument("--kv-prealloc", type=int, default=d.kv_prealloc_tokens, metavar="TOKENS",
                   help="reserve KV for this many positions per decode batch up front, so memory stays flat while"
                        " sequences grow (0: off; past it the cache grows in 256-token steps)")
    p.add_argument("--kv-bits", type=int, choices=[4, 8], default=None,
                   help="quantize the KV cache to 8 or 4 bits (decode batch, prefills, prefix cache and SSD tier):"
                        " about 1.9x / 3.5x the tokens of bf16 KV in the same memory (default: the model's float)")
    p.add_argument("--kv-quant-mode", choices=["auto", "quantized", "dequantized"], default=d.kv_quant_mode,
                   help="how attention reads --kv-bits KV: quantized (MLX's quantized kernels, Metal/CPU), dequantized"
                        " (stored quantized, dequantized per layer: MLX-CUDA); auto: the first that works")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=d.kv_group_size,
                   help="values per quantization group of --kv-bits (must divide the attention head dim)")
    p.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off")
    p.add_argument("--block-size", type=int, default=d.block_size, metavar="TOKENS",
                   help="prefix-cache block size in tokens")
    p.add_argument("--cache-memory", type=size, default=None, metavar="SIZE",
                   help="prefix-cache memory: bytes (2GB, 512MiB) or a percent of RAM (20%%); desktop mode shrinks"
                        " it first under memory pressure (default: the memory budget's prefix share, a quarter of"
                        " what weights and activations leave; 512MiB when no budget can be computed)")
    p.add_argument("--ssd-cache-dir", default=None, metavar="DIR",
                   help="folder of the prefix cache's SSD tier: cached blocks survive restarts (default: off)")
    p.add_argument("--ssd-cache-max-size", type=size, default="50GB", metavar="SIZE",
                   help="size cap of the SSD tier; the least recently used blocks go first")
    p.add_argument("--vision-cache-memory", type=size, default="512MB", metavar="SIZE",
                   help="vision-language models: encoder outputs kept by image hash (bytes or %% of RAM)")
    p = parser.add_argument_group("speculative decoding (docs/speculative.md)")
    p.add_argument("--speculative", choices=["off", "auto", *proposer_names()], default=d.speculative,
                   help="speculative decoding in the decode batch: ngram (prompt lookup, no extra model), draft"
                        " (--draft-model), eagle3 or mtp (a head fed the target's hidden states,"
                        " --speculative-model), auto (the --speculative-model's kind, else ngram; a step speculates"
                        " only where measured acceptance covers the measured cost of verifying); greedy output is"
                        " unchanged, sampled output keeps its distribution")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="small model with the target's tokenizer that drafts tokens (turns --speculative draft on),"
                        " or the EAGLE-3 / MTP head's folder for --speculative eagle3|mtp")
    p.add_argument("--speculative-method", dest="speculative", choices=["off", "auto", *proposer_names()],
                   default=argparse.SUPPRESS, help="another name for --speculative (default: as --speculative)")
    p.add_argument("--speculative-model", dest="draft_model", default=argparse.SUPPRESS, metavar="PATH",
                   help="another name for --draft-model, for an EAGLE-3 / MTP head's folder (default: as --draft-model)")
    p.add_argument("--num-draft-tokens", type=int, default=d.num_draft_tokens, metavar="K",
                   help="most tokens a row drafts per step (each row adapts below it from its acceptance)")
    p.add_argument("--spec-max-batch", type=int, default=d.spec_max_batch, metavar="N",
                   help="speculate only while at most N requests decode; larger batches decode plainly, where "
                        "verifying drafts costs more than it saves")


def _add_media_flags(p) -> None:
    d = MediaConfig()
    p.add_argument("--allowed-local-media-path", action="append", default=[], metavar="DIR",
                   help="allow image/video parts to name local files (paths, file://) under DIR; repeatable"
                        " (default: none)")
    p.add_argument("--allow-private-media-urls", action="store_true",
                   help="allow media URLs on private, loopback and link-local addresses (off: SSRF guard)")
    p.add_argument("--media-fetch-timeout", type=float, default=d.fetch_timeout_s, metavar="SECONDS",
                   help="how long an image or video URL's download may wait to connect, and for each read (the"
                        " whole download gets %g s)" % d.fetch_deadline_s)
    p.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels, metavar="N",
                   help="refuse (400) an image or video frame above this many pixels, read from its header before"
                        " decoding")
    p.add_argument("--max-media-per-request", type=int, default=d.max_media_per_request, metavar="N",
                   help="images + videos one request may carry (checked before fetching any)")
    p.add_argument("--video-max-frames-cap", type=int, default=d.video_max_frames_cap, metavar="N",
                   help="most frames a video part may ask for with max_frames (which defaults to %d)"
                        % d.video_max_frames)


def _media_config(args) -> MediaConfig:
    return MediaConfig(allowed_local_media_paths=tuple(args.allowed_local_media_path),
                       allow_private_media_urls=args.allow_private_media_urls,
                       fetch_timeout_s=args.media_fetch_timeout, max_image_pixels=args.max_image_pixels,
                       video_max_frames_cap=args.video_max_frames_cap,
                       max_media_per_request=args.max_media_per_request)


def _add_mcp_flags(p) -> None:
    from mlxhost.mcp.config import McpConfig  # lazy: keeps the command line's start-up short

    d = McpConfig()
    p.add_argument("--mcp-config", default=None, metavar="JSON",
                   help="MCP servers whose tools requests may use, in the `mcpServers` format of desktop agents"
                        " (stdio command/args/env, streamable-HTTP url/headers); started with the server")
    p.add_argument("--mcp-allow-remote", action="store_true",
                   help="let requests name MCP server URLs of their own (Responses server_url); private and local"
                        " addresses stay refused (off: configured servers only)")
    p.add_argument("--mcp-call-timeout", type=float, default=d.call_timeout_s, metavar="SECONDS",
                   help="one MCP tool call; a call past it is cut and reported to the model as a tool error")
    p.add_argument("--mcp-max-rounds", type=int, default=d.max_num_rounds, metavar="N",
                   help="model rounds per request when MCP tools are called in between (the last must answer)")


def _mcp_config(args):
    from mlxhost.mcp.config import McpConfig, read_mcp_servers  # lazy: keeps the command line's start-up short

    if args.mcp_config is None and not args.mcp_allow_remote:
        return None
    servers = read_mcp_servers(args.mcp_config) if args.mcp_config else ()
    return McpConfig(servers=servers, allow_remote=args.mcp_allow_remote, call_timeout_s=args.mcp_call_timeout,
                     max_num_rounds=args.mcp_max_rounds)


def _add_security_flags(p) -> None:
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require this key as `Authorization: Bearer KEY` or `x-api-key: KEY` (repeatable; default:"
                        " MLXHOST_API_KEY, comma-separated); /health stays open")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="API keys with policies, YAML or JSON (models, mcp_servers, priority, requests_per_minute,"
                        " tokens_per_minute, max_concurrent, cache_group per key; docs/security.md); read again when"
                        " it changes or on SIGHUP; --api-key keys stay, unlimited")
    p.add_argument("--cache-isolation", choices=("none", "key", "group"), default="none",
                   help="prefix-cache hits only between requests of one API key (key) or one key file"
                        " cache_group (group), so timing reveals nothing across them; none: shared by all")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key")
    p.add_argument("--allowed-origins", default="", metavar="ORIGIN,...",
                   help="CORS: browser origins allowed to call the API (e.g. http://localhost:3000, or *)"
                        " (default: off)")
    p.add_argument("--max-request-body-bytes", type=size, default="64MiB", metavar="SIZE",
                   help="largest request body (64MiB, 10MB, bytes); a larger one is a 413")
    p.add_argument("--max-tokens-cap", type=int, default=None, metavar="N",
                   help="most completion tokens one request may ask for (more is a 400); default: no cap")
    p.add_argument("--allowed-hosts", default=None, metavar="HOST,...",
                   help="Host header names served, others are a 421 (DNS-rebinding guard; * any, *.example.com"
                        " its subdomains); default: loopback names and the bound address when bound to loopback,"
                        " any name otherwise")


def _add_team_flags(p) -> None:
    p.add_argument("--batch-dir", default="auto", metavar="DIR",
                   help="folder of the OpenAI Batch API's files and batches (/v1/files, /v1/batches): a restart "
                        "resumes the batches in it; auto: the user data folder's mlxhost/batches; off: no Batch API")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry spans of every request to this OTLP collector: http(s)://HOST:4318"
                        "/v1/traces over HTTP, grpc://HOST:4317 over gRPC (needs the `otel` extra; default: off)")


def _batch_dir(args) -> str | None:
    if args.batch_dir == "off":
        return None
    if args.batch_dir == "auto":
        from mlxhost.batch.store import default_batch_dir  # lazy: keeps the command line's start-up short

        return str(default_batch_dir())
    return args.batch_dir


def _reload_keys_on_sighup(app) -> None:
    ring = getattr(app.state, "key_ring", None)  # only with API keys (common/security.py)
    if ring is not None and hasattr(signal, "SIGHUP"):
        # The handler only marks the file stale: the next request reads it (on the event loop, which owns it).
        signal.signal(signal.SIGHUP, lambda *_: ring.reload_soon())


def _security_config(args) -> SecurityConfig:
    from mlxhost.memory.device import total_ram  # lazy: keeps the command line's start-up short

    # Flags win over the environment, so a one-off key on the command line replaces a shell-wide one.
    keys = args.api_key or os.environ.get("MLXHOST_API_KEY", "").split(",")
    return SecurityConfig(api_keys=tuple(dict.fromkeys(k.strip() for k in keys if k.strip())),
                          api_key_file=args.api_keys, cache_isolation=args.cache_isolation,
                          metrics_public=args.metrics_public,
                          allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
                          max_request_body_bytes=parse_memory(args.max_request_body_bytes, total_ram()),
                          max_tokens_cap=args.max_tokens_cap,
                          allowed_hosts=(tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
                                         if args.allowed_hosts is not None else None))


def check_registered_names(config: ServerConfig) -> None:
    """The config's names that a registry holds (config.py imports none): an unknown one fails before anything loads,
    here rather than when a model of a models file is first loaded."""
    names = proposer_names()
    for engine in (config.engine, *(spec.engine for spec in config.models if spec.engine is not None)):
        if engine.speculative not in ("off", "auto", *names):
            raise ValueError(f"speculative must be off, auto or one of {', '.join(names)}, got {engine.speculative!r}")
    if config.tool_call_parser is not None:
        get_tool_parser(config.tool_call_parser)  # an unknown name fails here, listing the names


def _measurements_dir() -> str | None:
    """Start-up measurements kept between starts, beside the other caches; MLXHOST_MEASUREMENTS=0: none."""
    if os.environ.get("MLXHOST_MEASUREMENTS", "") == "0":
        return None

    return str(Path(platformdirs.user_cache_dir("mlxhost")) / "measurements")


def _engine_config(args) -> EngineConfig:
    from mlxhost.memory.device import total_ram  # lazy: keeps the command line's start-up short

    return EngineConfig(enable_prefix_cache=not args.no_prefix_cache, block_size=args.block_size,
                        kv_budget_tokens=args.kv_budget_tokens,
                        cache_memory_bytes=(parse_memory(args.cache_memory, total_ram())
                                            if args.cache_memory is not None else None),
                        memory_mode=args.memory_mode, memory_utilization=args.memory_utilization,
                        kv_prealloc_tokens=args.kv_prealloc,
                        kv_bits=args.kv_bits, kv_group_size=args.kv_group_size, kv_quant_mode=args.kv_quant_mode,
                        ssd_cache_dir=args.ssd_cache_dir,
                        measurements_dir=_measurements_dir(),
                        ssd_cache_max_bytes=parse_memory(args.ssd_cache_max_size, total_ram()),
                        max_num_seqs=args.max_num_seqs,
                        prefill_step_size=(args.prefill_step_size if args.prefill_step_size is not None
                                           else default_prefill_step_size()),
                        max_num_prefill_rows=args.max_num_prefill_rows,
                        prefill_wait_steps=args.prefill_wait_steps, priority_aging_steps=args.priority_aging_steps,
                        max_decode_gap_s=args.max_decode_gap,
                        max_model_len=args.max_model_len, default_max_tokens=args.default_max_tokens,
                        warmup=args.warmup, decode_buckets=args.decode_buckets,
                        speculative=args.speculative, draft_model=args.draft_model,
                        num_draft_tokens=args.num_draft_tokens, spec_max_batch=args.spec_max_batch,
                        cudnn_attention=args.cudnn_attention,
                        vision_cache_bytes=parse_memory(args.vision_cache_memory, total_ram()))


def _models_fields(args) -> dict:
    """ServerConfig's multi-model fields from --model / --models-config (flags win over the file)."""
    from mlxhost.memory.device import total_ram  # lazy: keeps the command line's start-up short

    # lazy: keeps the command line's start-up short
    from mlxhost.models.specs import load_models_file, parse_lora_flag, parse_model_flag

    specs, max_models, max_bytes = [], None, None
    if args.models_config:
        spec_file = load_models_file(args.models_config, _engine_config(args))
        specs, max_models, max_bytes = list(spec_file.models), spec_file.max_loaded_models, spec_file.max_loaded_bytes
    specs += [parse_model_flag(text) for text in args.extra_models]
    for model_dir in args.model_dir:  # each model folder inside, loaded on first use
        from mlxhost.models.catalog import model_dir_specs

        specs += model_dir_specs(model_dir)
    if specs and args.served_model_name:
        raise ValueError("--served-model-name names a single model; name several with --model NAME=PATH")
    loras = tuple(parse_lora_flag(text) for text in args.lora)
    if args.max_loaded_models is not None:
        max_models = args.max_loaded_models
    if args.max_loaded_memory is not None:
        max_bytes = parse_memory(args.max_loaded_memory, total_ram())
    return {"models": tuple(specs), "max_loaded_models": max_models, "max_loaded_bytes": max_bytes, "loras": loras}


def _text_models_only(args) -> bool:
    """Whether every model this serve loads is a text model mlx-lm loads (the demo model, or one local folder
    and its draft model): then the process needs no PyTorch."""
    from mlxhost.models.torch_free import is_text_model  # lazy: keeps the command line's start-up short

    if args.extra_models or args.model_dir or args.models_config:
        return False
    return is_text_model(args.model) and (args.draft_model is None or is_text_model(args.draft_model))


def _serve(args) -> int:
    from mlxhost.models.loader import ModelLoadError  # lazy: keeps the command line's start-up short
    from mlxhost.models.source import check_serve_sources  # lazy: keeps the command line's start-up short
    from mlxhost.server import process  # lazy: keeps the command line's start-up short

    try:  # a bad setting, a mistyped path or an unreachable hub id is reported before anything heavy loads
        process.switch_interval_s()
        check_serve_sources(args.model, args.extra_models, args.draft_model)
    except (ModelLoadError, ValueError) as e:
        print(f"mlxhost serve: {e}", file=sys.stderr)
        return 2
    from mlxhost.server.app import build_app  # lazy: keeps the command line's start-up short

    sock = None
    try:
        config = ServerConfig(model=args.model, served_model_name=args.served_model_name, host=args.host,
                              port=args.port, log_level=args.log_level, engine=_engine_config(args),
                              load_strategy=args.load_strategy, cpu_weights=args.cpu_weights, media=_media_config(args),
                              tool_call_parser=args.tool_call_parser, fim=args.fim,
                              shutdown_timeout_s=args.shutdown_timeout,
                              web_ui=not args.no_web_ui, batch_dir=_batch_dir(args),
                              otlp_traces_endpoint=args.otlp_traces_endpoint,
                              security=_security_config(args), mcp=_mcp_config(args), **_models_fields(args))
        check_registered_names(config)
        from mlxhost.distributed.config import distributed_config  # lazy: keeps the command line's start-up short

        dist = distributed_config(args)
        if dist.is_distributed:  # every rank runs from here (distributed/serve.py)
            from mlxhost.distributed.serve import serve_distributed

            return serve_distributed(config, dist)
        if _text_models_only(args):  # before anything imports mlx-lm (models/torch_free.py)
            from mlxhost.models.torch_free import keep_torch_out

            keep_torch_out()
        switch_interval = process.switch_interval_s()  # a bad value is reported now, like a port in use
        # The port first: one in use is reported now, not after the model has loaded.
        sock = process.bind(config.host, config.port)
        # build_app loads every pinned model (a single one always) with config.load_strategy.
        app = build_app(config)
        _reload_keys_on_sighup(app)
        from mlxhost.server.banner import make_ready_hook  # lazy: keeps the command line's start-up short

        app.state.on_ready = make_ready_hook(config, app.state.models, app.state.model_specs,
                                             sock.getsockname()[1] if sock is not None else config.port,
                                             speed_hint=getattr(args, "speed_hint", None))
    except (ModelLoadError, ValueError, OSError) as e:
        if sock is not None:
            sock.close()
        print(f"mlxhost serve: {e}", file=sys.stderr)
        return 2
    process.run(app, sock, config.log_level, config.shutdown_timeout_s, switch_interval)
    return 0

"""Wires the served models (each with its own engine) and the HTTP app together."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path

from fastapi import FastAPI

from mlxhost.config import EngineConfig, ModelSpec, ServerConfig
from mlxhost.engine.loop import AsyncEngine
from mlxhost.frontends.admin.web import add_web_routes
from mlxhost.frontends.app import create_app
from mlxhost.frontends.batch.routes import install_batch_api
from mlxhost.frontends.common.security import install_security
from mlxhost.lora.registry import with_flag_loras
from mlxhost.mcp.client import McpManager
from mlxhost.memory.budget import BudgetConfig, compute_ceiling
from mlxhost.memory.device import read_memory
from mlxhost.memory.release import give_back_memory
from mlxhost.models.loader import LoadedModel, load_model
from mlxhost.models.specs import default_name, weights_on_disk, with_source_aliases
from mlxhost.platform import kernel_primer
from mlxhost.platform.backend import is_cuda
from mlxhost.platform.kernel_cache import count_modules, use_persistent_kernel_cache
from mlxhost.server.manager import ModelManager
from mlxhost.server.progress import StageLog
from mlxhost.serving.fim import fim_for
from mlxhost.serving.model import ServedModel
from mlxhost.serving.prompt_bound import max_token_chars, read_vocab
from mlxhost.structured.reasoning import reasoning_tags_for
from mlxhost.structured.tool_formats import choose_tool_parser
from mlxhost.testing.demo import ensure_demo_model

log = logging.getLogger(__name__)


def resolve_max_model_len(loaded: LoadedModel, config: EngineConfig) -> int:
    limit = loaded.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        log.warning("--max-model-len %d is above the model's %d positions", config.max_model_len, limit)
    return config.max_model_len


def model_key(loaded: LoadedModel) -> str:
    """Identity of the weights for the prefix cache: config, source and weight files' sizes and mtimes,
    so blocks from another model (or an edited one) never match."""
    h = hashlib.sha256(json.dumps(loaded.config, sort_keys=True, default=str).encode())
    h.update(loaded.source.encode())
    path = Path(loaded.source)
    if path.is_dir():
        for f in sorted(path.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def make_engine(loaded: LoadedModel, config: EngineConfig, max_model_len: int, loras=()) -> AsyncEngine:
    """The model's engine, not yet started; its core is assembled on the engine thread as it starts
    (engine/assemble.py: `loras` (LoraSpec) loaded, the warm-up run or handed to the loop)."""
    from mlxhost.engine.assemble import assemble_core  # loads MLX and the engine: not for encoder-only servers

    def assemble():
        return assemble_core(loaded.model, loaded.tokenizer, config, max_model_len, model_key=model_key(loaded),
                             source=loaded.source, loras=loras, make_core=loaded.make_engine_core)

    return AsyncEngine(assemble, max_num_waiting=config.max_num_waiting)


def build_app(config: ServerConfig, loaded: LoadedModel | None = None) -> FastAPI:
    """The app for `config`'s models; pinned ones (a single model always) load here, the others on
    first use. `loaded`: a single model the caller loaded already."""
    kernels = use_persistent_kernel_cache()  # before any model computes: MLX reads it at its first compile
    if kernels is not None:
        log.info("MLX kernel cache: %s (%d compiled modules)", kernels, count_modules(kernels))
    specs = model_specs(config, loaded)
    primers = []
    if kernels is not None and is_cuda():
        # Started before the load so the compiles hide behind it (kernel_primer.py); only a speed-up: a failure
        # to start them costs the first requests their compile time, not the server its start.
        try:
            primers = kernel_primer.start(specs[0].source, kernels)
        except Exception as exc:
            log.warning("MLX kernel cache: kernels not compiled ahead (%s)", exc)
    preloaded = {specs[0].name: loaded} if loaded is not None else {}
    manager = ModelManager(
        specs,
        lambda spec: load_served(spec, config, preloaded.pop(spec.name, None)),
        max_loaded_models=config.max_loaded_models,
        max_loaded_bytes=config.max_loaded_bytes,
        free_bytes=lambda: free_for_weights(config.engine),
        release=release_memory,
    )
    try:
        manager.load_pinned()
    except BaseException:
        if primers:
            kernel_primer.stop(primers)
        raise
    if primers:
        kernel_primer.wait_first(primers, specs[0].source, kernels)  # the engine's first forwards need them
    mcp = None
    if config.mcp is not None:
        mcp = McpManager(config.mcp)
    app = create_app(manager, mcp)
    app.state.models, app.state.model_specs = manager, specs  # for the start-up banner (cli.py)
    add_web_routes(app, enabled=config.web_ui)
    if config.batch_dir is not None:
        install_batch_api(app, config.batch_dir)
    if config.otlp_traces_endpoint is not None:  # imports the optional OpenTelemetry SDK only when asked for
        from mlxhost.tracing import install_tracing

        install_tracing(app, config.otlp_traces_endpoint)
    install_security(app, config.security, config.host, web_page=config.web_ui)
    return app


def model_specs(config: ServerConfig, loaded: LoadedModel | None = None) -> tuple[ModelSpec, ...]:
    """The configured models; a single-model server is one pinned spec (loaded at start-up) that
    answers to its served name, its path and its folder's name."""
    if config.models:
        return with_flag_loras(with_source_aliases(config.models), config.loras)
    source = loaded.source if loaded is not None else config.model
    if source is None:
        source = str(ensure_demo_model(progress=StageLog("building the demo model (first run only)")))
        log.info("no model named: serving the demo model at %s", source)
    name = config.served_model_name or default_name(source)
    aliases = tuple(sorted({source, default_name(source)} - {name}))

    return with_flag_loras((ModelSpec(name=name, source=source, pinned=True, aliases=aliases),), config.loras)


def load_served(spec: ModelSpec, config: ServerConfig, loaded: LoadedModel | None = None):
    """Loads one model: `(ServedModel, AsyncEngine)`, the engine not yet started."""
    own = loaded is None  # a model handed in (a distributed rank's shard) keeps the layout it was built with
    if own:
        loaded = load_model(spec.source, config.load_strategy, config.engine.measurements_dir)
    if loaded.is_encoder:
        return load_encoder_served(spec, config, loaded)
    if getattr(loaded.model, "is_audio", False):
        from mlxhost.audio.engine import audio_served  # lazy: pulls in mlx_lm

        return audio_served(spec, config, loaded)
    if own and not loaded.is_vlm:  # text models: on MLX's CPU backend float32 weights are the fast layout
        from mlxhost.platform.cpu_weights import serve_layout

        serve_layout(loaded.model, config.cpu_weights)
    engine_config = shared_engine_config(spec.engine or config.engine, config, spec.name)
    max_model_len = resolve_max_model_len(loaded, engine_config)
    vocab = read_vocab(loaded.tokenizer)  # once: the length bound and the fill-in-the-middle markers read it
    served = ServedModel(
        name=spec.name,
        aliases=frozenset(spec.aliases),
        tokenizer=loaded.tokenizer,
        max_model_len=max_model_len,
        vocab_size=_vocab_size(loaded),
        eos_token_ids=loaded.eos_token_ids,
        default_max_tokens=engine_config.default_max_tokens,
        created=int(time.time()),
        multimodal=_prompt_builder(loaded, config, engine_config),
        **output_conventions(loaded, config.tool_call_parser),
        max_tokens_cap=config.security.max_tokens_cap,
        max_token_chars=max_token_chars(loaded.tokenizer, vocab),
        fim=fim_for(loaded.tokenizer, _model_names(spec, loaded), config.fim, vocab),
    )
    log.info("serving %s as %r (context %d tokens, up to %d sequences)", loaded.source, spec.name, max_model_len,
             engine_config.max_num_seqs)
    return served, make_engine(loaded, engine_config, max_model_len, spec.loras)


def load_encoder_served(spec: ModelSpec, config: ServerConfig, loaded: LoadedModel):
    """An encoder embedding model (models/encoder.py): /v1/embeddings only, on an engine thread whose
    core only answers calls (no KV cache, so no memory budget of its own)."""
    from mlxhost.engine.encoder import make_encoder_engine  # lazy: pulls in mlx_lm

    engine_config = spec.engine or config.engine
    max_model_len = min(resolve_max_model_len(loaded, engine_config), loaded.model.max_len)
    served = ServedModel(name=spec.name, aliases=frozenset(spec.aliases), tokenizer=loaded.tokenizer,
                         max_model_len=max_model_len, vocab_size=_vocab_size(loaded), eos_token_ids=frozenset(),
                         default_max_tokens=0, created=int(time.time()), embedding_only=True)
    log.info("serving encoder %s as %r (embeddings only, %s pooling, %d tokens)", loaded.source, spec.name,
             loaded.model.pooling, max_model_len)
    return served, make_encoder_engine(loaded.model, engine_config)


def shared_engine_config(engine: EngineConfig, config: ServerConfig, name: str, weights_of=None) -> EngineConfig:
    """A model among N that may be loaded at once: its budget leaves out the weights of the N - 1
    largest other models and takes 1/N of the rest; alone, `engine` as is. Then every set of N loaded
    models fits one process ceiling (without this each budgeted the whole machine: KV overlapped)."""
    if len(config.models) <= 1:
        return engine
    weights_of = weights_of or weights_on_disk
    slots = min(config.max_loaded_models or len(config.models), len(config.models))
    others = sorted((weights_of(s.source) for s in config.models if s.name != name), reverse=True)
    return dataclasses.replace(engine, memory_reserved_bytes=sum(others[: slots - 1]), memory_share=1.0 / slots)


def free_for_weights(config: EngineConfig) -> int:
    """Bytes this process may still take under the memory budget's ceiling (memory/budget.py)."""
    readings = read_memory()
    rules = BudgetConfig(mode=config.memory_mode, memory_utilization=config.memory_utilization)
    return compute_ceiling(readings, rules) - readings.held_by_process


def release_memory() -> None:
    """After an unload dropped every reference: collect cycles and hand MLX's freed buffers back (its
    allocator keeps them cached otherwise, so the memory would not come back to the system)."""
    give_back_memory()


def _prompt_builder(loaded: LoadedModel, config: ServerConfig, engine: EngineConfig):
    """Vision-language models: what turns image/video parts into prompt tokens; None for text models."""
    if not loaded.is_vlm:
        return None
    from mlxhost.multimodal.prompt import MultimodalPromptBuilder  # lazy: pulls in numpy

    # Without a vision cache a resent image must carry its pixels: the engine has nothing to reuse.
    return MultimodalPromptBuilder(loaded.model, loaded.tokenizer, config.media,
                                   reuse_known=engine.vision_cache_bytes > 0)


def output_conventions(loaded: LoadedModel, tool_call_parser: str | None) -> dict:
    """How this model's replies carry tool calls and reasoning, read off its chat template and vocabulary."""
    tok = loaded.tokenizer
    template = getattr(tok, "chat_template", None)
    template = template if isinstance(template, str) else None
    cfg = loaded.config.get("text_config", loaded.config)
    tags = reasoning_tags_for(tok)
    thinks = tags is not None
    if tags is None and template and "<think>" in template:
        tags = ("<think>", "</think>")  # the template writes them as text: a reply may too
    parser = choose_tool_parser(template, cfg.get("model_type"), tool_call_parser)
    log.info("tool calls: %s; reasoning: %s", parser or "none", "%s...%s" % tags if tags else "none")
    return {"tool_parser": parser, "reasoning_tags": tags, "thinks_by_default": thinks}


def _model_names(spec: ModelSpec, loaded: LoadedModel) -> list[str]:
    """What a model is called: its folder's or hub repo's own name (not the folders above it), served names, and
    its config's name and type."""
    cfg = loaded.config.get("text_config", loaded.config)
    names = (spec.source, str(loaded.source), str(loaded.config.get("_name_or_path", "")), spec.name, *spec.aliases)
    return [*(Path(n).name for n in names), str(cfg.get("model_type", "")),
            *map(str, loaded.config.get("architectures") or ())]


def _vocab_size(loaded: LoadedModel) -> int:
    cfg = loaded.config.get("text_config", loaded.config)
    return int(cfg.get("vocab_size") or len(loaded.tokenizer))

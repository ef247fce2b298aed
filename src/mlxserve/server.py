"""Wires a loaded model, the engine and the HTTP app together."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from fastapi import FastAPI

from mlxserve.api.app import create_app
from mlxserve.api.serving import ServedModel
from mlxserve.config import EngineConfig, ServerConfig
from mlxserve.engine.async_engine import AsyncEngine
from mlxserve.models.loader import LoadedModel, load_model

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
    import hashlib
    import json

    h = hashlib.sha256(json.dumps(loaded.config, sort_keys=True, default=str).encode())
    h.update(loaded.source.encode())
    path = Path(loaded.source)
    if path.is_dir():
        for f in sorted(path.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def make_engine(loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> AsyncEngine:
    from mlxserve.engine.batch import make_buckets
    from mlxserve.engine.engine_core import EngineCore

    def make_core():
        buckets = make_buckets(config.max_num_seqs) if config.decode_buckets == "on" else None
        core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len, buckets, model_key(loaded))
        if _compiles_per_shape() if config.warmup == "auto" else config.warmup == "on":
            core.warmup(config.max_num_seqs)
        return core

    return AsyncEngine(make_core, max_num_waiting=config.max_num_waiting)


def _compiles_per_shape() -> bool:
    import mlx.core as mx

    # Only MLX's CUDA backend compiles per shape at first use; Metal and CPU gain nothing.
    return hasattr(mx, "cuda") and mx.cuda.is_available() and mx.default_device() == mx.gpu


def build_app(config: ServerConfig, loaded: LoadedModel | None = None) -> FastAPI:
    if loaded is None:
        source = config.model
        if source is None:
            from mlxserve.models.demo import ensure_demo_model

            source = str(ensure_demo_model())
            log.info("no model named: serving the demo model at %s", source)
        loaded = load_model(source)
    max_model_len = resolve_max_model_len(loaded, config.engine)
    name = config.served_model_name or loaded.default_name
    served = ServedModel(
        name=name,
        aliases=frozenset({loaded.source, loaded.default_name}),
        tokenizer=loaded.tokenizer,
        max_model_len=max_model_len,
        vocab_size=_vocab_size(loaded),
        eos_token_ids=loaded.eos_token_ids,
        default_max_tokens=config.engine.default_max_tokens,
        created=int(time.time()),
        multimodal=_prompt_builder(loaded, config),
    )
    log.info("serving %s as %r (context %d tokens, up to %d sequences)", loaded.source, name, max_model_len,
             config.engine.max_num_seqs)
    return create_app(served, make_engine(loaded, config.engine, max_model_len))


def _prompt_builder(loaded: LoadedModel, config: ServerConfig):
    """Vision-language models: what turns image/video parts into prompt tokens; None for text models."""
    if not loaded.is_vlm:
        return None
    from mlxserve.multimodal.prompt import MultimodalPromptBuilder

    return MultimodalPromptBuilder(loaded.model, loaded.tokenizer, config.media)


def _vocab_size(loaded: LoadedModel) -> int:
    cfg = loaded.config.get("text_config", loaded.config)
    return int(cfg.get("vocab_size") or len(loaded.tokenizer))

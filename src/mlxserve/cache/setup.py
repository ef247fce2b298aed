"""Builds the two halves of the prefix cache for a model (this module may touch MLX)."""

from __future__ import annotations

import logging
from typing import Any

from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxserve.cache.kv_store import KVBlockStore
from mlxserve.cache.prefix_cache import PrefixCacheManager
from mlxserve.config import EngineConfig

log = logging.getLogger(__name__)


def kv_bytes_per_token(model: Any) -> int:
    """Bytes one token's keys and values take over all layers, read off a one-token forward."""
    import mlx.core as mx

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    return sum((c.keys.nbytes + c.values.nbytes) // c.keys.shape[2] for c in cache)


def make_prefix_cache(model: Any, config: EngineConfig, model_key: str):
    """(manager, store), or (None, None) when disabled or when the model's caches cannot be shared."""
    if not config.enable_prefix_cache or config.cache_memory_bytes == 0:
        return None, None
    kinds = {type(c) for c in make_prompt_cache(model)}
    if kinds != {KVCache}:
        # Sliding-window (rotating) and recurrent caches are not plain prefixes of a sequence.
        log.info("prefix cache off: this model's caches are %s, not plain KVCache", sorted(k.__name__ for k in kinds))
        return None, None
    block_bytes = kv_bytes_per_token(model) * config.block_size
    num_blocks = config.cache_memory_bytes // block_bytes
    if num_blocks < 1:
        log.info("prefix cache off: %d bytes hold no block of %d bytes", config.cache_memory_bytes, block_bytes)
        return None, None
    store = KVBlockStore()
    manager = PrefixCacheManager(num_blocks, config.block_size, model_key, on_evict=lambda h, b: store.drop(b))
    log.info("prefix cache: %d blocks of %d tokens (%.1f MB each, %.2f GB in all)", num_blocks,
             config.block_size, block_bytes / 1e6, num_blocks * block_bytes / 1e9)
    return manager, store

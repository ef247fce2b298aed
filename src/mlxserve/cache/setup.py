"""Builds the two halves of the prefix cache for a model (this module may touch MLX)."""

from __future__ import annotations

import logging
from typing import Any

from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxserve.cache.kv_store import KVBlockStore
from mlxserve.cache.prefix_cache import PrefixCacheManager
from mlxserve.cache.ssd_tier import BlockMeta, SSDTier
from mlxserve.config import EngineConfig

log = logging.getLogger(__name__)


def probe_kv(model: Any) -> tuple[int, Any, int]:
    """(bytes one token's keys and values take over all layers, their dtype, number of layers),
    read off a one-token forward: the dtype is what the model really writes, whatever its weights."""
    import mlx.core as mx

    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    per_token = sum((c.keys.nbytes + c.values.nbytes) // c.keys.shape[2] for c in cache)
    return per_token, cache[0].keys.dtype, len(cache)


# Prefix-cache size when --cache-memory is not given and no memory budget could be computed (the
# weights alone exceed it): memory is tight, so modest.
FALLBACK_CACHE_MEMORY_BYTES = 512 << 20


def can_share_prefix(model: Any) -> bool:
    """Whether the model's caches are plain KV that a prefix cache can reuse. Sliding-window (rotating)
    and recurrent caches are not plain prefixes of a sequence."""
    return {type(c) for c in make_prompt_cache(model)} == {KVCache}


def make_prefix_cache(
    model: Any, config: EngineConfig, model_key: str, probe: tuple[int, Any, int], memory_bytes: int | None = None
):
    """(manager, store), or (None, None) when disabled or when the model's caches cannot be shared.
    `probe` is `probe_kv(model)`, measured once by the caller. The size is `memory_bytes` (the memory
    budget's prefix share), else `config.cache_memory_bytes`, else FALLBACK_CACHE_MEMORY_BYTES."""
    if memory_bytes is None:
        memory_bytes = config.cache_memory_bytes
    if memory_bytes is None:
        memory_bytes = FALLBACK_CACHE_MEMORY_BYTES
    if not config.enable_prefix_cache or memory_bytes == 0:
        return None, None
    if not can_share_prefix(model):
        kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)})
        log.info("prefix cache off: this model's caches are %s, not plain KVCache", kinds)
        return None, None
    per_token, dtype, num_layers = probe
    block_bytes = per_token * config.block_size
    num_blocks = memory_bytes // block_bytes
    if num_blocks < 1:
        log.info("prefix cache off: %d bytes hold no block of %d bytes", memory_bytes, block_bytes)
        return None, None
    ssd = None
    if config.ssd_cache_dir:
        meta = BlockMeta(model_key, config.block_size, num_layers, str(dtype).rsplit(".", 1)[-1])
        ssd = SSDTier(config.ssd_cache_dir, config.ssd_cache_max_bytes, meta, logger=log)
        log.info("SSD tier at %s: %d blocks found", config.ssd_cache_dir, ssd.stats()["num_blocks"])
    store = KVBlockStore(ssd, dtype)
    manager = PrefixCacheManager(num_blocks, config.block_size, model_key, on_evict=lambda h, b: store.drop(b),
                                 lookup_cold=store.load_from_ssd if ssd else None,
                                 has_cold=ssd.contains if ssd else None)
    log.info("prefix cache: %d blocks of %d tokens (%.1f MB each, %.2f GB in all)", num_blocks,
             config.block_size, block_bytes / 1e6, num_blocks * block_bytes / 1e9)
    return manager, store

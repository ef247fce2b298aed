"""Builds the two halves of the prefix cache for a model (this module may touch MLX)."""

from __future__ import annotations

import logging
import os
from typing import Any

from mlxhost.config import EngineConfig
from mlxhost.kv.kinds.kv_quant import KVQuantPlan
from mlxhost.kv.kinds.probe import KVProbe
from mlxhost.kv.prefix_cache import PrefixCacheManager
from mlxhost.kv.store.kv_store import KVBlockStore
from mlxhost.kv.store.ssd_format import BlockMeta
from mlxhost.kv.store.ssd_tier import SSDTier

log = logging.getLogger(__name__)


# Prefix-cache size when --cache-memory is not given and no memory budget could be computed (the
# weights alone exceed it): memory is tight, so modest.
FALLBACK_CACHE_MEMORY_BYTES = 512 << 20


def make_prefix_cache(
    model: Any, config: EngineConfig, model_key: str, probe: KVProbe, memory_bytes: int | None = None,
    kv_quant: KVQuantPlan | None = None,
    store_cls: type[KVBlockStore] = KVBlockStore,
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
    if not probe.shareable:
        log.info("prefix cache off: %s", probe.why_unshareable)
        return None, None
    layout, dtype, num_layers = probe.layout, probe.dtype, probe.num_layers
    snapshot_bytes = snapshot_budget(memory_bytes, probe) if layout.snapshot_roles else 0
    # A block of a model without attention layers holds no arrays, only its Python bookkeeping.
    block_bytes = max(probe.bytes_per_token * config.block_size, MIN_BLOCK_BYTES)
    num_blocks = (memory_bytes - snapshot_bytes) // block_bytes
    if num_blocks < 1:
        log.info("prefix cache off: %d bytes hold no block of %d bytes", memory_bytes, block_bytes)
        return None, None
    ssd, tiers = None, {}
    if config.ssd_cache_dir:
        meta = BlockMeta(model_key, config.block_size, num_layers, str(dtype).rsplit(".", 1)[-1],
                         kv_quant=(kv_quant.label if kv_quant is not None else "") or "none")
        ssd_bytes = config.ssd_cache_max_bytes
        # Roles with their own folder (snapshots, sliding windows) take their share of the cap, in the roles' order.
        for role in layout.roles:
            if role.ssd_folder and (role.per_block or snapshot_bytes):
                share = role.ssd_share(layout, ssd_bytes)
                tiers[role.name] = SSDTier(os.path.join(config.ssd_cache_dir, role.ssd_folder), max(1, share), meta,
                                           logger=log)
                ssd_bytes -= share
        ssd = SSDTier(config.ssd_cache_dir, ssd_bytes, meta, logger=log)
        log.info("SSD tier at %s: %d blocks found", config.ssd_cache_dir, ssd.stats()["num_blocks"])
    store = store_cls(layout, config.block_size, ssd, dtype, snapshot_bytes, tiers)
    needs_check = any(role.optional for role in layout.roles)
    # The manager reads the SSD tier's index (plain data) and calls nothing of the store: its decisions reach
    # the store as ops in the step plan (kv/cache_ops.py).
    manager = PrefixCacheManager(num_blocks, config.block_size, model_key, disk=ssd,
                                 resume=store.index if needs_check else None)
    log.info("prefix cache: %d blocks of %d tokens (%.1f MB each, %.2f GB in all)%s", num_blocks,
             config.block_size, block_bytes / 1e6, num_blocks * block_bytes / 1e9,
             f", state snapshots {snapshot_bytes / 1e6:.1f} MB" if snapshot_bytes else "")
    return manager, store


# The bookkeeping of one block in Python (Block, hash, tokens) is a few hundred bytes; counting at
# least this much keeps a model without attention layers from getting millions of blocks.
MIN_BLOCK_BYTES = 1024


def snapshot_budget(memory_bytes: int, probe: KVProbe) -> int:
    """The prefix memory set aside for recurrent-state snapshots: a quarter, or none if that does
    not hold one snapshot (a hit on such a model needs a snapshot, so a fixed share is simplest)."""
    share = memory_bytes // 4
    return share if share >= probe.bytes_per_seq else 0

"""Builds the two halves of the prefix cache for a model (this module may touch MLX)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache

from mlxserve.cache.kv_quant import KVQuantPlan
from mlxserve.cache.kv_store import KVBlockStore
from mlxserve.cache.layout import KVLayout, read_layout
from mlxserve.cache.prefix_cache import PrefixCacheManager
from mlxserve.cache.ssd_tier import BlockMeta, SSDTier
from mlxserve.server.config import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVProbe:
    """What one sequence's caches cost, read off a one-token forward through mlx-lm's own caches."""

    bytes_per_token: int  # keys and values of every layer whose cache grows with the sequence
    bytes_per_seq: int  # fixed-size state (linear attention, SSM, conv): paid once per running sequence
    dtype: Any  # what the model really writes, whatever its weights
    num_layers: int
    layer_kinds: tuple[str, ...]  # the cache class of each layer, for logs
    shareable: bool  # a layout the prefix cache can store (see cache/layout.py)
    logits_width: int = 0  # the model's output vocabulary (may exceed the tokenizer's)
    layout: KVLayout | None = None  # None: the prefix cache cannot store these caches
    why_unshareable: str = ""  # for the log, when not shareable

    @property
    def budget_bytes_per_token(self) -> int:
        # A pure recurrent model's memory does not grow per token; 1 byte keeps the token arithmetic
        # of admission and pressure defined (its sequences are bounded by max_num_seqs instead).
        return max(self.bytes_per_token, 1)


def _layer_cost(c: Any) -> tuple[int, int]:
    """(bytes per token, bytes per sequence) of one layer's cache after a one-token forward."""
    if isinstance(c, CacheList):
        costs = [_layer_cost(sub) for sub in c.caches]
        return sum(t for t, _ in costs), sum(s for _, s in costs)
    if isinstance(c, ArraysCache):
        return 0, c.nbytes
    keys, values = getattr(c, "keys", None), getattr(c, "values", None)
    if keys is None:
        # A cache kind we do not know: charge its whole size once per sequence rather than guess.
        return 0, c.nbytes
    # Quantized caches keep (packed, scales, biases) tuples; their buffers grow in steps, so divide
    # by the buffer's width, not by the one token written.
    parts = [*keys, *values] if isinstance(keys, (tuple, list)) else [keys, values]
    width = parts[0].shape[2]
    return sum(p.nbytes for p in parts) // width, 0


def probe_kv(model: Any, make_cache: Callable[[Any], list[Any]] = make_prompt_cache) -> KVProbe:
    """`make_cache` makes the caches requests really get (quantized layers under --kv-bits)."""
    import mlx.core as mx

    cache = make_cache(model)
    logits = model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    costs = [_layer_cost(c) for c in cache]
    layout = read_layout(cache)
    kinds = tuple(type(c).__name__ for c in cache)
    why = "" if layout is not None else f"this model's caches are {sorted(set(kinds))}, a layout it cannot store"
    if layout is not None and getattr(model, "is_vlm", False) and layout.state_layers:
        # No served vision family has recurrent layers, so snapshots have never run with images.
        layout, why = None, "a vision model with recurrent layers (snapshots never run with images)"
    # Quantized layers keep (data, scales, biases): the scales carry the model's float dtype.
    dtype = next((k.dtype if isinstance(k, mx.array) else k[1].dtype
                  for k in (getattr(c, "keys", None) for c in cache) if isinstance(k, (mx.array, tuple))), None)
    if dtype is None:  # recurrent-only models: the state's dtype
        dtype = next((a.dtype for c in cache for a in _arrays(c)), mx.float32)
    return KVProbe(
        bytes_per_token=sum(t for t, _ in costs),
        bytes_per_seq=sum(s for _, s in costs),
        dtype=dtype,
        num_layers=len(cache),
        layer_kinds=kinds,
        shareable=layout is not None,
        logits_width=logits.shape[-1],
        layout=layout,
        why_unshareable=why,
    )


def _arrays(c: Any) -> list:
    from mlx.utils import tree_flatten

    return [a for _, a in tree_flatten(c.state)]


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
    snapshot_bytes = snapshot_budget(memory_bytes, probe) if layout.state_layers else 0
    # A block of a model without attention layers holds no arrays, only its Python bookkeeping.
    block_bytes = max(probe.bytes_per_token * config.block_size, MIN_BLOCK_BYTES)
    num_blocks = (memory_bytes - snapshot_bytes) // block_bytes
    if num_blocks < 1:
        log.info("prefix cache off: %d bytes hold no block of %d bytes", memory_bytes, block_bytes)
        return None, None
    ssd = state_ssd = window_ssd = None
    if config.ssd_cache_dir:
        meta = BlockMeta(model_key, config.block_size, num_layers, str(dtype).rsplit(".", 1)[-1],
                         kv_quant=(kv_quant.label if kv_quant is not None else "") or "none")
        ssd_bytes = config.ssd_cache_max_bytes
        if snapshot_bytes:  # snapshots get their own folder and a quarter of the disk cap
            state_ssd = SSDTier(os.path.join(config.ssd_cache_dir, "states"), max(1, ssd_bytes // 4), meta,
                                logger=log)
            ssd_bytes -= ssd_bytes // 4
        if layout.swa_layers:
            # Sliding KV gets its own folder and half the rest: window files exist only for the few blocks
            # inside a window, block files for every block (gemma3-4b: ~150 MB of each kind at a 4k prefix,
            # 150 vs 640 MB at 32k). Without full-attention layers block files hold no KV: most goes to windows.
            window_bytes = ssd_bytes // 2 if layout.full_layers else ssd_bytes - min(ssd_bytes // 2, 64 << 20)
            window_bytes = max(1, min(window_bytes, ssd_bytes - 1))
            window_ssd = SSDTier(os.path.join(config.ssd_cache_dir, "windows"), window_bytes, meta, logger=log)
            ssd_bytes -= window_bytes
        ssd = SSDTier(config.ssd_cache_dir, ssd_bytes, meta, logger=log)
        log.info("SSD tier at %s: %d blocks found", config.ssd_cache_dir, ssd.stats()["num_blocks"])
    store = store_cls(layout, config.block_size, ssd, dtype, snapshot_bytes, state_ssd, window_ssd)
    needs_check = bool(layout.swa_layers or layout.state_layers)
    manager = PrefixCacheManager(num_blocks, config.block_size, model_key, on_evict=lambda h, b: store.drop(b),
                                 lookup_cold=store.load_from_ssd if ssd else None,
                                 has_cold=ssd.contains if ssd else None,
                                 resume=store if needs_check else None)
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

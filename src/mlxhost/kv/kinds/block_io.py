"""Filling a fresh per-request cache from prefix-cache blocks: each role's layers by their kind's I/O.

Reading blocks out of a decode-batch row or a prefill cache is each role's own (plain.read_row_kv,
sliding.read_row_window / read_prefill_window, recurrent.read_state); filling a request's cache to resume
from a hit needs all three at once, in the order of the model's layers.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxhost.kv.kinds.layout import KVLayout
from mlxhost.kv.kinds.plain import KVArrays, fill_kv
from mlxhost.kv.kinds.recurrent import Snapshot, fill_state
from mlxhost.kv.kinds.sliding import fill_window


def fill_cache(cache: list[Any], layout: KVLayout, kv: list[KVArrays], swa: list[mx.array],
               num_tokens: int, snapshot: Snapshot | None) -> None:
    """Fills a fresh per-request cache (make_prompt_cache) to resume after `num_tokens` prompt tokens:
    full layers from every block, sliding layers from the blocks covering their window (`swa`, in
    order, ending at `num_tokens`), recurrent layers from the snapshot taken at `num_tokens`."""
    fill_kv(cache, layout, kv, num_tokens)
    fill_window(cache, layout, swa, num_tokens)
    fill_state(cache, layout, snapshot)

"""Arrays to and from the SSD tier's raw-byte tensors (this module touches MLX).

Blocks and snapshots stored in one step are copied to the host in one go the step after (by then
they are computed, so the copy never waits on the device), or at once when the engine goes idle: on
MLX-CUDA a copy per block cost more than recomputing the prefix (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from mlxhost.kv.kinds.layout import KVLayout
from mlxhost.kv.store.ssd_format import BlockData
from mlxhost.kv.store.ssd_tier import SSDTier


def _from_bytes(raw: bytes, shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
    # bfloat16 has no numpy dtype: arrays travel as raw bytes, the shape and (in the header) the dtype.
    return mx.array(np.frombuffer(raw, dtype=np.uint8)).view(dtype).reshape(shape)


class SpillQueue:
    """Arrays waiting for their device-to-host copy, each item bound for one tier under one hash."""

    def __init__(self) -> None:
        self._items: list[tuple[SSDTier, bytes, tuple[int, ...], dict[str, mx.array]]] = []

    def add(self, tier: SSDTier, block_hash: bytes, token_ids: tuple[int, ...], tensors: dict[str, mx.array]) -> None:
        self._items.append((tier, block_hash, token_ids, tensors))

    def clear(self) -> None:
        self._items = []

    def flush(self) -> None:
        pending = [item for item in self._items if not item[0].contains(item[1])]
        self._items = []
        arrays = [a for *_, tensors in pending for a in tensors.values()]
        if not arrays:
            for tier, block_hash, token_ids, _ in pending:  # blocks of a model without attention layers
                tier.put(block_hash, BlockData(token_ids, {}))
            return
        raw = np.array(mx.concatenate([a.reshape(-1).view(mx.uint8) for a in arrays]))
        offset = 0
        for tier, block_hash, token_ids, tensors in pending:
            out = {}
            for name, a in tensors.items():
                out[name] = (raw[offset : offset + a.nbytes].tobytes(), tuple(a.shape))
                offset += a.nbytes
            tier.put(block_hash, BlockData(token_ids, out))


# A quantized block's kv tuple on disk (the header's kv_quant field says how it was quantized).
QUANT_TENSORS = ("kv.data", "kv.scales", "kv.biases")


def block_from_data(data: BlockData, layout: KVLayout, dtype: mx.Dtype, log: logging.Logger) -> tuple | None:
    """(kv, swa) of a block read from disk, or None (a miss) if it does not fit this layout."""
    try:
        kv = None
        if layout.full_layers and layout.kv_bits:
            kv = tuple(_from_bytes(*data.tensors[name], dt)
                       for name, dt in zip(QUANT_TENSORS, (mx.uint32, dtype, dtype)))
            for part, width in zip(kv, layout.key_widths()):
                _check_rows(part, len(layout.full_layers))
                if part.shape[-1] <= width or part.shape[:3] != kv[0].shape[:3]:
                    raise ValueError(f"quantized part of shape {part.shape} does not fit this layout")
        elif layout.full_layers:
            kv = _from_bytes(*data.tensors["kv"], dtype)
            _check_rows(kv, len(layout.full_layers))
        swa = _from_bytes(*data.tensors["swa"], dtype) if "swa" in data.tensors else None
        _check_rows(swa, len(layout.swa_layers))
    except (KeyError, ValueError, TypeError) as exc:  # a file that passed the checks but not ours
        log.warning("SSD block unusable (%s): a miss", exc)
        return None
    return kv, swa


def window_from_data(data: BlockData, layout: KVLayout, dtype: mx.Dtype, log: logging.Logger) -> mx.array | None:
    """A block's sliding KV read from its own file, or None (a miss) if it does not fit this layout."""
    try:
        swa = _from_bytes(*data.tensors["swa"], dtype)
        _check_rows(swa, len(layout.swa_layers))
    except (KeyError, ValueError, TypeError) as exc:
        log.warning("SSD window unusable (%s): a miss", exc)
        return None
    return swa


def snapshot_from_data(data: BlockData, layout: KVLayout, log: logging.Logger) -> list[list[Any]] | None:
    """A recurrent-state snapshot read from disk, or None (a miss) if it does not fit this layout."""
    try:
        snapshot: list[list[Any]] = [[] for _ in layout.state_layers]
        for name, (raw, shape) in data.tensors.items():
            layer, index, dtype = name[1:].split(".")
            layer, index = int(layer), int(index)
            if index != len(snapshot[layer]):
                raise ValueError(f"tensor {name} out of order")
            snapshot[layer].append(_from_bytes(raw, shape, getattr(mx, dtype)))
        if any(not arrays for arrays in snapshot):
            raise ValueError("a layer's state is missing")
    except (KeyError, ValueError, TypeError, IndexError, AttributeError) as exc:
        log.warning("SSD snapshot unusable (%s): a miss", exc)
        return None
    return snapshot


def _check_rows(a: mx.array | None, num_layers: int) -> None:
    if a is not None and (a.ndim != 4 or a.shape[0] != num_layers):
        raise ValueError(f"shape {a.shape} does not hold {num_layers} layers")

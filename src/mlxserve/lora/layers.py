"""The multi-adapter linear layer: the base layer's output plus each row's own low-rank delta.

Every loaded adapter's (A, B) for this layer sits in one stack, slot 0 all zeros (rows without an adapter,
and adapters that leave this layer alone). Before a forward the runner says which slot each row of the
batch runs under (`RowAdapters`); the layer gathers those rows' A and B and adds
`scale * (x @ A) @ B` per row, as mlx-lm's `LoRALinear` does for one adapter. So a batch of 16 rows over 4
adapters is one base forward plus two small batched matmuls per adapted layer, never a forward per adapter.
Gathering was chosen over grouping rows by adapter: a fixed handful of ops per layer whatever the mix,
and plain `take` + `matmul`, which every MLX backend has (`gather_mm` is float32-only on the CPU).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class RowAdapters:
    """The adapter slot and scale of each row of the next forward, shared by every wrapped layer of a model.
    `index` None: no row runs under an adapter, and the layers add nothing."""

    def __init__(self) -> None:
        self.index: mx.array | None = None  # [B] int32 slots
        self.scales: mx.array | None = None  # [B, 1, 1] each row's adapter scale (0 for slot 0)


class MultiLoRALinear(nn.Module):
    """Wraps a `nn.Linear` / `nn.QuantizedLinear` in place of it (the base weights stay its child `linear`).
    The stacks are kept out of `parameters()`: they are serving state, not the model's weights."""

    def __init__(self, linear: nn.Module, rows: RowAdapters, in_dims: int, out_dims: int) -> None:
        super().__init__()
        self.linear = linear
        self.in_dims, self.out_dims = in_dims, out_dims
        self._rows = rows
        self._a: mx.array | None = None  # [num_slots, in, rank]
        self._b: mx.array | None = None  # [num_slots, rank, out]

    def set_stacks(self, a: mx.array, b: mx.array) -> None:
        self._a, self._b = a, b

    @property
    def stacks(self) -> tuple[mx.array | None, mx.array | None]:
        return self._a, self._b

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        rows = self._rows
        if rows.index is None or self._a is None:
            return y
        a = mx.take(self._a, rows.index, axis=0)  # [B, in, r]
        b = mx.take(self._b, rows.index, axis=0)  # [B, r, out]
        if x.ndim == 2:  # [B, in]: one position per row
            z = ((x[:, None, :] @ a) @ b)[:, 0, :]
            scales = rows.scales[:, 0, :]
        else:
            z = (x @ a) @ b
            scales = rows.scales
        if scales.dtype != z.dtype:
            scales = scales.astype(z.dtype)
        return y + (scales * z).astype(x.dtype)


def linear_dims(layer: Any) -> tuple[int, int] | None:
    """(in, out) of a layer an adapter can wrap; None for any other kind (embeddings, MoE experts...)."""
    if isinstance(layer, MultiLoRALinear):
        return layer.in_dims, layer.out_dims
    if isinstance(layer, nn.QuantizedLinear):
        out_dims, packed = layer.weight.shape
        return packed * 32 // layer.bits, out_dims
    if isinstance(layer, nn.Linear):
        out_dims, in_dims = layer.weight.shape
        return in_dims, out_dims
    return None

"""Quantized layers that hand MLX one matrix of rows, not a batch of one-row matrices.

A decode step calls every projection with activations shaped (rows, 1, hidden). MLX-CUDA 0.32's
quantized matmul treats the leading axis as a batch of separate problems: its tiled kernel launches one
grid slice per row, each reading the whole weight matrix for a single useful row of its 16-row tile
(mlx/backend/cuda/quantized/qmm: `l` is the grid's z extent). Weight reads, the cost of a decode step,
then grow with the rows. The same activations as (rows, hidden) are one problem with `rows` rows, and the
weights are read once per tile of rows. Metal folds the batch itself, so this is applied on MLX-CUDA only
(models/loader.py).

The layers stay `nn.QuantizedLinear` / `nn.QuantizedEmbedding` (subclasses) under the same names with
the same arrays, so anything that walks the model (LoRA, weight accounting, saving) sees no change.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)


def _batched(x: mx.array) -> bool:
    """Whether x holds several matrices of rows (a batch of decode rows, several prompts' chunks). A
    single one, the lone stream's (1, 1, hidden), takes the plain call: a reshape costs that stream's
    CPU-bound step time for nothing."""
    return x.ndim > 2 and x.size > x.shape[-2] * x.shape[-1]


class RowsQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        if not _batched(x):
            return super().__call__(x)
        return super().__call__(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


class RowsQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        # The tied output head: the largest matmul of a small model's step.
        if not _batched(x):
            return super().as_linear(x)
        return super().as_linear(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


_REPLACEMENTS = {nn.QuantizedLinear: RowsQuantizedLinear, nn.QuantizedEmbedding: RowsQuantizedEmbedding}


def _rebase(layer: nn.Module, cls: type) -> nn.Module:
    """`layer` as an instance of `cls` holding the same arrays and settings, without running `cls`'s
    constructor (which would quantize a fresh random matrix of the layer's size)."""
    new = cls.__new__(cls)
    new.__dict__.update(layer.__dict__)  # group_size, bits, mode, frozen names, training flag
    new._no_grad = set(layer._no_grad)
    dict.update(new, layer)  # weight, scales, biases, bias
    return new


def fold_quantized_rows(model: nn.Module) -> int:
    """Replaces the model's quantized linear and embedding layers by the row-folding subclasses above, in
    place (exact types only: a model's own subclass keeps its behaviour). Returns how many were replaced."""
    replaced = 0
    for module in model.modules():
        for key, child in module.items():
            # A module holds its children directly or in lists (a model's layers).
            slots = enumerate(child) if isinstance(child, list) else [(None, child)]
            for index, layer in slots:
                cls = _REPLACEMENTS.get(type(layer))
                if cls is None:
                    continue
                if index is None:
                    module[key] = _rebase(layer, cls)
                else:
                    child[index] = _rebase(layer, cls)
                replaced += 1
    return replaced


def fold_on_cuda(model: nn.Module, environ=os.environ) -> int:
    """fold_quantized_rows where it pays: on MLX-CUDA (measured there: scripts/cuda_qmm_probe.py), unless
    MLXSERVE_FOLD_ROWS=0 (for A/B benchmarks). Returns how many layers were replaced."""
    from mlxserve.models.backend import is_cuda

    if not is_cuda() or environ.get("MLXSERVE_FOLD_ROWS", "1") == "0":
        return 0
    replaced = fold_quantized_rows(model)
    log.info("quantized layers fold decode rows into one matrix on MLX-CUDA (%d layers)", replaced)
    return replaced

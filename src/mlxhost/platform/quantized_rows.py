"""Quantized layers that hand MLX one matrix of rows, not a batch of one-row matrices.

A decode step calls every projection with activations shaped (rows, 1, hidden). MLX-CUDA 0.32's
quantized matmul treats the leading axis as a batch of separate problems: its tiled kernel launches one
grid slice per row, each reading the whole weight matrix for a single useful row of its 16-row tile
(mlx/backend/cuda/quantized/qmm: `l` is the grid's z extent). Weight reads, the cost of a decode step,
then grow with the rows. The same activations as (rows, hidden) are one problem with `rows` rows, and the
weights are read once per tile of rows, which makes a decode step of many rows several times faster
(docs/BENCHMARKS.md, "Quantized layers on MLX-CUDA"). Metal folds the batch itself, so this is
applied on MLX-CUDA only (models/loader.py, distributed/shard.py).

The other way round, at many rows (a prompt's chunk, several prompts' chunks prefilled together) the same
kernel is slower than dequantizing the weight and one plain matmul (cuBLAS), with the logits unchanged
(docs/BENCHMARKS.md, "Quantized layers on MLX-CUDA"). So from
`dequant_rows` rows on, a linear layer (and the tied head) takes that path. The dequantized copy of one
weight lives until its matmul has run on the device, and MLX runs a forward's work only once it is evaluated:
left alone, a forward holds every layer's copy (15 GiB for a random 8B 4-bit shape, several forwards launched
ahead at once took an H100 server from 7 to 56 GiB, past its budget, and its requests ran out of memory). So
a thread's forward evaluates what it built each time its unevaluated copies reach `DEQUANT_EVAL_BYTES`, which
frees them, and the budget counts what is left (`dequant_in_flight_bytes`, memory/profile.py). Tensor-parallel
shards do the same, their all-reduce after the matmul either way: a rank never compiles a tiled kernel for a
prompt's rows (where ranks evaluate at different layers, their collectives still run in the same order).

The layers keep their classes (as subclasses) under the same names with the same arrays, so anything that
walks the model (LoRA, weight accounting, saving) sees no change.
"""

from __future__ import annotations

import logging
import os
import threading

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from mlxhost.platform import backend

log = logging.getLogger(__name__)

# Below this many rows MLX-CUDA takes its matrix-vector kernel, which costs the same either way; folding
# there only adds two reshapes to every layer of a step whose host time is the bottleneck.
_MIN_ROWS = 8
# From this many rows on, dequantize + matmul (see above). Decode batches (at most --max-num-seqs rows, 64 by
# default) stay under it; at this setting the whole prefill gained on both probed shapes (docs/BENCHMARKS.md).
DEQUANT_ROWS = 128
# Row counts up to this run the tiled kernel; above it (from _MIN_ROWS rows on) a layer dequantizes too, while
# that kernel is still being compiled by another process (platform/tile_compile.py, engine/warmup.py).
ALL_TILED_ROWS = 1 << 30
# Dequantized bytes a thread's forward builds before it evaluates them (see above): each wait costs one sync,
# about fifteen per prefill chunk of an 8B 4-bit model (15 GiB of copies), against the chunk's compute.
DEQUANT_EVAL_BYTES = 1 << 30
# How many such sets of dequantized copies one process may hold at once. An evaluation waits for everything
# launched before it on the stream, so one thread holds at most the copies launched since its last wait (the end
# of the forward before, in flight) and those its next wait launches: two. The third is margin, for a forward built on a
# second thread (the warm-up's, under MLXHOST_WARMUP_ISOLATE) and for copies a bound misses (a layer's sibling
# projections built before it, left lazy by its evaluation). Unmeasured beyond the 8B cold start it let run.
DEQUANT_IN_FLIGHT = 3
# Per thread (the warm-up may build its forwards on a thread of its own): copies built since the last wait.
_unevaluated = threading.local()


def _folded(matmul, x: mx.array, layer=None, add_bias: bool = True) -> mx.array:
    """`matmul(x)` with x's matrices as one (rows, hidden) matrix when x holds several (decode rows,
    several prompts' chunks) with enough rows in all for the tiled kernel. The lone stream's (1, 1, hidden)
    and a single prompt's (1, L, hidden) are one matrix already and take the plain call. `layer` (a linear
    layer, the tied embedding or a tensor-parallel shard): from its `dequant_rows` on, and from _MIN_ROWS
    rows on above its `tiled_rows`, the weight is dequantized for one plain matmul instead (`add_bias`:
    False where the caller adds the bias itself, after the shard's all-reduce). This runs in every layer of
    every step, so it reads the shape once."""
    shape = x.shape
    rows = x.size // shape[-1]
    if layer is not None and (0 < layer.dequant_rows <= rows or (rows >= _MIN_ROWS and rows > layer.tiled_rows)):
        w = mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), layer.group_size, layer.bits,
                          getattr(layer, "mode", "affine"))
        copies = w.nbytes
        if w.dtype != x.dtype:
            copies, w = copies + w.size * x.dtype.size, w.astype(x.dtype)
        y = (x.reshape(rows, shape[-1]) @ w.T).reshape(*shape[:-1], -1)
        _bound_unevaluated(y, copies)
        return y + layer["bias"] if add_bias and "bias" in layer else y
    if len(shape) > 2 and rows > shape[-2] and rows >= _MIN_ROWS:
        return matmul(x.reshape(rows, shape[-1])).reshape(*shape[:-1], -1)
    return matmul(x)


def _bound_unevaluated(y: mx.array, copies: int) -> None:
    """Counts a dequantized copy `y` was built from; at `DEQUANT_EVAL_BYTES` evaluates `y` (and the forward up to
    it), so the copies so far run and are freed before more are made."""
    pending = getattr(_unevaluated, "bytes", 0) + copies
    if pending >= DEQUANT_EVAL_BYTES:
        mx.eval(y)
        pending = 0
    _unevaluated.bytes = pending


class _ShardMatmul:
    """The shard's quantized matmul alone, without the bias, and without the `sum_gradients` node mlx's
    all-to-sharded layer adds on every call (identity forward, for training's backward: serving has none, and
    it costs host time in every layer; these classes are inference-only)."""

    def _matmul(self, x: mx.array) -> mx.array:
        return mx.quantized_matmul(x, self["weight"], scales=self["scales"], biases=self.get("biases"), transpose=True,
                                   group_size=self.group_size, bits=self.bits, mode=getattr(self, "mode", "affine"))


class RowsQuantizedLinear(nn.QuantizedLinear):
    dequant_rows = DEQUANT_ROWS  # 0: never (set per layer by fold_quantized_rows)
    tiled_rows = ALL_TILED_ROWS  # set per layer by set_tiled_rows

    def __call__(self, x: mx.array) -> mx.array:
        return _folded(super().__call__, x, self)


class RowsQuantizedEmbedding(nn.QuantizedEmbedding):
    dequant_rows = DEQUANT_ROWS
    tiled_rows = ALL_TILED_ROWS

    def as_linear(self, x: mx.array) -> mx.array:
        # The tied output head: the largest matmul of a small model's step.
        return _folded(super().as_linear, x, self)


_REPLACEMENTS: dict[type, type] = {nn.QuantizedLinear: RowsQuantizedLinear,
                                   nn.QuantizedEmbedding: RowsQuantizedEmbedding}

try:  # tensor-parallel shards (mlx-lm's `shard` builds these): the same matmul, the same dequantize switch
    from mlx.nn.layers.distributed import QuantizedAllToShardedLinear, QuantizedShardedToAllLinear

    class RowsQuantizedAllToShardedLinear(_ShardMatmul, QuantizedAllToShardedLinear):
        dequant_rows = DEQUANT_ROWS
        tiled_rows = ALL_TILED_ROWS

        def __call__(self, x: mx.array) -> mx.array:
            y = _folded(self._matmul, x, self, add_bias=False)
            return y + self["bias"] if "bias" in self else y

    class RowsQuantizedShardedToAllLinear(_ShardMatmul, QuantizedShardedToAllLinear):
        dequant_rows = DEQUANT_ROWS
        tiled_rows = ALL_TILED_ROWS

        def __call__(self, x: mx.array) -> mx.array:
            # Every rank's partial product, summed; the bias once, after the sum.
            y = mx.distributed.all_sum(_folded(self._matmul, x, self, add_bias=False), group=self.group)
            return y + self["bias"] if "bias" in self else y

    _REPLACEMENTS[QuantizedAllToShardedLinear] = RowsQuantizedAllToShardedLinear
    _REPLACEMENTS[QuantizedShardedToAllLinear] = RowsQuantizedShardedToAllLinear
    _TP_ROWS: tuple[type, ...] = (RowsQuantizedAllToShardedLinear, RowsQuantizedShardedToAllLinear)
except ImportError:  # an MLX without them has no such layers to fold
    _TP_ROWS = ()

# Every row-folding class with the dequantize switch (dequant_rows, tiled_rows).
ROW_LAYERS: tuple[type, ...] = (RowsQuantizedLinear, RowsQuantizedEmbedding, *_TP_ROWS)


def _rebase(layer: nn.Module, cls: type) -> nn.Module:
    """`layer` as an instance of `cls` holding the same arrays and settings, without running `cls`'s
    constructor (which would quantize a fresh random matrix of the layer's size)."""
    new = cls.__new__(cls)
    new.__dict__.update(layer.__dict__)  # group_size, bits, mode, a None `biases`, frozen names, training flag
    new._no_grad = set(layer._no_grad)
    dict.update(new, layer)  # weight, scales, biases, bias
    return new


def fold_quantized_rows(model: nn.Module, dequant_rows: int = DEQUANT_ROWS) -> int:
    """Replaces the model's quantized linear and embedding layers by the row-folding subclasses above, in
    place, the way `nn.quantize` swaps layers (exact types only: a model's own subclass keeps its
    behaviour). `dequant_rows`: where linear layers and the tied head switch to dequantize + matmul (0:
    never). Returns how many were replaced."""
    replaced = 0

    def swap(_path, layer):
        nonlocal replaced
        cls = _REPLACEMENTS.get(type(layer))
        if cls is None:
            return layer
        replaced += 1
        new = _rebase(layer, cls)
        if hasattr(cls, "dequant_rows"):
            new.dequant_rows = dequant_rows
        return new

    leaves = tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module)
    if replaced:
        model.update_modules(leaves)
    return replaced


def row_layers(model: nn.Module) -> list[nn.Module]:
    """The model's row-folding layers (those with the dequantize switch)."""
    return [m for _, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module) if isinstance(m, ROW_LAYERS)]


def _layer_dequantized_bytes(layer: nn.Module) -> int:
    """One row-folding layer's weight dequantized (affine: to its scales' dtype; the floating-point modes, whose
    scales are uint8: to bfloat16)."""
    weight = layer["weight"]
    itemsize = layer["scales"].dtype.size if getattr(layer, "mode", "affine") == "affine" else 2
    return weight.shape[0] * (weight.shape[-1] * 32 // layer.bits) * itemsize


def dequantized_bytes(model: nn.Module) -> int:
    """Bytes of every row-folding layer's weight dequantized: what one forward whose rows all dequantize allocates
    in all. An untied model's embedding is counted too, though only a tied head dequantizes: the figure errs high."""
    return sum(_layer_dequantized_bytes(layer) for layer in row_layers(model))


def dequant_in_flight_bytes(model: nn.Module) -> int:
    """What a process serving `model` holds beyond a forward's measured activations while its forwards dequantize:
    `DEQUANT_IN_FLIGHT` forwards' unevaluated copies, each at most `DEQUANT_EVAL_BYTES` and the layer that crossed
    it (a cast copy doubles a layer at most), or the whole model's where that is less. 0 where no layer folds rows
    (Metal, the CPU); counted where the prefill's path is off too, since decode rows dequantize while the tiled
    kernels compile."""
    sizes = [_layer_dequantized_bytes(layer) for layer in row_layers(model)]
    if not sizes:
        return 0
    per_forward = min(sum(sizes), DEQUANT_EVAL_BYTES + 2 * max(sizes))
    return DEQUANT_IN_FLIGHT * per_forward


def set_tiled_rows(model: "nn.Module | list[nn.Module]", rows: int) -> int:
    """Row counts up to `rows` take the tiled kernel in the model's row-folding layers (or in the list of them
    given), more (from _MIN_ROWS on) dequantize + matmul; ALL_TILED_ROWS: no limit. Returns how many layers
    were set."""
    layers = model if isinstance(model, list) else row_layers(model)
    for layer in layers:
        layer.tiled_rows = rows
    return len(layers)


def fold_on_cuda(model: nn.Module, environ=os.environ) -> int:
    """fold_quantized_rows where it pays: on MLX-CUDA, unless MLXHOST_FOLD_ROWS=0 (for A/B benchmarks);
    MLXHOST_DEQUANT_ROWS=N moves the dequantize threshold (0: off). Returns how many layers were replaced."""
    if not backend.is_cuda() or environ.get("MLXHOST_FOLD_ROWS", "1") == "0":
        return 0
    text = environ.get("MLXHOST_DEQUANT_ROWS", str(DEQUANT_ROWS))
    try:
        dequant_rows = int(text)
    except ValueError:
        dequant_rows = -1
    if dequant_rows < 0:
        raise ValueError(f"MLXHOST_DEQUANT_ROWS must be a whole number of rows >= 0 (0: off), got {text!r}")
    replaced = fold_quantized_rows(model, dequant_rows)
    log.info("quantized layers fold decode rows into one matrix on MLX-CUDA (%d layers)%s", replaced,
             f"; from {dequant_rows} rows on they dequantize for one plain matmul" if dequant_rows else "")
    return replaced

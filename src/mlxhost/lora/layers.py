"""The multi-adapter linear layer: the base layer's output plus each row's own low-rank delta.

Every loaded adapter's A and B for this layer sit side by side in one pair of matrices: A_all (in, K*R) and
B_all (K*R, out) for K adapters padded to rank R, adapter k in block k (zeros where it leaves this layer
alone). Before a forward the runner says which adapter each row of the batch runs under (`RowAdapters`:
per row, its adapter's scale over that adapter's K*R columns and 0 elsewhere), and the layer computes

    y = base(x) + ((x @ A_all) * row_scales) @ B_all         (the last matmul and the add: one addmm)

which for a row of adapter k is mlx-lm's `LoRALinear` output, `scale * (x @ A_k) @ B_k` (the scale applied
before B rather than after: the same up to float rounding), the other blocks adding exact zeros. So a batch
of 16 rows over 4 adapters is one base forward plus three ops per adapted layer, never a forward per
adapter. Chosen over gathering each row's A and B (`take` + batched matmul: 7 ops a layer) and over grouping
rows by adapter (ops growing with the adapters in the batch): on the CPU with a tiny model every op shows.
Ranks are small, so the width K*R costs little. Only matmul, addmm and a multiply: every MLX backend has them.

The gathered layout is kept for MLX-CUDA (`gather=True`): there each float matmul above goes through
cuBLASLt, set up anew on every call, while a 4-bit base model runs only MLX's own kernels, which made a
decode step with adapters several times slower than the base model's (docs/BENCHMARKS.md).
Gathered, each row takes its adapter's A and B (`take`, slot 0 all zeros for rows without one) and one
position per row is a batched matrix-vector product, which MLX-CUDA runs with its own gemv kernel (ranks
padded to a multiple of 32 for it). Both layouts give the same rows; the CPU keeps the dense one.

Still ~7 ops per adapted layer, which on MLX-CUDA cost more than the model's own (docs/lora.md). So MLX-CUDA
takes a third layout, fused: the gathered stacks, but one kernel launch per group of layers that read the
same input (`FusedGroup`, fused.py) computes every member's base output plus delta for decode steps and
speculative verification and prefill chunks (see MAX_FUSED_PER_ROW).
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxhost.lora.fused import MAX_POSITIONS


class RowAdapters:
    """Each row's adapter for the next forward, shared by every wrapped layer of a model. `scales` None: no
    row runs under an adapter, and the layers add nothing."""

    def __init__(self) -> None:
        self.scales: mx.array | None = None  # [B, 1, K*R]: the row adapter's scale over its block, 0 elsewhere
        # The gathered layout's: each row's slot (0: none) and scale [B, 1, 1].
        self.index: mx.array | None = None
        self.row_scales: mx.array | None = None
        self.forward = 0  # counts forwards: a group's shared product is only reused within one
        self._cast: dict = {}

    def set(self, scales: mx.array | None, index: mx.array | None = None,
            row_scales: mx.array | None = None) -> None:
        self.scales, self.index, self.row_scales, self._cast = scales, index, row_scales, {}
        self.forward += 1

    def as_dtype(self, dtype, repeat: int) -> mx.array:
        """The scales in the dtype of the layer's activations (as mlx-lm's Python float scale would be),
        repeated for each member of a group."""
        key = (dtype, repeat)
        if key not in self._cast:
            scales = self.scales if self.scales.dtype == dtype else self.scales.astype(dtype)
            self._cast[key] = mx.tile(scales, (1, 1, repeat)) if repeat > 1 else scales
        return self._cast[key]


class InputGroup:
    """Wrapped layers of one parent module that read the same input (q/k/v projections, gate/up): their A
    side by side, A_group (in, G*K*R), so one matmul and one multiply serve them all when they are called
    with the same array, as mlx-lm's attention and MLP blocks do. Each member's B is widened with zero rows to
    the group's width, so it reads the shared product without slicing it. A member called with another
    input computes the product for itself: still right, only not shared."""

    def __init__(self, a: mx.array, size: int) -> None:
        self.a, self.size = a, size
        self._key: tuple | None = None  # (forward, input) the product below belongs to
        self._h: mx.array | None = None

    def product(self, x: mx.array, rows: RowAdapters) -> mx.array:
        if self._key is not None and self._key[0] == rows.forward and self._key[1] is x:
            return self._h
        h = x @ self.a
        scales = rows.as_dtype(h.dtype, self.size)
        h = h * (scales if x.ndim == 3 else scales[:, 0, :])  # [B, in] input: one position per row
        self._key, self._h = (rows.forward, x), h
        return h

    def forget(self) -> None:
        self._key = self._h = None




def _fused_positions(environ=os.environ) -> int:
    text = environ.get("MLXHOST_LORA_FUSED_POSITIONS", str(MAX_POSITIONS))
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"MLXHOST_LORA_FUSED_POSITIONS must be a whole number of positions >= 1, got {text!r}")
    return int(text)


# Positions per row up to which the fused layout launches its kernel: every step by default. On an H200
# (docs/lora.md) prefill through the kernel added 22 ms at the median to the base model's first token, through
# the gathered ops 90 ms (their cuBLASLt matmuls pay a set-up per call). MLXHOST_LORA_FUSED_POSITIONS lowers
# the limit (e.g. 8: decode steps and verification only, prefill on the gathered ops), for benchmarks.
MAX_FUSED_PER_ROW = _fused_positions()


class FusedGroup:
    """Wrapped layers in the fused layout that read the same input: the first member called with an input
    computes every member's output in one launch (their base outputs, then the kernel), and the others take
    theirs from it when called with the same array in the same forward. A member called with another input
    runs the group again for it: still right, only not shared."""

    def __init__(self, layers: list["MultiLoRALinear"], kernel) -> None:
        self.kernel = kernel
        # Looked up once: this runs for every group of every block at each decode step.
        self._linears = [m.linear for m in layers]
        self._stacks = [m._stacks[:2] for m in layers]
        self._rank = layers[0]._stacks[2]
        self._key: tuple | None = None  # (forward, input) the outputs below belong to
        self._outs: list[mx.array] | None = None

    def signature(self) -> tuple:
        """What the kernel is compiled for, besides the activations' dtype: the
        ranks, input and output sizes and the stacks' dtype (not the number of adapters)."""
        return (self._rank, *((a.shape[1:], b.shape[1], a.dtype) for a, b in self._stacks))

    def warm(self, dtype) -> None:
        """Runs the kernel once on one decode-shaped row (no adapter), so it compiles now rather than in the
        first decode step under an adapter: MLX keeps no custom kernel on disk and each compile takes seconds."""
        x = mx.zeros((1, 1, self._stacks[0][0].shape[-1]), dtype)
        ys = [linear(x) for linear in self._linears]
        mx.eval(self.kernel(x, ys, self._stacks, mx.zeros((1,), mx.int32), mx.zeros((1, 1, 1), mx.float32),
                            self._rank))

    def output(self, slot: int, x: mx.array, rows: RowAdapters) -> mx.array:
        if self._key is None or self._key[0] != rows.forward or self._key[1] is not x:
            ys = [linear(x) for linear in self._linears]
            self._outs = self.kernel(x, ys, self._stacks, rows.index, rows.row_scales, self._rank)
            self._key = (rows.forward, x)
        return self._outs[slot]


class MultiLoRALinear(nn.Module):
    """Wraps a `nn.Linear` / `nn.QuantizedLinear` in place of it (the base weights stay its child `linear`).
    The adapters' matrices are kept out of `parameters()`: they are serving state, not the model's weights."""

    def __init__(self, linear: nn.Module, rows: RowAdapters, in_dims: int, out_dims: int) -> None:
        super().__init__()
        self.linear = linear
        self.in_dims, self.out_dims = in_dims, out_dims
        self._rows = rows
        self._group: InputGroup | None = None
        self._slot = 0  # this layer's place in its group
        self._b: mx.array | None = None  # [K*R, out]
        # The gathered layout instead: A^T [1+K, R', in] and B^T [1+K, out, R'] (slot 0 zeros, R' >= R), and R.
        self._stacks: tuple[mx.array, mx.array, int] | None = None
        self._fused: FusedGroup | None = None  # the fused layout's group (it uses the stacks above)

    def attach(self, group: InputGroup | None, slot: int, b: mx.array | None) -> None:
        self._group, self._slot, self._b, self._stacks, self._fused = group, slot, b, None, None

    def attach_stacks(self, a: mx.array, b: mx.array, rank: int, pad: bool = True) -> None:
        """The gathered layout from A [in, K*R] and B [K*R, out]; `pad` False for the fused layout, whose
        decode steps run no gemv (and whose stacks are then a quarter of the size at rank 8)."""
        num = a.shape[1] // rank
        wide = -(-rank // 32) * 32 if pad else rank  # MLX-CUDA's gemv wants the reduced size a multiple of 32
        at = mx.pad(a.reshape(self.in_dims, num, rank).transpose(1, 2, 0), [(1, 0), (0, wide - rank), (0, 0)])
        bt = mx.pad(b.reshape(num, rank, self.out_dims).transpose(0, 2, 1), [(1, 0), (0, 0), (0, wide - rank)])
        self._group, self._b, self._stacks = None, None, (mx.contiguous(at), mx.contiguous(bt), rank)
        self._fused, self._slot = None, 0

    @property
    def arrays(self) -> tuple[mx.array, ...]:
        """What this layer holds (the group's A counted by its first member)."""
        if self._stacks is not None:
            return self._stacks[:2]
        return (self._group.a, self._b) if self._slot == 0 else (self._b,)

    @property
    def weights(self) -> tuple[mx.array | None, mx.array | None]:
        """This layer's own A [in, K*R] and B [K*R, out]."""
        if self._stacks is not None:
            at, bt, rank = self._stacks
            a = at[1:, :rank].transpose(2, 0, 1).reshape(self.in_dims, -1)
            return a, bt[1:, :, :rank].transpose(0, 2, 1).reshape(-1, self.out_dims)
        if self._group is None:
            return None, None
        width = self._b.shape[0]
        return self._group.a[:, self._slot * width: (self._slot + 1) * width], self._b

    def __call__(self, x: mx.array) -> mx.array:
        if self._stacks is not None and self._rows.index is not None:
            # The kernel maps positions to rows by count, so it needs x's rows to be the batch's rows.
            if self._fused is not None and x.shape[0] == self._rows.index.shape[0] \
                    and (x.ndim == 2 or x.shape[-2] <= MAX_FUSED_PER_ROW) and x.size // self.in_dims <= MAX_POSITIONS:
                return self._fused.output(self._slot, x, self._rows)
            y = self.linear(x)
            return y + self._gathered(x).astype(y.dtype)
        y = self.linear(x)
        if self._rows.scales is None or self._group is None:
            return y
        h = self._group.product(x, self._rows)
        if self._group.size > 1:
            width = self._b.shape[0]
            h = h[..., self._slot * width: (self._slot + 1) * width]
        if h.dtype != y.dtype:  # adapters in float32 on a bfloat16 model: the delta in float32, then cast
            return y + (h @ self._b).astype(y.dtype)
        return mx.addmm(y, h, self._b)

    def _gathered(self, x: mx.array) -> mx.array:
        at, bt, _ = self._stacks
        rows = self._rows
        x3 = x if x.ndim == 3 else x[:, None, :]
        # Transposed views of contiguous stacks: one position per row is a batched gemv on MLX-CUDA.
        h = x3 @ mx.take(at, rows.index, axis=0).swapaxes(-1, -2)  # [B, L, R']
        scales = rows.row_scales if rows.row_scales.dtype == h.dtype else rows.row_scales.astype(h.dtype)
        z = (h * scales) @ mx.take(bt, rows.index, axis=0).swapaxes(-1, -2)  # [B, L, out]
        return z if x.ndim == 3 else z[:, 0, :]


# Sibling layers mlx-lm's blocks call with one input (a group only saves work: any grouping gives the same
# output, as a member called with another input computes its own product).
_SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("wq", "wk", "wv"), ("w1", "w3"))
_SHARED_OF = {name: i for i, names in enumerate(_SHARED_INPUT) for name in names}


def group_layers(layers: dict[str, MultiLoRALinear], weights: dict[str, tuple[mx.array, mx.array]],
                 gather_rank: int = 0, fused=None) -> None:
    """Gives each wrapped layer its matrices (`weights`: path -> A [in, K*R], B [K*R, out]), grouping the
    siblings that share their input (InputGroup); with `gather_rank` (R), in the gathered layout instead,
    and with a `fused` kernel (fused.py) also grouped for it (FusedGroup)."""
    groups: dict[tuple, list[str]] = {}
    for path, layer in layers.items():
        parent, _, name = path.rpartition(".")
        groups.setdefault((parent, layer.in_dims, _SHARED_OF.get(name, name)), []).append(path)
    if gather_rank:
        for path, (a, b) in weights.items():
            layers[path].attach_stacks(a, b, gather_rank, pad=fused is None)
        if fused is not None:
            for paths in groups.values():
                group = FusedGroup([layers[p] for p in paths], fused)
                for slot, path in enumerate(paths):
                    layers[path]._fused, layers[path]._slot = group, slot
        return
    for paths in groups.values():
        a = mx.concatenate([weights[p][0] for p in paths], axis=1) if len(paths) > 1 else weights[paths[0]][0]
        group = InputGroup(a, len(paths))
        for slot, path in enumerate(paths):
            layers[path].attach(group, slot, weights[path][1])


def layer_bytes(layers: dict[str, MultiLoRALinear]) -> int:
    return sum(a.nbytes for layer in layers.values() for a in layer.arrays)


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

"""The fused layout's one launch per group of adapted layers (MLX-CUDA): decode steps, verification, prefill.

MLX-CUDA spends about as long encoding a small op as a 0.6B model's decode step spends on each of its own
~700 ops, so the gathered layout's ~7 ops per adapted layer tripled the step time (docs/lora.md). Here one
`mx.fast.cuda_kernel` launch serves every member of an input group (q/k/v, gate/up, or one layer alone):

    out_g[p] = y_g[p] + scale[row] * (x[p] @ A_g[slot[row]]^T) @ B_g[slot[row]]^T     p = a position, row = p // L

(the products in float32, the delta rounded to y's type before the add, as mlx-lm's `LoRALinear` adds it)
with y_g the member's base output, A_g [1+K, R', in] and B_g [1+K, out, R'] the gathered layout's stacks
(slot 0 zeros: a row without an adapter gets y back unchanged). Each block takes one position and a tile of
256 outputs of one member: its warps first compute the position's R products (float32, in shared memory),
then each thread one output. Every block of a position recomputes the R products: they are a few
kilobytes read from L2, cheaper than a second launch. The positions per row arrive as a one-element
input, not a template constant, so a verification step of another draft length or a prefill chunk of
another length compiles nothing new.

`fused_ops` computes the same outputs with MLX ops (the same float32 products): the tests run the fused layout's
grouping with it on any backend, and the device check compares the kernel with it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

THREADS = 256  # outputs per block, and the threads that share a position's rank-R products
MAX_POSITIONS = 65535  # a launch's positions are its grid's y dimension, which CUDA caps at this

# Signature: fn(x, ys, stacks [(A^T stack, B^T stack)], slot per row [B] int32, scale per row [B] float32, R)
# -> one output per y, shaped and typed as that y.
FusedFn = Callable[[mx.array, Sequence[mx.array], Sequence[tuple[mx.array, mx.array]], mx.array, mx.array, int],
                   list[mx.array]]

_HEADER = """
__device__ inline float lora_float(float v) { return v; }
__device__ inline float lora_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float lora_float(__half v) { return __half2float(v); }
__device__ inline void lora_store(float* p, float v) { *p = v; }
__device__ inline void lora_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
__device__ inline void lora_store(__half* p, float v) { *p = __float2half(v); }
// The delta rounded to the output's type before the add, as mlx-lm's LoRALinear adds it.
__device__ inline float lora_round(float v, const float*) { return v; }
__device__ inline float lora_round(float v, const __nv_bfloat16*) { return __bfloat162float(__float2bfloat16(v)); }
__device__ inline float lora_round(float v, const __half*) { return __half2float(__float2half(v)); }
"""

# R, RP (stack width), IN and each member's OUT<g> / T<g> (its tiles) are template
# constants; the members' pointers are chosen per block below (_select).
_BODY = """
    const int p = blockIdx.y;
    const int row = p / positions_per_row[0];
    const int slot = slot_of_row[row];
    int tile = blockIdx.x;
$SELECT
    const int j = tile * $THREADS + threadIdx.x;
    const size_t at = (size_t)p * out_dim + j;
    if (slot == 0) {  // no adapter on this row: the base output as it is
        if (j < out_dim) o[at] = y[at];
        return;
    }
    __shared__ float h[R];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const auto* xp = x + (size_t)p * IN;
    const auto* ap = a + (size_t)slot * RP * IN;
    const float s = scale_of_row[row];
    for (int r = warp; r < R; r += $WARPS) {
        const auto* ar = ap + (size_t)r * IN;
        float acc = 0.0f;
#pragma unroll 4
        for (int i = lane; i < IN; i += 32) acc += lora_float(xp[i]) * lora_float(ar[i]);
        for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffff, acc, off);
        if (lane == 0) h[r] = acc * s;
    }
    __syncthreads();
    if (j < out_dim) {
        const auto* bp = b + ((size_t)slot * out_dim + j) * RP;
        float d = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) d += h[r] * lora_float(bp[r]);
        lora_store(o + at, lora_float(y[at]) + lora_round(d, y));
    }
"""


def _select(size: int) -> str:
    lines = ["    auto a = a0; auto b = b0; auto y = y0; auto o = o0; int out_dim = OUT0;"]
    for g in range(1, size):
        lines.append(f"    if (tile >= T{g - 1}) {{ tile -= T{g - 1}; a = a{g}; b = b{g}; y = y{g}; o = o{g}; "
                     f"out_dim = OUT{g};")
    lines.append("    " + "}" * (size - 1))
    return "\n".join(lines)


def kernel_source(size: int) -> str:
    return (_BODY.replace("$SELECT", _select(size)).replace("$THREADS", str(THREADS))
            .replace("$WARPS", str(THREADS // 32)))


class CudaFused:
    """The kernel, built once per group size on first use; call it only where MLX computes on CUDA
    (AdapterSet checks the backend before it takes one)."""

    def __init__(self) -> None:
        self._kernels: dict[int, object] = {}
        self._launches: dict[tuple, dict] = {}  # shapes -> the launch's arguments: built once, reused each step
        self._per_row: dict[int, mx.array] = {}  # positions per row -> that number as a one-element input

    def _kernel(self, size: int):
        if size not in self._kernels:
            names = ["x", "positions_per_row", "slot_of_row", "scale_of_row"]
            names += [f"{kind}{g}" for kind in ("a", "b", "y") for g in range(size)]
            self._kernels[size] = mx.fast.cuda_kernel(
                name=f"mlxhost_lora_fused{size}", input_names=names, output_names=[f"o{g}" for g in range(size)],
                source=kernel_source(size), header=_HEADER)
        return self._kernels[size]

    def __call__(self, x, ys, stacks, index, scales, rank):
        key = (x.shape, index.shape[0], rank, stacks[0][0].shape[1], *(y.shape for y in ys), ys[0].dtype)
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = self._launch(x, ys, stacks, index, rank)
        per_row = launch["per_row"]
        if per_row not in self._per_row:
            self._per_row[per_row] = mx.array([per_row], dtype=mx.int32)
        return launch["kernel"](inputs=[x, self._per_row[per_row], index, scales, *(a for a, _ in stacks),
                                        *(b for _, b in stacks), *ys], **launch["args"])

    def _launch(self, x, ys, stacks, index, rank) -> dict:
        in_dims = x.shape[-1]
        positions = x.size // in_dims
        tiles = [-(-y.shape[-1] // THREADS) for y in ys]
        template = [("R", rank), ("RP", stacks[0][0].shape[1]), ("IN", in_dims)]
        template += [(f"OUT{g}", y.shape[-1]) for g, y in enumerate(ys)]
        template += [(f"T{g}", t) for g, t in enumerate(tiles)]
        return {"kernel": self._kernel(len(ys)), "per_row": positions // index.shape[0], "args": {
            "template": template, "grid": (sum(tiles) * THREADS, positions, 1), "threadgroup": (THREADS, 1, 1),
            "output_shapes": [y.shape for y in ys], "output_dtypes": [y.dtype for y in ys]}}


def fused_ops(x, ys, stacks, index, scales, rank):
    """The kernel's outputs with MLX ops: the delta in float32, rounded to the output's type and added."""
    rows = index.shape[0]
    x3 = x.reshape(rows, -1, x.shape[-1]).astype(mx.float32)
    scales = scales.reshape(rows, 1, 1).astype(mx.float32)
    outs = []
    for y, (at, bt) in zip(ys, stacks):
        a = mx.take(at, index, axis=0)[:, :rank].astype(mx.float32)  # [B, R, in]
        b = mx.take(bt, index, axis=0)[..., :rank].astype(mx.float32)  # [B, out, R]
        delta = ((x3 @ a.swapaxes(-1, -2)) * scales) @ b.swapaxes(-1, -2)
        outs.append(y + delta.reshape(y.shape).astype(y.dtype))
    return outs

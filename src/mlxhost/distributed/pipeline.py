"""Pipeline parallel for the plain decoder families (Qwen2, Qwen3): this rank's stage of layers, and the
hand-off of the activations from one stage to the next.

mlx-lm pipelines some families itself (`Model.model.pipeline(group)`), but its forward passes the
activations with `mx.distributed.send` / `recv_like`, which MLX's NCCL backend does not have (mlx
0.32.4 raises "Send not supported"). Here the stage's forward is ours, and the hand-off is either:

- "sendrecv": stage to stage with send / recv, then one all-gather of the last stage's output (what
  mlx-lm does; ring, jaccl, mpi);
- "gather": one all-gather per stage, every rank taking the slice of the stage that just ran. Every
  rank joins every hand-off (the others' slices are read by nobody), so it needs nothing but the
  collective every backend has. It moves `size` times the activation per hand-off: for decode a few
  KB, for a 2,048-token prefill chunk of a 32B model (hidden 5,120, bfloat16) 21 MB a rank.

Every rank embeds the tokens and applies the final norm and the LM head, as with mlx-lm's pipeline:
they all hold the same logits and sample the same tokens (engine.py). Stages are split as mlx-lm
splits them (the last rank runs the first layers), so a model's split is the same either way.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


def split_layers(num_layers: int, size: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's layers: an even split, the low ranks one more, the last rank first
    (mlx-lm's PipelineMixin.pipeline)."""
    base, extra = divmod(num_layers, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    if min(counts) < 1:
        raise ValueError(f"{num_layers} layers cannot be split over {size} pipeline stages")
    bounds = []
    for rank in range(size):
        start = sum(counts[rank + 1 :])
        bounds.append((start, start + counts[rank]))
    return bounds


class PipelineStage(nn.Module):
    """Takes the place of `Model.model` (the inner decoder) on a pipeline rank: same children
    (`embed_tokens`, `layers` of this stage only, `norm`), so mlx-lm's outer `Model` (LM head, tied
    embeddings, `layers` for the caches) works on it unchanged. Layers of other stages are dropped
    before any weight is read."""

    def __init__(self, inner: nn.Module, group: Any, handoff: str) -> None:
        super().__init__()
        self.rank, self.size = group.rank(), group.size()
        self.group = group
        self.handoff = handoff
        self.start, self.end = split_layers(len(inner.layers), self.size)[self.rank]
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers[self.start : self.end]
        self.norm = inner.norm

    @property
    def pipeline_layers(self) -> list:  # what qwen2's Model.layers reads
        return self.layers

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        from mlx_lm.models.base import create_attention_mask  # lazy: mlx_lm only when used

        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        if self.handoff == "sendrecv":
            h = self._sendrecv(h, mask, cache)
        else:
            h = self._gathered(h, mask, cache)
        return self.norm(h)

    def _run_layers(self, h: mx.array, mask: Any, cache: list) -> mx.array:
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return h

    def _gathered(self, h: mx.array, mask: Any, cache: list) -> mx.array:
        # Stages in order (rank size-1 first). The dtype is pinned to the embedding's so every rank
        # gathers buffers of one size (a no-op: the layers keep the activations' dtype).
        rows, dtype = h.shape[0], h.dtype
        for stage in range(self.size - 1, -1, -1):
            if stage == self.rank:
                h = self._run_layers(h, mask, cache).astype(dtype)
            h = mx.distributed.all_gather(h, group=self.group)[stage * rows : (stage + 1) * rows]
        # Evaluating only the caches (a prompt's inner chunks, start-up probes) must still run every hand-off:
        # the first stage's caches need none of them, a later stage's only the earlier ones, and a rank that
        # skipped a collective the others ran would pair its next one with theirs.
        for c in cache:
            _tie(c, h)
        return h

    def _sendrecv(self, h: mx.array, mask: Any, cache: list) -> mx.array:
        rank, size = self.rank, self.size
        if rank < size - 1:
            h = mx.distributed.recv_like(h, rank + 1, group=self.group)
        h = self._run_layers(h, mask, cache)
        if rank != 0:
            h = mx.distributed.send(h, rank - 1, group=self.group)
            _tie(cache[-1], h)  # the send runs when the cache is evaluated, even if h is not read
        return mx.distributed.all_gather(h, group=self.group)[: h.shape[0]]


def _tie(c: Any, h: mx.array) -> None:
    """Makes a layer cache's keys depend on `h`, so evaluating the cache runs the collective behind `h`:
    plain keys, or quantized KV's (data, scales, biases) tuple, which stays a tuple."""
    keys = getattr(c, "keys", None)
    if isinstance(keys, mx.array):
        c.keys = mx.depends(keys, h)
    elif isinstance(keys, tuple) and keys and isinstance(keys[0], mx.array):
        c.keys = (mx.depends(keys[0], h), *keys[1:])


def make_stage(model: nn.Module, group: Any, handoff: str) -> None:
    """This rank's stage in place of the model's inner decoder (before its weights are evaluated)."""
    model.model = PipelineStage(model.model, group, handoff)

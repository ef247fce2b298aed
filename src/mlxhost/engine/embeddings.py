"""Embeddings from a served decoder: the final norm's hidden states (before the LM head), taken at
each input's last token and L2-normalized (last-token pooling, as Qwen3-Embedding-style models are
trained).

Inputs run batched, right-padded to the longest of their batch. That is exact for a causal model:
no position attends to a later one, so a row's own last real position never sees the padding (left
padding would shift positions and need masks). Long inputs run in chunks of `step` positions through
a prompt cache, as prefill does, so one call never holds the engine thread for a whole long input.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache


class EmbeddingsUnsupportedError(ValueError):
    """The model has no body that returns hidden states the way mlx-lm's decoders do."""


class DimensionsTooLargeError(ValueError):
    def __init__(self, dimensions: int, hidden_size: int) -> None:
        super().__init__(f"dimensions is {dimensions}; this model's embeddings have {hidden_size}")
        self.hidden_size = hidden_size


def hidden_body(model: Any):
    """The module under the LM head: `model.model` for most mlx-lm families, `backbone` for
    Mamba-style ones, under `language_model` for models that wrap a text model."""
    outer = getattr(model, "language_model", model)
    for name in ("model", "backbone"):
        body = getattr(outer, name, None)
        if callable(body):
            return body
    raise EmbeddingsUnsupportedError(f"{type(model).__module__} exposes no hidden states for embeddings")


def hidden_size(model: Any) -> int:
    """Width of the pooled vectors, from a one-token forward (config names for it vary by family)."""
    h = hidden_body(model)(mx.array([[0]]), cache=make_prompt_cache(model))
    if h.ndim != 3:
        raise EmbeddingsUnsupportedError(f"{type(model).__module__}'s body returns shape {h.shape}, not hidden states")
    return h.shape[-1]


def plan_batches(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Input indices in batches of similar length whose padded size (rows x longest) stays within
    `max_batch_tokens` (a single longer input is a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class EmbeddingBatch:
    """One right-padded batch, advanced `step` positions per call to `advance` (engine thread only)."""

    def __init__(self, model: Any, token_lists: list[list[int]], step: int) -> None:
        self.body = hidden_body(model)
        self.step = step
        width = max(len(t) for t in token_lists)
        self.tokens = mx.array([t + [0] * (width - len(t)) for t in token_lists])
        self.last = [len(t) - 1 for t in token_lists]
        self.cache = make_prompt_cache(model)
        self.start = 0
        self.rows: list[int] = []  # batch rows in the order their vectors were taken
        self.pooled: list[mx.array] = []

    @property
    def done(self) -> bool:
        return self.start >= self.tokens.shape[1]

    def advance(self) -> bool:
        """Runs the next chunk; True once every row's last token went through."""
        end = self.start + self.step
        h = self.body(self.tokens[:, self.start:end], cache=self.cache)
        rows = [r for r, p in enumerate(self.last) if self.start <= p < end]
        if rows:
            cols = [self.last[r] - self.start for r in rows]
            self.pooled.append(h[mx.array(rows), mx.array(cols)].astype(mx.float32))
            self.rows.extend(rows)
        mx.eval(self.pooled, [c.state for c in self.cache])
        self.start = end
        if self.done:
            self.cache = None  # the KV of a finished batch is not needed for anything else
        return self.done

    def vectors(self) -> mx.array:
        """[rows, hidden] raw pooled states in input order."""
        pooled = mx.concatenate(self.pooled)
        return pooled[mx.array(np.argsort(self.rows))]


def normalize(vectors: mx.array, dimensions: int | None = None) -> mx.array:
    """Keeps the first `dimensions` (Matryoshka-style), then scales each row to unit L2 norm."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    norms = mx.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / mx.maximum(norms, 1e-12)


class EmbeddingJob:
    """A request's inputs, run batch by batch and chunk by chunk: each `advance` is one short piece
    of work for the engine thread, so running streams get decode steps in between."""

    def __init__(self, token_lists: list[list[int]], dimensions: int | None = None,
                 max_batch_tokens: int = 4096) -> None:
        self.token_lists, self.dimensions = token_lists, dimensions
        self.plan = plan_batches([len(t) for t in token_lists], max_batch_tokens)
        self.checked = False
        self.current: EmbeddingBatch | None = None
        self.parts: list[tuple[list[int], mx.array]] = []
        self.result: np.ndarray | None = None  # [inputs, dims] float32, set by the last advance

    def advance(self, model: Any, step: int = 512) -> bool:
        """Runs one chunk of `step` positions on the engine thread; True when `result` is ready."""
        if not self.checked:
            size = hidden_size(model)  # also refuses a model without hidden states, before any work
            if self.dimensions is not None and self.dimensions > size:
                raise DimensionsTooLargeError(self.dimensions, size)
            self.checked = True
        if self.current is None:
            indices = self.plan[len(self.parts)]
            self.current = EmbeddingBatch(model, [self.token_lists[i] for i in indices], step)
        if self.current.advance():
            self.parts.append((self.plan[len(self.parts)], self.current.vectors()))
            self.current = None
        if len(self.parts) < len(self.plan):
            return False
        order = np.argsort([i for indices, _ in self.parts for i in indices])
        pooled = mx.concatenate([v for _, v in self.parts])[mx.array(order)]
        self.result = np.array(normalize(pooled, self.dimensions))
        self.parts = []
        return True

    def advance_on(self, core: Any) -> bool:
        """`advance` on an engine core's model, one prefill chunk long: what the HTTP side hands to
        `AsyncEngine.call`, as it hands an encoder's or cross-encoder's job (it never touches the model)."""
        return self.advance(core.runner.model, core.config.prefill_step_size)


def embed(model: Any, token_lists: list[list[int]], dimensions: int | None = None, step: int = 512,
          max_batch_tokens: int = 4096) -> mx.array:
    """[N, H] (or [N, dimensions]) unit-norm float32 embeddings of `token_lists`, in order."""
    if not token_lists or any(not t for t in token_lists):
        raise ValueError("embed needs at least one input, each of at least one token")
    job = EmbeddingJob(token_lists, dimensions, max_batch_tokens)
    while not job.advance(model, step):
        pass
    return mx.array(job.result)

"""Encoder embedding models on their own engine thread: a core that only answers `call`s.

The model (mlx-embeddings' BERT / ModernBERT / XLM-RoBERTa module) runs on the thread of an
`AsyncEngine` like every served model (one thread owns the model and its MLX stream), but there is no
scheduler, KV cache or generation: `EncoderCore` has nothing to step, and each `EncoderJob.advance`
call encodes one batch of the request's inputs.

Inputs run right-padded with an attention mask, so padding changes no real token's state (masked
keys get -1e4 before the softmax: exactly zero weight in float32) and pooling counts real tokens only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxhost.engine.contract import CoreStats
from mlxhost.engine.embeddings import DimensionsTooLargeError, normalize, plan_batches
from mlxhost.engine.loop import Assembled, AsyncEngine


def pool(hidden: mx.array, mask: mx.array, mode: str) -> mx.array:
    """[B, T, H] hidden states -> [B, H] float32, over the real tokens that `mask` ([B, T] of 1/0) marks."""
    hidden = hidden.astype(mx.float32)
    m = mask.astype(mx.float32)[..., None]
    if mode == "mean":
        return (hidden * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1.0)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return mx.where(m > 0, hidden, -mx.inf).max(axis=1)
    if mode == "lasttoken":
        last = mask.astype(mx.int32).sum(axis=1) - 1  # right padding: the last real position
        return mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    raise ValueError(f"unknown pooling {mode!r}")


def last_hidden_state(model, tokens: mx.array, mask: mx.array) -> mx.array:
    """[B, T, H] per-token states. ModernBERT's top module runs its MLM head (a vocabulary-wide
    projection per token) or pools by its own config: its encoder body underneath gives the states."""
    if model.kind == "modernbert":
        return model.module.model(tokens, attention_mask=mask, return_dict=True)["last_hidden_state"]
    # Keywords: BERT's second positional argument is token_type_ids, XLM-RoBERTa's attention_mask.
    return model.module(tokens, attention_mask=mask).last_hidden_state


def hidden_size(model) -> int:
    return int(model.module.config.hidden_size)


class EncoderJob:
    """A request's inputs in batches of similar length; each `advance` encodes one batch on the engine
    thread, so a large request never holds it for long and a gone client stops between batches."""

    def __init__(self, token_lists: list[list[int]], dimensions: int | None = None,
                 max_batch_tokens: int = 4096) -> None:
        self.token_lists, self.dimensions = token_lists, dimensions
        self.plan = plan_batches([len(t) for t in token_lists], max_batch_tokens)
        self.parts: list[mx.array] = []
        self.result: np.ndarray | None = None  # [inputs, dims] float32, set by the last advance

    def advance(self, core: "EncoderCore") -> bool:
        """Encodes the next batch; True once `result` is ready."""
        model = core.model
        if not self.parts and self.dimensions is not None and self.dimensions > hidden_size(model):
            raise DimensionsTooLargeError(self.dimensions, hidden_size(model))
        rows = [self.token_lists[i] for i in self.plan[len(self.parts)]]
        width = max(len(r) for r in rows)
        tokens = mx.array([r + [model.pad_token_id] * (width - len(r)) for r in rows])
        mask = mx.array([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        pooled = pool(last_hidden_state(model, tokens, mask), mask, model.pooling)
        mx.eval(pooled)
        self.parts.append(pooled)
        if len(self.parts) < len(self.plan):
            return False
        order = np.argsort([i for indices in self.plan for i in indices])
        vectors = mx.concatenate(self.parts)[mx.array(order)]
        self.result = np.array(normalize(vectors, self.dimensions))
        self.parts = []
        return True


class EncoderCore:
    """The engine core of an encoder (engine/contract.py's Core): owns the model on the engine thread; its work
    comes as `AsyncEngine.call` jobs, so it takes no generation request and never has a step to run."""

    def __init__(self, model: Any, config: Any) -> None:
        self.model, self.config = model, config
        self.budget = None  # no KV cache, so no memory budget of its own (the weights are all it holds)

    @property
    def has_work(self) -> bool:
        return False

    def add(self, request) -> None:
        # The door refuses generation on an embedding model first; this is the engine's own guard.
        raise ValueError("an encoder embedding model cannot generate text")

    def abort(self, request_id: str) -> None:
        pass  # it never holds a request

    def step(self) -> list:
        return []

    def stats(self) -> CoreStats:
        return CoreStats()

    def on_idle(self) -> None:
        pass

    def close(self) -> None:
        pass

    def clear_cache(self) -> int:
        return 0  # no cache: nothing cleared

    def adapters(self) -> dict:
        return {}

    def status(self) -> dict:
        return {"kind": "encoder", "pooling": self.model.pooling, "num_running": 0, "num_waiting": 0,
                "prefix_cache": {"enabled": False}}


def make_encoder_engine(model: Any, config: Any):
    """An `AsyncEngine` (not started) whose thread owns `model` (an EncoderModel)."""
    return AsyncEngine(lambda: Assembled(EncoderCore(model, config)), max_num_waiting=config.max_num_waiting)

"""Cross-encoder scoring on an encoder's engine thread: (query, document) pairs in batches of similar
length, one batch per `advance`, so a large rerank never holds the thread for long.

Pairs run right-padded with an attention mask (masked keys get -1e4 before the softmax: exactly zero
weight in float32), and the head reads position 0, so padding changes no score.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxhost.engine.embeddings import plan_batches


def is_cross_encoder(core: Any) -> bool:
    """Whether an engine core's model scores pairs (models/cross_encoder.py); runs on the engine thread."""
    return bool(getattr(getattr(core, "model", None), "is_cross_encoder", False))


def relevance(logits: mx.array, activation: str) -> mx.array:
    """[B, labels] logits -> [B] scores."""
    logits = logits.astype(mx.float32)
    if activation == "softmax":
        return mx.softmax(logits, axis=-1)[:, -1]
    if activation == "sigmoid":
        return mx.sigmoid(logits[:, 0])
    return logits[:, 0]


class CrossEncoderJob:
    """Scores `pairs` (token ids, token type ids) batch by batch; `result` holds them in input order."""

    def __init__(self, pairs: list[tuple[list[int], list[int]]], max_batch_tokens: int = 4096) -> None:
        self.pairs = pairs
        self.plan = plan_batches([len(ids) for ids, _ in pairs], max_batch_tokens)
        self.parts: list[mx.array] = []
        self.result: np.ndarray | None = None  # [pairs] float32, set by the last advance

    def advance(self, core: Any) -> bool:
        """Scores the next batch on the engine thread; True once `result` is ready."""
        model = core.model
        rows = [self.pairs[i] for i in self.plan[len(self.parts)]]
        width = max(len(ids) for ids, _ in rows)
        pad = width - np.array([len(ids) for ids, _ in rows])
        tokens = mx.array([ids + [model.pad_token_id] * p for (ids, _), p in zip(rows, pad)])
        # RoBERTa has one token type: its pairs are told apart by separators alone.
        types = mx.array([(t if model.kind == "bert" else [0] * len(t)) + [0] * p for (_, t), p in zip(rows, pad)])
        mask = mx.array([[1] * len(ids) + [0] * p for (ids, _), p in zip(rows, pad)])
        scores = relevance(model.scorer(tokens, types, mask), model.activation)
        mx.eval(scores)
        self.parts.append(scores)
        if len(self.parts) < len(self.plan):
            return False
        order = np.argsort([i for indices in self.plan for i in indices])
        self.result = np.array(mx.concatenate(self.parts))[order]
        self.parts = []
        return True

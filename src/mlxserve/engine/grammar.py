"""The runner's side of constrained decoding: one grammar compiler per model, built on first use, and
the per-step work on the constrained rows of a batch (advance each grammar, mask the logits).

The grammar engine itself (llguidance) lives in `structured/`; this module only schedules it around
the decode step and keeps the numbers `/v1/status` reports.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx


class GrammarSource:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._compiler = None
        self._bitmask = None
        self.num_mask_steps = 0
        self.mask_seconds = 0.0  # CPU time filling masks (overlapping the device's forward)

    @property
    def compiler(self):
        # Built on the first constrained request: it scans the vocabulary (~1 s for 150k tokens),
        # which a server that never sees a grammar should not pay at start-up.
        if self._compiler is None:
            from mlxserve.structured.matcher import GrammarCompiler

            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos_token_ids or None)
        return self._compiler

    def advance(self, rows: list[tuple[int, Any]], fed_ids: list[int]) -> set[int]:
        """Feeds each constrained row the token it is fed this step; returns the rows whose grammar
        rejected it (cannot happen for tokens sampled under its own mask, but a bug must fail one
        request, not the batch). An end-of-sequence token ends the request: nothing to advance."""
        rejected = set()
        for i, matcher in rows:
            token = fed_ids[i]
            if token in self._eos_token_ids:
                continue
            if not matcher.consume(token):
                rejected.add(i)
        return rejected

    def mask(self, logits: mx.array, rows: list[tuple[int, Any]]) -> mx.array:
        """`logits` [B, V] with every disallowed token of the listed rows at -inf."""
        if not rows:
            return logits
        from mlxserve.structured.matcher import allocate_bitmask, apply_bitmask

        start = time.perf_counter()
        compiler = self.compiler
        batch = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < batch:
            self._bitmask = allocate_bitmask(max(batch, 8), compiler.vocab_size)
        bitmask = self._bitmask[:batch]
        compiler.fill_masks(bitmask, [(matcher, i) for i, matcher in rows])
        self.mask_seconds += time.perf_counter() - start
        self.num_mask_steps += 1
        return apply_bitmask(logits, bitmask, [i for i, _ in rows])

    def stats(self) -> dict:
        return {
            "num_mask_steps": self.num_mask_steps,
            "mask_ms_per_step": 1000 * self.mask_seconds / self.num_mask_steps if self.num_mask_steps else 0.0,
        }

"""The runner's side of constrained decoding: one grammar compiler per model, built on first use, and
the per-step work on the constrained rows of a batch (advance each grammar, mask the logits; under
speculation, check each row's draft and mask every position it is verified at).

The grammar engine itself (llguidance) lives in `structured/`; this module only schedules it around
the decode step and keeps the numbers `/v1/status` reports.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from mlxhost.structured.grammar import GrammarFailure


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
            from mlxhost.structured.matcher import GrammarCompiler  # lazy: pulls in transformers

            self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos_token_ids or None)
        return self._compiler

    def advance(self, rows: list[tuple[int, Any]], fed_ids: list[int]) -> dict[int, GrammarFailure]:
        """Feeds each constrained row the token it is fed this step; returns the rows whose grammar
        could not go on, with why (the request fails with that message; the rest of the batch goes on).
        A token sampled under the row's own mask is normally accepted; a refusal, or a grammar that
        failed while computing its mask (only EOS was left), is a dead end of that grammar."""
        failed = {}
        for i, matcher in rows:
            if not self.feed(matcher, fed_ids[i]):
                failed[i] = grammar_failure(matcher, fed_ids[i])
        return failed

    def feed(self, matcher: Any, token: int) -> bool:
        """One token into one grammar; False: it could not go on. EOS is not fed: it ends the request,
        unless the grammar had failed (then EOS was all its mask allowed, not the model's choice)."""
        if token in self._eos_token_ids:
            return not matcher.error
        return matcher.consume(token)

    def mask_drafts(self, logits: mx.array, rows: list[tuple[int, Any, list[int]]]) -> tuple[mx.array, list[int]]:
        """Speculative steps: `logits` [B, K+1, V]; `rows` (batch row, its matcher just past the fed token,
        its draft). Position j of a row is masked to what its grammar allows after the first j draft
        tokens; a draft is cut at the first token its grammar rejects (a token past the grammar's stop
        among them: only EOS is allowed there). Returns the masked logits and each row's kept draft
        length; every matcher is rolled back to where it was."""
        if not rows:
            return logits, []
        from mlxhost.structured.matcher import allocate_bitmask, apply_bitmask  # lazy: pulls in transformers

        start = time.perf_counter()
        batch, width, vocab = logits.shape
        bitmask = allocate_bitmask(batch * width, self.compiler.vocab_size)
        kept, masked = [], []
        for i, matcher, draft in rows:
            base = i * width
            matcher.fill_mask(bitmask, base)
            num_consumed = n = 0
            for token in draft:
                row = bitmask[base + n]
                # Checked against the mask first: a token the matcher rejects leaves it failed for good.
                if token >> 5 >= row.shape[0] or not (int(row[token >> 5]) >> (token & 31)) & 1:
                    break
                if token in self._eos_token_ids:
                    bitmask[base + n + 1] = row  # EOS is not fed (`feed`): the grammar stays where it was
                elif matcher.consume(token):
                    num_consumed += 1
                    matcher.fill_mask(bitmask, base + n + 1)
                else:
                    break
                n += 1
            if num_consumed:
                matcher.rollback(num_consumed)
            kept.append(n)
            masked.extend(range(base, base + n + 1))
        self.mask_seconds += time.perf_counter() - start
        self.num_mask_steps += 1
        flat = apply_bitmask(logits.reshape(batch * width, vocab), bitmask, masked)
        return flat.reshape(batch, width, vocab), kept

    def mask(self, logits: mx.array, rows: list[tuple[int, Any]]) -> mx.array:
        """`logits` [B, V] with every disallowed token of the listed rows at -inf."""
        if not rows:
            return logits
        from mlxhost.structured.matcher import allocate_bitmask, apply_bitmask  # lazy: pulls in transformers

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


def grammar_failure(matcher: Any, token: int) -> GrammarFailure:
    """What the client reads when its request's grammar stops: the grammar's kind and llguidance's
    first line (the rest is a parser state dump for developers)."""
    detail = (matcher.error or "").strip().splitlines()
    why = detail[0] if detail else f"token {token} was refused"
    return GrammarFailure(f"the {matcher.kind} grammar could not continue: {why}")

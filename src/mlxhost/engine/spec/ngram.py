"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the sequence's tail.

No model: a request that echoes its prompt (code edits, RAG answers quoting the context, JSON that
repeats keys) finds its next tokens already in its own history. The index is plain Python; only the
proposer's one array per step is MLX.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxhost.engine.request import Request
from mlxhost.engine.spec.proposer import DraftStep, Proposer

# Longest tail tried first: a longer match is a better predictor of what follows.
MAX_NGRAM = 4
MIN_NGRAM = 2


class NgramIndex:
    """One sequence's history and, for every n-gram in it (MIN_NGRAM..MAX_NGRAM), the latest position
    it ended at among those whose next token is known. Built incrementally: O(new tokens) per step."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0  # n-grams ending before this position are in the map

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        # An n-gram ending at position e is indexed once token e + 1 exists (it has a continuation).
        toks, index = self.tokens, self._last_end
        for end in range(self._num_indexed, len(toks) - 1):
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end + 1 < n:
                    break
                index[tuple(toks[end + 1 - n : end + 1])] = end
        self._num_indexed = max(self._num_indexed, len(toks) - 1)

    def propose(self, k: int) -> list[int]:
        """`k` tokens that followed the latest earlier match of the longest tail n-gram (none without one)."""
        toks = self.tokens
        if k <= 0:
            return []
        for n in range(min(MAX_NGRAM, len(toks)), MIN_NGRAM - 1, -1):
            end = self._last_end.get(tuple(toks[len(toks) - n :]))
            if end is not None:
                # Past the end of the history the match continues into the draft itself: a loop of
                # period len - end - 1 (a repeated line, a run of one token) drafts k tokens, not one period.
                out = toks[end + 1 : end + 1 + k]
                while len(out) < k:
                    out.append(out[len(out) - (len(toks) - end - 1)])
                return out
        return []


class NgramProposer(Proposer):
    """Prompt lookup: each row drafts from its own history (its `RowState.proposal`: an `NgramIndex`)."""

    name = "ngram"

    def __init__(self, config: Any = None, vocab_width: int = 0) -> None:
        pass

    def describe(self) -> str:
        return "n-gram prompt lookup"

    def prepare(self, row: Any, request: Request) -> None:
        index = row.proposal
        known = len(index.tokens) - request.num_prompt_tokens if index is not None else -1
        if known < 0 or known > request.num_output_tokens:
            index = row.proposal = NgramIndex()
            index.extend(request.prompt_token_ids)
            known = 0
        index.extend(request.output_token_ids[known:])

    def can_draft(self, step: DraftStep) -> bool:
        # Judged without the token each row feeds next, which is still being computed.
        return any(step.rows[i].proposal.propose(1) for i in step.budget)

    def propose(self, step: DraftStep):
        last = step.batch.tokens
        last_ids = last.tolist()  # the drafts continue from the token each row feeds
        lengths = [0] * len(step.rids)
        drafts: dict[int, list[int]] = {}
        for i, k in step.budget.items():
            index = step.rows[i].proposal
            index.extend([last_ids[i]])
            drafts[i] = index.propose(k)
            lengths[i] = len(drafts[i])
        num_k = max(lengths)
        if num_k == 0:
            return None
        fed = mx.array([[t, *drafts.get(i, ()), *[0] * (num_k - len(drafts.get(i, ())))]
                        for i, t in enumerate(last_ids)], dtype=last.dtype)
        return fed, lengths

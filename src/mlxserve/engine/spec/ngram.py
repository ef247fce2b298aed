"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the sequence's tail.

No model: a request that echoes its prompt (code edits, RAG answers quoting the context, JSON that
repeats keys) finds its next tokens already in its own history. Plain Python, no tensor library.
"""

from __future__ import annotations

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

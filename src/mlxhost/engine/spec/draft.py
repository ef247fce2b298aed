"""The draft model of speculative decoding: its batch cache beside the target's, row for row.

The draft's cache of a row stops one token short of the row's last emitted token: each speculative
step feeds that token and the pending one together (`_propose`). Steps that decode without it (a
batch over --spec-max-batch, or no row drafting) leave it behind; the next speculative step feeds it
what it missed first (`_catch_up`). A row's `RowState.proposal` is how many of its tokens the draft's
cache holds.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxhost.engine.request import Request
from mlxhost.engine.spec.proposer import DraftStep, Proposer
from mlxhost.engine.spec.setup import rewindable
from mlxhost.engine.spec.verify import rewind
from mlxhost.models.loader import load_model

_PREFILL_STEP = 512


class DraftProposer(Proposer):
    name = "draft"
    keeps_cache = True

    def __init__(self, config: Any, vocab_width: int = 0) -> None:
        model = load_model(config.draft_model).model
        if getattr(model, "is_vlm", False) or not rewindable(model):
            raise ValueError(f"draft model {config.draft_model}: needs a text model with plain KV caches")
        self.model = model
        self.vocab_width = vocab_width
        self.source = str(config.draft_model)

    def describe(self) -> str:
        return f"draft model {self.source}"

    def join(self, row: Any, request: Request) -> list[Any]:
        """The draft's cache over the prompt but its last token (it has no prefix cache of its own)."""
        prompt = request.prompt_token_ids
        cache = make_prompt_cache(self.model)
        for start in range(0, len(prompt) - 1, _PREFILL_STEP):
            self.model(mx.array(prompt[start : min(start + _PREFILL_STEP, len(prompt) - 1)])[None], cache=cache)
            mx.eval([c.state for c in cache])
        row.proposal = len(prompt) - 1
        return cache

    def propose(self, step: DraftStep):
        batch, rids, requests = step.batch, step.rids, step.requests
        lengths = [step.budget.get(i, 0) for i in range(len(rids))]
        self._catch_up(step)
        last = batch.tokens
        prev = [last_emitted(requests[rid]) if rid is not None else 0 for rid in rids]
        return self._propose(mx.array(prev, dtype=last.dtype), last, max(lengths), batch.draft_cache), lengths

    def accept(self, step: DraftStep, num_accepted: list[int], num_drop: list[int]) -> None:
        """The row emitted its fed token and `num_accepted` drafts, and the draft's cache keeps all of them
        but the last (called before the scheduler appends the step's tokens)."""
        rewind(step.batch.draft_cache, num_drop)
        for i, rid in enumerate(step.rids):
            if rid is not None:
                step.rows[i].proposal = step.requests[rid].num_tokens + num_accepted[i]

    def _catch_up(self, step: DraftStep) -> None:
        """Feeds the draft the tokens that steps without it emitted. Rows with less to feed are padded
        to the longest and the padding rewound, as a rejected draft is."""
        cache, requests = step.batch.draft_cache, step.requests
        todo = [_tokens(requests[rid], row.proposal, requests[rid].num_tokens - 1) if rid is not None else []
                for rid, row in zip(step.rids, step.rows)]
        while any(todo):
            width = min(_PREFILL_STEP, _bucket(max(map(len, todo))))
            chunk = [t[:width] for t in todo]
            self.model(mx.array([c + [0] * (width - len(c)) for c in chunk]), cache=cache)
            rewind(cache, [width - len(c) for c in chunk])
            todo = [t[width:] for t in todo]
            if any(todo):
                mx.eval([c.state for c in cache])  # bound the lazy graph, as a prefill does between chunks

    def _propose(self, prev: mx.array, last: mx.array, num_k: int, cache: list[Any]) -> mx.array:
        """The draft's greedy continuation [B, 1 + K] of `last`, in K forwards: the first feeds the
        row's last emitted token `prev` and `last` together, the others d1 .. d(K-1). Its cache thus
        grows by K + 1 positions, like the target's, and keeps `accepted + 1` of them (everything up to
        the row's new last emitted token, which the next step feeds again): the same rewind."""
        tokens, x = [last], mx.stack([prev, last], axis=1)
        for _ in range(num_k):
            logits = self.model(x, cache=cache)
            nxt = mx.argmax(logits[:, -1, : self.vocab_width or None], axis=-1).astype(last.dtype)
            tokens.append(nxt)
            x = nxt[:, None]
        return mx.stack(tokens, axis=1)


def _bucket(n: int) -> int:
    """Catch-up widths rounded up to powers of two (at least 8): MLX-CUDA compiles kernels for every new
    shape, and a catch-up of each odd length stalled the draft for a compile (docs/BENCHMARKS.md)."""
    return max(8, 1 << (n - 1).bit_length())


def last_emitted(request: Request) -> int:
    return request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[-1]


def _tokens(request: Request, start: int, stop: int) -> list[int]:
    """Tokens [start, stop) of the request's prompt followed by its output."""
    p = request.num_prompt_tokens
    if start >= p:
        return request.output_token_ids[start - p : stop - p]
    return request.prompt_token_ids[start:stop] + request.output_token_ids[: max(0, stop - p)]

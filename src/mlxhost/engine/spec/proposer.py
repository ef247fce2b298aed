"""What a draft proposer is: the part of speculative decoding that says which tokens each row tries.

The decoder (decoder.py) plans the step: which rows draft and how far (`DraftLength`); the runner's one
decode step runs the verification forward, acceptance, the target's rewind and logprobs. A proposer only
proposes, and keeps its per-row state on the runner's row state (`RowState.proposal`), so a finished
request's state goes with the rest of it. Drafts are point masses (copied tokens, a model's argmax): the
verification (runner/sampling.py `verify_group`) keeps sampled rows' distribution exact for any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxhost.engine.request import Request


@dataclass
class DraftStep:
    """What a proposer sees of one speculative step."""

    batch: Any  # the runner's DecodeBatch: `tokens` (each row's token to feed, lazy), `draft_cache`
    rids: list[str | None]  # its rows (None: a filler)
    rows: list[Any]  # their RowState, row for row (None: a filler)
    requests: dict[str, Request]
    budget: dict[int, int]  # row index -> the most drafts it may propose (rows missing: none)
    clock: int = 0  # the decoder's step count (plain steps included)
    # Set after the verification forward, for `accept` (all lazy): the fed [B, 1 + K], each
    # row's next token [B], the target's hidden states [B, 1 + K, ...] (proposers that want them).
    fed: Any = None
    next_tokens: Any = None
    hidden: Any = None
    drafted: int = 0  # the proposer's own note: positions its caches grew by while drafting


class Proposer:
    name = ""  # what `GET /v1/status` reports as the speculative mode
    # A proposer with a model of its own: its caches join the decode batch beside the target's
    # (`join`), and the memory budget counts `model`'s weights and KV.
    keeps_cache = False
    model: Any = None
    # A proposer fed the target's hidden states (spec/hidden.py): `bind` sets `tap`, the decode step's forwards
    # go through it, and plain steps call `observe`.
    wants_hidden = False
    tap: Any = None

    def bind(self, target: Any) -> str | None:
        """The target model, once at start-up; returns why this proposer cannot serve it (None: it can)."""
        return None

    def describe(self) -> str:
        """For the start-up log line."""
        return f"proposer {self.name!r}"

    def held(self) -> Any:
        """The module a head or drafter holds beside the target, once bound (its weights and its `layers`' KV
        are in the memory budget); None: nothing of its own, or `model` (a draft model) says it."""
        return None

    def join(self, row: Any, request: Request) -> list[Any] | None:
        """A prompt joins the decode batch (`keeps_cache` only): its caches, row for row beside the target's."""
        return None

    def prepare(self, row: Any, request: Request) -> None:
        """Before a step that may speculate: bring the row's state up to the request's known tokens."""

    def can_draft(self, step: DraftStep) -> bool:
        """Whether any row may draft, judged before the tokens to feed are read back (False: the step
        decodes plainly, pipelined)."""
        return True

    def propose(self, step: DraftStep) -> tuple[Any, list[int]] | None:
        """The verification forward's input [B, 1 + K] (each row's token to feed, then its drafts, padded
        to the longest) and each row's number of drafts; None: nothing to verify this step."""
        raise NotImplementedError

    def accept(self, step: DraftStep, num_accepted: list[int], num_drop: list[int]) -> None:
        """After verification: row i kept `num_accepted[i]` drafts and the target's KV dropped
        `num_drop[i]` positions (rewind caches of its own alike)."""

    def observe(self, step: DraftStep, hidden: Any, next_tokens: Any) -> list[Any]:
        """A plain decode step (`wants_hidden` only): the fed tokens' hidden states [B, 1, ...] and the
        tokens sampled after them [B]. Returns arrays to launch with the step's."""
        return []

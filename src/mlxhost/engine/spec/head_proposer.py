"""EAGLE-3 and MTP proposers: a head (heads.py) drafts each row's tokens from the target's hidden states.

Every row keeps the head's KV and its `Seed`: the head's last hidden state `g`, whose logits are the
row's next first draft. Both ride in the decode batch's `draft_cache`, row for row beside the target's
caches, so batch joins, fillers and drops move them with the row.

Each forward of the target that the head sees feeds it one pair per emitted token: (the target's
hidden at position t, token t + 1). A plain step's forward gives the fed token's hidden and the next
token (`observe`); a speculative one gives K + 1 hiddens, of which the row keeps `accepted + 1`
(`accept`): the pairs are fed for all K + 1 positions and the head's KV is rewound by what the target
dropped, the same per-row rewind. Drafting (`propose`) starts from the seed and feeds `g` back K - 1
times; those positions are trimmed off again before the verified pairs go in.

A row that joined, or missed steps (a batch over --spec-max-batch, or one whose rows are all paused,
decodes without the head: decoder.py), has no seed for its current position: it drafts nothing until a forward the head saw gives it one (the next
step). Positions the head missed (a prefix-cached or prefilled prompt, skipped steps) are absent from
its KV; drafts may then be worse, never wrong: the target verifies every one.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx

from mlxhost.engine.request import Request
from mlxhost.engine.spec.heads import load_head
from mlxhost.engine.spec.hidden import HiddenTap, why_no_tap
from mlxhost.engine.spec.proposer import DraftStep, Proposer
from mlxhost.engine.spec.verify import rewind

log = logging.getLogger(__name__)


class Seed:
    """The rows' last head outputs [B, 1, D], kept in the batch's `draft_cache` so they follow the rows
    (mlx-lm's batch-cache interface: `merge`, `extend`, `filter`, and rewinds that leave it alone). A row
    that joins brings zeros; `RowState.proposal` says whether a row's seed is current."""

    def __init__(self, g: mx.array) -> None:
        self.g = g

    @property
    def state(self):
        return (self.g,)

    @classmethod
    def merge(cls, seeds: list[Seed]) -> Seed:
        return cls(mx.concatenate([s.g for s in seeds]))

    def extend(self, other: Seed) -> None:
        self.g = mx.concatenate([self.g, other.g])

    def filter(self, index: mx.array) -> None:
        self.g = self.g[index]

    def trim(self, n: int) -> int:
        return n

    def prepare(self, **kw) -> None:
        pass

    def finalize(self) -> None:
        pass


class HeadProposer(Proposer):
    """A head's drafts; `kind` names the head (heads.HEADS) and the registry entry."""

    kind = ""
    keeps_cache = True
    wants_hidden = True

    def __init__(self, config: Any, vocab_width: int = 0) -> None:
        self.name = self.kind
        self.source = config.draft_model
        self.head = None
        self.tap = None

    def bind(self, target: Any) -> str | None:
        if not self.source:
            return f"--speculative {self.kind} needs the head's folder (--speculative-model PATH)"
        why = why_no_tap(target, ())  # the family first: a head's layers are built from the target's
        if why is not None:
            return why
        self.head = load_head(self.source, target, self.kind)
        why = why_no_tap(target, self.head.layer_ids)
        if why is not None:
            return why
        self.tap = HiddenTap(target, self.head.layer_ids)
        return None

    def held(self) -> Any:
        return self.head.module if self.head is not None else None

    def describe(self) -> str:
        return f"{self.kind} head {self.source}"

    # -- per-row state ---------------------------------------------------------------------------
    def join(self, row: Any, request: Request) -> list[Any]:
        row.proposal = -1  # no seed yet (a step number no step has)
        return [*self.head.make_cache(), Seed(mx.zeros((1, 1, self.head.width), self.head.dtype))]

    def can_draft(self, step: DraftStep) -> bool:
        return any(_seeded(step, i) for i in step.budget)

    def propose(self, step: DraftStep):
        lengths = [step.budget.get(i, 0) if _seeded(step, i) else 0 for i in range(len(step.rids))]
        num_k = max(lengths)
        if num_k == 0:
            return None
        cache, last = step.batch.draft_cache, step.batch.tokens
        *kv, seed = cache
        g = seed.g
        tok = self.head.draft(g)  # [B, 1]
        drafts = [tok]
        for _ in range(num_k - 1):
            g = self.head.forward(tok, g, kv, from_target=False)
            tok = self.head.draft(g)
            drafts.append(tok)
        step.drafted = num_k - 1  # head positions appended while drafting, trimmed in `accept`
        return mx.concatenate([last[:, None].astype(mx.int32), *drafts], axis=1).astype(last.dtype), lengths

    def accept(self, step: DraftStep, num_accepted: list[int], num_drop: list[int]) -> None:
        """The verified pairs: (hidden j, token j + 1) for j = 0..K, where token j + 1 is draft j + 1 up to
        the accepted count and the target's next token there; the head's KV keeps `accepted + 1` of them."""
        *kv, seed = step.batch.draft_cache
        if step.drafted:
            for c in kv:
                c.trim(step.drafted)
        k = step.hidden.shape[1] - 1
        accepted = mx.array(num_accepted)
        at = mx.arange(k + 1)[None, :] == accepted[:, None]
        tokens = mx.where(at, step.next_tokens[:, None], mx.pad(step.fed[:, 1:], [(0, 0), (0, 1)]))
        g = self.head.forward(tokens.astype(mx.int32), step.hidden, kv, from_target=True)
        rewind(kv, num_drop)
        seed.g = mx.take_along_axis(g, accepted[:, None, None], axis=1)
        _seed_rows(step)

    def observe(self, step: DraftStep, hidden: mx.array, next_tokens: mx.array) -> list[mx.array]:
        """A plain step: the fed token's hidden and the token sampled after it, one pair per row."""
        *kv, seed = step.batch.draft_cache
        seed.g = self.head.forward(next_tokens[:, None].astype(mx.int32), hidden, kv, from_target=True)
        _seed_rows(step)
        return [seed.g, *(a for c in kv for a in c.state if isinstance(a, mx.array))]


def _seeded(step: DraftStep, i: int) -> bool:
    """The row's seed is from the step before (the forward that gave the token it feeds now)."""
    return step.rids[i] is not None and step.rows[i].proposal == step.clock - 1


def _seed_rows(step: DraftStep) -> None:
    for i, rid in enumerate(step.rids):
        if rid is not None:
            step.rows[i].proposal = step.clock


class Eagle3Proposer(HeadProposer):
    kind = "eagle3"


class MTPProposer(HeadProposer):
    kind = "mtp"

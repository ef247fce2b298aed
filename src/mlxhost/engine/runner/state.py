"""The runner's one table of per-request state: what it keeps for a request between steps.

A request gets its `RowState` at its first prefill chunk and loses all of it in one place, the
runner's `_free` (finished, aborted or failed alike). Sampling, grammar, logprobs, multimodal,
prefix-capture and speculative state all live on the row; nothing else is keyed by request id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxhost.engine.runner.sampling import RowSampler


@dataclass(eq=False)
class RowState:
    request_id: str
    # Its filters, processors, RNG key, and the grammar matcher of a constrained request.
    sampler: RowSampler
    # Its own batch-1 caches while it prefills; None once its first token is sampled (it joins the batch).
    prefill_cache: list[Any] | None = None
    # Vision-language prompts: the multimodal prefill's plan while it prefills (mm_prefill.MediaPlan), and
    # the rope delta its decode positions carry after the images.
    media: Any = None
    position_delta: int = 0
    # Requests that asked for logprobs: lazy (chosen logprob, top ids, top logprobs) of the next token to
    # feed, read back when that token is emitted.
    pending_logprob: tuple | None = None
    # Requests that asked for their prompt's logprobs: each prefill forward's (chosen, top ids, top logprobs).
    prompt_scores: list[tuple] | None = None
    # Prefix data only a prefill can give (capture.py), kept until its blocks are stored: roles' parts by
    # (role, block start) (sliding-window KV), the boundary the prefill stops at for a snapshot (recurrent
    # state), and that snapshot (role -> its part).
    captured: dict[tuple[str, int], Any] | None = None
    snap_at: int | None = None
    prefill_snap: tuple[int, dict[str, Any]] | None = None
    # Speculative decoding (spec/): the row's adaptive draft length and its proposer's own state (an
    # n-gram index, the tokens a draft model's cache holds, ...).
    draft_length: Any = None
    proposal: Any = None


class RowTable(dict[str, RowState]):
    """Request id -> its `RowState`: a plain dict, so the per-step lookups cost what a dict's do."""

    def free(self, request_ids) -> None:
        for rid in request_ids:
            self.pop(rid, None)

"""The oracle proposer, a benchmark tool: it replays a recorded greedy continuation of the target, so every
draft of a greedy row that follows the recording is accepted, at no drafting cost. What it measures is
the ceiling of the speculative machinery itself (verification forwards, acceptance, rewinds, the
decoder's bookkeeping) against plain decoding; it is no way to serve anything.

`--speculative oracle --speculative-model RECORDING.json`, where the recording (`save_recording`) maps
each prompt's token ids to the tokens plain greedy decoding gave it; `mlxhost bench speculative --drafts
oracle` records one in its plain run and replays it. A prompt missing from the recording drafts nothing.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import mlx.core as mx

from mlxhost.engine.request import Request
from mlxhost.engine.spec.proposer import DraftStep, Proposer

FORMAT = "mlxhost-oracle-recording/1"


def save_recording(path: str | pathlib.Path, continuations: dict[tuple[int, ...], list[int]]) -> pathlib.Path:
    """Writes prompt -> greedy continuation (token ids) as JSON."""
    path = pathlib.Path(path)
    records = [{"prompt": list(p), "tokens": list(t)} for p, t in continuations.items()]
    path.write_text(json.dumps({"format": FORMAT, "records": records}))
    return path


def load_recording(path: str | pathlib.Path) -> dict[tuple[int, ...], list[int]]:
    data = json.loads(pathlib.Path(path).read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: not an oracle recording (format {FORMAT!r})")
    return {tuple(r["prompt"]): list(r["tokens"]) for r in data["records"]}


class OracleProposer(Proposer):
    name = "oracle"

    def __init__(self, config: Any, vocab_width: int = 0) -> None:
        if not config.draft_model:
            raise ValueError("--speculative oracle needs a recording (--speculative-model RECORDING.json)")
        self.source = str(config.draft_model)
        self.recording = load_recording(self.source)

    def describe(self) -> str:
        return f"oracle replay of {self.source} ({len(self.recording)} prompts; a benchmark tool)"

    def prepare(self, row: Any, request: Request) -> None:
        if row.proposal is None:  # () once looked up and absent
            row.proposal = self.recording.get(tuple(request.prompt_token_ids), ())

    def _drafts(self, step: DraftStep, i: int, k: int) -> list[int]:
        # The token the row feeds now is its output token n: the drafts are the recording's n+1 ...
        n = step.requests[step.rids[i]].num_output_tokens
        return step.rows[i].proposal[n + 1 : n + 1 + k]

    def can_draft(self, step: DraftStep) -> bool:
        return any(self._drafts(step, i, 1) for i in step.budget)

    def propose(self, step: DraftStep):
        drafts = {i: self._drafts(step, i, k) for i, k in step.budget.items()}
        lengths = [len(drafts.get(i, ())) for i in range(len(step.rids))]
        num_k = max(lengths)
        if num_k == 0:
            return None
        last = step.batch.tokens
        rows = [list(drafts.get(i, ())) + [0] * (num_k - lengths[i]) for i in range(len(step.rids))]
        return mx.concatenate([last[:, None], mx.array(rows, dtype=last.dtype)], axis=1), lengths

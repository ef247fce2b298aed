"""The one registry of draft proposers: `--speculative NAME` picks one. Plain Python, no MLX, so
`mlxhost serve` can check a name without loading anything.

A proposer is a `spec.proposer.Proposer` made by `factory(config, vocab_width)`; built-in ones are
named here by import path and loaded only when used. A new one is one line below (or, outside the
package, one `register_proposer` call before the engine is built).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

PROPOSERS: dict[str, str | Callable[[Any, int], Any]] = {
    "ngram": "mlxhost.engine.spec.ngram:NgramProposer",  # prompt lookup in the request's own tokens
    "draft": "mlxhost.engine.spec.draft:DraftProposer",  # a small model with the same tokenizer
    "eagle3": "mlxhost.engine.spec.head_proposer:Eagle3Proposer",  # a head fed three target layers' outputs
    "mtp": "mlxhost.engine.spec.head_proposer:MTPProposer",  # multi-token-prediction layers on the last hidden
    "dflash": "mlxhost.engine.spec.dflash:DFlashProposer",  # a block-diffusion drafter: a whole draft per forward
    "oracle": "mlxhost.engine.spec.oracle:OracleProposer",  # benchmarks only: replays a recorded greedy output
}


def register_proposer(name: str, factory: Callable[[Any, int], Any]) -> None:
    PROPOSERS[name] = factory


def proposer_names() -> tuple[str, ...]:
    return tuple(PROPOSERS)


def make_proposer(name: str, config: Any, vocab_width: int) -> Any:
    factory = PROPOSERS.get(name)
    if factory is None:
        raise ValueError(f"no speculative proposer {name!r}; known: {', '.join(PROPOSERS)}")
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(config, vocab_width)

"""Whether speculative decoding can run for a model, and the decoder (with its registered proposer) if so."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlxhost.config import EngineConfig
from mlxhost.engine.spec.decoder import SpeculativeDecoder
from mlxhost.engine.spec.heads import head_kind
from mlxhost.engine.spec.registry import make_proposer
from mlxhost.kv.kinds import KINDS
from mlxhost.kv.kinds.probe import probe_kv

log = logging.getLogger(__name__)


def rewindable(model: Any) -> bool:
    """Plain KV in every layer (MLA's wider keys included): a rejected draft can be cut off the end.
    Rotating windows have overwritten what the draft displaced, recurrent state keeps no history."""
    return KINDS.can_rewind(make_prompt_cache(model))


def reserve_proposer(budget: Any, proposer: Any, target: Any, per_token: int) -> tuple[Any, int]:
    """The memory budget with the proposer's own weights moved from KV to weights, and the KV bytes per running
    token with its caches added (they hold every running token beside the target's). A draft model's KV is
    measured; a head's or drafter's layers (`Proposer.held`) are counted at one target layer's bytes per token
    each, as they take the target's attention shapes. Arrays shared with the target (a bound embedding or
    LM head) are the target's weights already."""
    if proposer.model is not None:
        module, extra = proposer.model, probe_kv(proposer.model).budget_bytes_per_token
    else:
        module = proposer.held()
        if module is None:
            return budget, per_token
        num_target_layers = max(len(getattr(target, "layers", ())), 1)
        extra = per_token // num_target_layers * len(getattr(module, "layers", ()))
    per_token += extra
    if budget is None:
        return None, per_token
    shared = {id(v) for _, v in tree_flatten(target.parameters())}
    own = sum(v.nbytes for _, v in tree_flatten(module.parameters()) if id(v) not in shared)
    weights = min(own, budget.kv)
    return dataclasses.replace(budget, weights=budget.weights + weights, kv=budget.kv - weights), per_token


def auto_proposer(config: EngineConfig) -> str:
    """`--speculative auto`'s proposer: the head or draft model `draft_model` holds, else prompt lookup."""
    if config.draft_model:
        return head_kind(config.draft_model) or "draft"
    return "ngram"


def make_speculative(model: Any, config: EngineConfig, vocab_width: int) -> SpeculativeDecoder | None:
    if config.speculative == "off":
        return None
    auto = config.speculative == "auto"
    name = auto_proposer(config) if auto else config.speculative
    if not rewindable(model):
        kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)})
        log.warning("speculative decoding is off: this model's caches (%s) cannot be rewound past a rejected "
                    "draft (sliding-window and recurrent layers)", ", ".join(kinds))
        return None
    proposer = make_proposer(name, config, vocab_width)
    why = proposer.bind(model)
    if why is not None:
        log.warning("speculative decoding is off: the %s proposer cannot serve this model: %s", proposer.name, why)
        return None
    log.info("speculative decoding: %s, up to %d draft tokens per row and step, while at most %d requests decode%s",
             proposer.describe(), config.num_draft_tokens, config.spec_max_batch,
             " and measured acceptance covers the measured cost (auto)" if auto else "")
    return SpeculativeDecoder(config.num_draft_tokens, proposer, config.spec_max_batch, auto=auto)

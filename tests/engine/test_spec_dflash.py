"""DFlash drafting inside the decode batch: the drafter's block forward is mlx-vlm's own (alone and for
left-padded batch rows), greedy rows emit exactly what plain decoding emits whatever it drafts, drafts
that are partly right are accepted up to the first wrong token, and acceptance is reported per kind.
The mixed batch of 8 under dflash is in test_spec_mixed.py."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.spec.dflash import DFlashProposer, load_drafter
from mlxhost.engine.spec.heads import head_kind
from mlxhost.engine.spec.registry import PROPOSERS, register_proposer
from mlxhost.models.loader import load_model
from tests.engine.test_speculative import copy, echo_prompt, greedy, run


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


@pytest.fixture(scope="module")
def drafter_dir(qwen3_model_dir, tmp_path_factory) -> str:
    from mlxhost.testing.spec_heads import build_dflash_folder

    return str(build_dflash_folder(tmp_path_factory.mktemp("dflash") / "d", qwen3_model_dir))


def make_core(loaded, **kw) -> EngineCore:
    config = EngineConfig(**{"max_num_seqs": 8, "block_size": 16, "cache_memory_bytes": 32 << 20,
                             "spec_max_batch": 8, **kw})
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="dflash")


def test_block_logits_are_mlx_vlms_forward_alone_and_in_a_padded_batch(loaded, drafter_dir):
    drafter = load_drafter(drafter_dir, loaded.model)
    width = len(drafter.layer_ids) * loaded.model.args.hidden_size
    mx.random.seed(0)
    contexts = [mx.random.normal((1, n, width)) for n in (6, 3)]
    anchors, mask_id = [5, 9], int(drafter.config.mask_token_id)
    want = [drafter.module(mx.array([[a] + [mask_id] * 3]), ctx, [KVCache()])[:, 1:]
            for a, ctx in zip(anchors, contexts)]
    alone = []
    for a, ctx in zip(anchors, contexts):
        cache = drafter.make_cache()
        drafter.add_context(ctx, cache)
        alone.append(drafter.block_logits(mx.array([a]), 3, cache))
        assert cache[0].offset == ctx.shape[1]  # the block's own keys are not kept
    for got, ref in zip(alone, want):
        assert mx.allclose(got, ref, atol=1e-5)
    # Two rows with contexts of different lengths in one left-padded batch cache.
    caches = []
    for ctx in contexts:
        cache = drafter.make_cache()
        drafter.add_context(ctx, cache)
        caches.append(cache)
    batch = [BatchKVCache.merge(list(layer)) for layer in zip(*caches)]
    got = drafter.block_logits(mx.array(anchors), 3, batch)
    for i, ref in enumerate(want):
        assert mx.allclose(got[i : i + 1], ref, atol=1e-4), i


@pytest.mark.parametrize("num_rows, spec_max_batch", [(1, 8), (3, 8), (5, 2)])
def test_greedy_identity_with_a_random_drafter(loaded, drafter_dir, num_rows, spec_max_batch):
    """A lone row (mlx-lm's KVCache path), a batch, and a batch over --spec-max-batch (plain steps without
    the tap leave gaps in the drafter's context: drafts worse, never wrong)."""
    reqs = [greedy(f"r{i}", echo_prompt(i), max_tokens=30 + 5 * i) for i in range(num_rows)]
    plain = run(make_core(loaded), copy(reqs))
    core = make_core(loaded, speculative="dflash", draft_model=drafter_dir, num_draft_tokens=3,
                     spec_max_batch=spec_max_batch)
    assert core.spec is not None and core.spec.mode == "dflash"
    got = run(core, copy(reqs))
    assert {r: got[r]["ids"] for r in got} == {r: plain[r]["ids"] for r in plain}
    stats = core.spec_stats()
    assert stats["num_drafted"] > 0 and stats["acceptance_by_kind"] == {"dflash": stats["acceptance_rate"]}
    engine = core.stats()  # what /metrics labels mlxhost_spec_kind_* with
    assert engine.spec_kind == "dflash" and engine.spec_drafted_tokens == stats["num_drafted"]


class _PartlyRight(DFlashProposer):
    """The drafter runs as served (its context grows and rewinds), but each row's block is replaced by
    the row's recorded greedy continuation with its third token wrong: drafts accepted for two tokens."""

    name = "dflash_partly_right"
    recorded: dict[str, list[int]] = {}

    def propose(self, step):
        proposal = super().propose(step)
        if proposal is None:
            return None
        fed, lengths = proposal
        rows = fed.tolist()
        for i, rid in enumerate(step.rids):
            if rid is None or not lengths[i]:
                continue
            n = step.requests[rid].num_output_tokens  # `last` is output token n
            right = self.recorded[rid][n + 1 : n + 1 + lengths[i]]
            drafts = right[:2] + [(t + 1) % 2000 for t in right[2:]]
            rows[i][1 : 1 + len(drafts)] = drafts
            lengths[i] = len(drafts)
        return mx.array(rows, dtype=fed.dtype), lengths


def test_partly_right_drafts_are_accepted_up_to_the_first_wrong_token(loaded, drafter_dir):
    reqs = [greedy(f"r{i}", echo_prompt(i), max_tokens=24 + 4 * i) for i in range(3)]
    plain = run(make_core(loaded), copy(reqs))
    _PartlyRight.recorded = {r: plain[r]["ids"] for r in plain}
    register_proposer(_PartlyRight.name, _PartlyRight)
    try:
        core = make_core(loaded, speculative=_PartlyRight.name, draft_model=drafter_dir, num_draft_tokens=3)
        got = run(core, copy(reqs))
    finally:
        PROPOSERS.pop(_PartlyRight.name)
    assert {r: got[r]["ids"] for r in got} == {r: plain[r]["ids"] for r in plain}
    stats = core.spec_stats()
    assert 0 < stats["num_accepted"] < stats["num_drafted"]
    assert stats["num_row_pauses"] == 0  # two of three accepted: no row gives up drafting


def test_auto_takes_a_dflash_folder(loaded, drafter_dir):
    assert head_kind(drafter_dir) == "dflash"
    core = make_core(loaded, speculative="auto", draft_model=drafter_dir)
    assert core.spec.mode == "dflash" and core.spec.auto is not None

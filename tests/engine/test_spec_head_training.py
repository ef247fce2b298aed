"""What a draft head learns in training is what it drafts when served: the head's guess for position t + 2,
computed over a whole sequence as `train_head` does, is the first draft the proposer makes for the same
prefix in the decode batch (EAGLE-3 with a draft vocabulary of its own, and MTP). Training leaves the target's
weights alone, and a head starts as the target's own next-token guess (`start_as_target`)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.spec.heads import HEADS, load_head, save_head
from mlxhost.engine.spec.hidden import HiddenTap
from mlxhost.models.loader import load_model
from mlxhost.testing.spec_heads import (
    draft_vocab,
    greedy_sequence,
    head_config,
    set_draft_vocab,
    train_head,
)
from tests.engine.test_speculative import echo_prompt, greedy, run

KINDS = ("eagle3", "mtp")
NEW = 40


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


@pytest.fixture(scope="module")
def sequences(loaded):
    prompts = [echo_prompt(i) for i in (0, 1, 3)]
    return [greedy_sequence(loaded.model, p, NEW) for p in prompts], [len(p) for p in prompts]


def _head(loaded, kind, sequences, starts, steps, vocab=None):
    target = loaded.model
    config = head_config(kind, target, len(vocab) if vocab else None)
    mx.random.seed(0)
    head = HEADS[kind](config, target)
    if vocab:
        set_draft_vocab(head, target, vocab)
    mx.eval(head.module.parameters())
    train_head(head, target, sequences, starts, steps, lr=3e-4, skip_prompt=True, batch_size=2)
    return head, config


def _trained_guesses(head, target, seq, start) -> list[int]:
    """Training's view: the head fed pairs (hidden t, token t + 1) from the first output token on, all at once;
    entry j guesses token start + j + 2."""
    x = mx.array([seq])
    _, h = HiddenTap(target, head.layer_ids)(x, [None] * len(target.model.layers))
    g = head.forward(x[:, start + 1:], h[:, start:-1], [None] * len(head.module.layers), from_target=True)
    return head.draft(g)[0].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_training_leaves_the_target_alone(loaded, sequences, kind):
    """The EAGLE-3 head's embedding is the target's own layer: a trained one is the target's weights, which
    then no longer give the outputs the head was trained on (drafts all rejected, as measured on SmolLM2)."""
    seqs, starts = sequences
    before = {k: mx.array(v) for k, v in tree_flatten(loaded.model.parameters())}
    _head(loaded, kind, seqs, starts, 30)
    after = dict(tree_flatten(loaded.model.parameters()))
    assert [k for k, v in before.items() if not mx.array_equal(v, after[k])] == []
    assert greedy_sequence(loaded.model, seqs[0][:starts[0]], NEW) == seqs[0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_head_starts_as_the_targets_next_token(loaded, sequences, kind):
    """Before any step the head guesses token t + 1 (the target's greedy choice) from the pair it is fed."""
    seqs, starts = sequences
    target = loaded.model
    vocab = draft_vocab(seqs, starts, 256) if kind == "eagle3" else None
    head, _ = _head(loaded, kind, seqs, starts, 0, vocab)
    for seq, start in zip(seqs, starts):
        # Entry j was fed hidden start + j, whose greedy next token is seq[start + j + 1].
        assert _trained_guesses(head, target, seq, start)[:-1] == seq[start + 1:-1]


@pytest.mark.parametrize("kind", KINDS)
def test_served_first_drafts_are_what_training_computed(loaded, sequences, tmp_path, kind):
    """Every speculative step's first draft (fed `last` at position p: a guess for p + 1) is training's guess
    for the same prefix, and training fits the sequences it saw."""
    seqs, starts = sequences
    target = loaded.model
    vocab = draft_vocab(seqs, starts, 256, keep=[0]) if kind == "eagle3" else None
    head, config = _head(loaded, kind, seqs, starts, 60, vocab)
    folder = save_head(head, config, tmp_path / kind)
    served = load_head(folder, target, kind)
    core = EngineCore(loaded.model, loaded.tokenizer,
                      EngineConfig(max_num_seqs=4, enable_prefix_cache=False, speculative=kind, draft_model=str(folder),
                                   num_draft_tokens=3, spec_max_batch=4), max_model_len=1024)
    proposer, firsts = core.spec.proposer, []
    propose = proposer.propose

    def recording(step):  # (tokens emitted so far, fed row) of each proposal
        out = propose(step)
        if out is not None:
            firsts.append((step.requests[step.rids[0]].num_output_tokens, out[0][0].tolist()))
        return out

    proposer.propose = recording
    seq, start = seqs[0], starts[0]
    got = run(core, [greedy("a", seq[:start], max_tokens=NEW)])["a"]["ids"]
    assert got == seq[start:]
    guesses = _trained_guesses(served, target, seq, start)
    assert len(firsts) >= 5
    for n, fed in firsts:
        p = start + n  # `last`'s position
        assert fed[0] == seq[p]
        assert fed[1] == guesses[p - 1 - start], n
    fit = sum(g == t for g, t in zip(guesses, seq[start + 2:])) / len(seq[start + 2:])
    assert fit > 0.9
    stats = core.spec_stats()
    assert stats["acceptance_rate"] > 0.3, stats  # later drafts feed the head its own output: untrained here

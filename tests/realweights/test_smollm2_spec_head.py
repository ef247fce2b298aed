"""An EAGLE-3 head trained here on real SmolLM2-135M's own greedy answers (as tools/train_spec_head.py does, on a
few prompts): training leaves the model's weights alone, and served beside the model on those prompts its
drafts are accepted at a real rate while greedy output stays token for token plain decoding's, alone and two
at a time. Held-out prompts are tools/train_spec_head.py `--measure`'s job (docs/BENCHMARKS.md)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams

pytestmark = pytest.mark.needs("smollm2")

QUESTIONS = ["What is the capital of France?", "Write one sentence about the ocean.",
             "List three facts about honey bees.", "Why is sleep important?"]
MAX_NEW = 24
# Measured 0.47 (37 of 78 drafts, alone and two at a time); a head trained on a changed model, or not at all,
# gets about none.
ACCEPTANCE_FLOOR = 0.35


@pytest.fixture(scope="module")
def head(smollm2_loaded, tmp_path_factory):
    from mlxhost.engine.spec.heads import HEADS, save_head
    from mlxhost.testing.spec_heads import draft_vocab, greedy_sequence, head_config, set_draft_vocab, train_head

    loaded = smollm2_loaded
    target, tok = loaded.model, loaded.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
               for q in QUESTIONS]
    seqs, starts = [greedy_sequence(target, p, MAX_NEW) for p in prompts], [len(p) for p in prompts]
    vocab = draft_vocab(seqs, starts, 1024, keep=sorted(loaded.eos_token_ids))
    config = head_config("eagle3", target, len(vocab))
    mx.random.seed(0)
    trained = HEADS["eagle3"](config, target)
    set_draft_vocab(trained, target, vocab)
    before = {k: mx.array(v) for k, v in tree_flatten(target.parameters())}
    train_head(trained, target, seqs, starts, 40, lr=3e-4, skip_prompt=True, batch_size=4)
    changed = [k for k, v in tree_flatten(target.parameters()) if not mx.array_equal(v, before[k])]
    folder = save_head(trained, config, tmp_path_factory.mktemp("head") / "eagle3")
    return str(folder), prompts, changed


def _decode(loaded, prompts, c, **spec) -> tuple[list[list[int]], dict]:
    config = EngineConfig(max_num_seqs=c, enable_prefix_cache=False, num_draft_tokens=3, **spec)
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=1024)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    out = {f"r{i}": [] for i in range(len(prompts))}
    for w in range(0, len(prompts), c):
        for i in range(w, min(w + c, len(prompts))):
            core.add_request(Request(f"r{i}", prompts[i], params, loaded.eos_token_ids))
        while core.has_work:
            for o in core.step():
                assert o.error is None, o.error
                out[o.request_id] += o.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))], core.spec_stats()


def test_training_leaves_the_model_alone(head):
    assert head[2] == []


@pytest.mark.parametrize("c", [1, 2])
def test_a_trained_head_keeps_greedy_output_and_is_accepted(smollm2_loaded, head, c):
    folder, prompts, _ = head
    want, _ = _decode(smollm2_loaded, prompts, c)
    got, stats = _decode(smollm2_loaded, prompts, c, speculative="eagle3", draft_model=folder, spec_max_batch=4)
    assert got == want
    assert stats["num_drafted"] > 20
    assert stats["acceptance_rate"] >= ACCEPTANCE_FLOOR, stats

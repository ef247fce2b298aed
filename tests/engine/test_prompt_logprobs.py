"""A prompt's own logprobs (`SamplingParams.prompt_logprobs`, a text completion's echo with logprobs): each
prompt token's logprob after the tokens before it, from the chunked prefill, equal to one whole forward's
log-softmax; computed whole even when the prefix cache holds the prompt, whose blocks it still stores; on the
plain layout, MLA, and the ones whose prefill stops at block boundaries (sliding windows, recurrent state)."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.testing.families import build_family_folder

BS = 16


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text", "qwen3_next", "deepseek_v2"])
def loaded(request, qwen3_model_dir, tmp_path_factory):
    if request.param == "qwen3":
        return load_model(str(qwen3_model_dir))
    return load_model(str(build_family_folder(tmp_path_factory.mktemp(request.param), request.param)))


def make_core(loaded, **kw) -> EngineCore:
    config = EngineConfig(**{"max_num_seqs": 8, "block_size": BS, "cache_memory_bytes": 32 << 20,
                             "prefill_step_size": 24, **kw})  # several chunks a prompt
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=2048, model_key="prompt-logprobs")


def run(core: EngineCore, prompt: list[int], k: int | None, rid: str = "r") -> tuple[list, list[int], int]:
    """(prompt entries, output ids, cached tokens) of one greedy request."""
    core.add_request(Request(rid, prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                         prompt_logprobs=k)))
    entries, ids, cached = None, [], 0
    while core.has_work:
        for o in core.step():
            assert o.error is None, o.error
            if o.prompt_logprobs is not None:
                assert entries is None, "sent twice"
                entries = o.prompt_logprobs
            ids += o.new_token_ids
            cached = o.num_cached_tokens
    return entries, ids, cached


def whole_forward(model, prompt: list[int]) -> np.ndarray:
    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def test_prompt_logprobs_match_one_forward_and_skip_the_cache(loaded):
    rng = random.Random(0)
    prompt = [rng.randrange(3, 500) for _ in range(3 * BS + 7)]
    core = make_core(loaded)
    entries, ids, cached = run(core, prompt, k=3)
    reference = whole_forward(loaded.model, prompt)
    assert len(entries) == len(prompt) and entries[0].logprob is None and cached == 0
    for i, e in enumerate(entries[1:], start=1):
        assert e.token_id == prompt[i]
        assert e.logprob == pytest.approx(reference[i - 1, prompt[i]], abs=2e-3)
        best = np.argsort(-reference[i - 1])[:3]
        assert [t for t, _ in e.top] == list(best) or np.allclose(sorted(v for _, v in e.top),
                                                                    sorted(reference[i - 1, best]), atol=2e-3)
        assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
    plain, plain_ids, _ = run(make_core(loaded, enable_prefix_cache=False), prompt, k=None)
    assert plain is None and plain_ids == ids  # scoring changes nothing of the output
    # The same prompt again: scored whole again (the cache holds it now), and an unscored one hits it.
    again, again_ids, again_cached = run(core, prompt, k=0, rid="again")
    assert again_cached == 0 and again_ids == ids
    assert [e.logprob for e in again[1:]] == pytest.approx([e.logprob for e in entries[1:]], abs=1e-5)
    assert all(e.top == () for e in again[1:])
    _, hit_ids, hit_cached = run(core, prompt, k=None, rid="hit")
    assert hit_cached > 0 and hit_ids == ids


def test_a_scored_prompt_beside_a_decoding_row_and_one_that_fails_alone(loaded, monkeypatch):
    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(2 * BS + 5)]
    alone, _, _ = run(make_core(loaded), prompt, k=2)
    core = make_core(loaded)
    core.add_request(Request("decoding", prompt[:9], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))
    core.step()  # it decodes while the scored prompt prefills chunk by chunk
    beside, _, _ = run(core, prompt, k=2, rid="scored")
    assert [e.logprob for e in beside[1:]] == pytest.approx([e.logprob for e in alone[1:]], abs=1e-4)
    assert [e.top for e in beside[1:]] == [e.top for e in alone[1:]] or all(
        [t for t, _ in a.top][:1] == [t for t, _ in b.top][:1] for a, b in zip(alone[1:], beside[1:]))

    import mlxhost.engine.runner.prefill as prefill

    def fails(*args):
        raise RuntimeError("out of memory reading the scores")

    monkeypatch.setattr(prefill, "prompt_entries", fails)
    core.add_request(Request("other", prompt[:12], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
    core.add_request(Request("doomed", prompt, SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=0)))
    errors, finished = {}, set()
    while core.has_work:
        for o in core.step():
            if o.error:
                errors[o.request_id] = o.error
            elif o.finished:
                finished.add(o.request_id)
    assert set(errors) == {"doomed"} and "out of memory" in errors["doomed"]
    assert "other" in finished  # the rest carried on

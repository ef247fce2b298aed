"""SmolLM2-135M-Instruct from its GGUF: a greedy answer with content, and greedy tokens identical to
mlx-lm's own generator on the same weights, alone and inside a batch of three different prompts."""

from __future__ import annotations

import mlx_lm
import openai
import pytest
from mlx_lm.sample_utils import make_sampler

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams

pytestmark = pytest.mark.needs("smollm2")

QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?"]
MAX_NEW = 8


def _prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)


def _mlx_lm_greedy(loaded, prompt: list[int]) -> list[int]:
    return [r.token for r in mlx_lm.stream_generate(loaded.model, loaded.tokenizer, prompt=prompt,
                                                    max_tokens=MAX_NEW, sampler=make_sampler(temp=0.0))]


def _engine_greedy(loaded, prompts: list[list[int]]) -> list[list[int]]:
    core = EngineCore(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=4, prefill_step_size=256),
                      max_model_len=2048)
    tokens = {}
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
                                 loaded.eos_token_ids))
        tokens[f"r{i}"] = []
    while core.has_work:
        for out in core.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(smollm2_loaded):
    """(prompt ids, mlx-lm's greedy tokens) of each question."""
    prompts = [_prompt(smollm2_loaded.tokenizer, q) for q in QUESTIONS]
    return prompts, [_mlx_lm_greedy(smollm2_loaded, p) for p in prompts]


def test_served_gguf_answers_as_mlx_lm_does(smollm2_server, smollm2_loaded, reference):
    with openai.OpenAI(base_url=smollm2_server.base_url, api_key="x", max_retries=0, timeout=300) as client:
        r = client.chat.completions.create(model=smollm2_server.model_name, temperature=0.0, max_tokens=MAX_NEW,
                                           messages=[{"role": "user", "content": QUESTIONS[0]}])
    text = r.choices[0].message.content
    assert "Paris" in text
    assert text == smollm2_loaded.tokenizer.decode(reference[1][0], skip_special_tokens=True)


def test_engine_matches_mlx_lm_alone_and_batched(smollm2_loaded, reference):
    prompts, want = reference
    assert "Paris" in smollm2_loaded.tokenizer.decode(want[0])
    assert len({tuple(w) for w in want}) == 3  # three different answers, so a mixed-up row would show
    assert _engine_greedy(smollm2_loaded, prompts[:1]) == want[:1]
    assert _engine_greedy(smollm2_loaded, prompts) == want

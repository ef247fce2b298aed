"""Text completions beyond the plain one, on the real Qwen2.5-Coder-0.5B-Instruct (its GGUF, converted to
float32): fill-in-the-middle (the code between a prefix and a suffix, through OpenAI's `suffix` and Ollama's,
greedy; Ollama lists the model as able to "insert"), and scoring a prompt with `echo` + `logprobs` as
evaluation harnesses do. Slow on a CPU: short replies."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.conftest import SERVED_NAME, start_server

pytestmark = pytest.mark.needs("qwen25-coder")

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def server(qwen25_coder_dir):
    live = start_server(qwen25_coder_dir, max_num_seqs=2, prefill_step_size=512)
    yield live
    live.stop()


def test_openai_suffix_fills_the_function_body(server):
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=900) as client:
        reply = client.completions.create(model=SERVED_NAME, prompt=PREFIX, suffix=SUFFIX, max_tokens=6,
                                          temperature=0)
        assert reply.choices[0].text.startswith("return a + b"), reply.choices[0].text
        # The name the suffix returns is the one the middle builds, which the prefix alone never suggests.
        prefix = "import os\n\ndef list_python_files(folder):\n    "
        middle = client.completions.create(model=SERVED_NAME, prompt=prefix, suffix="\n    return sorted(found)\n",
                                           max_tokens=8, temperature=0).choices[0].text
        assert middle.startswith("found = []"), middle
        alone = client.completions.create(model=SERVED_NAME, prompt=prefix, max_tokens=8, temperature=0)
        assert "found" not in alone.choices[0].text, alone.choices[0].text

def test_ollama_suffix_fills_the_same_body(server):
    r = httpx.post(server.url + "/api/generate", timeout=900,
                   json={"model": SERVED_NAME, "prompt": PREFIX, "suffix": SUFFIX, "stream": False,
                         "options": {"temperature": 0, "num_predict": 6}})
    assert r.status_code == 200, r.text
    assert r.json()["response"].startswith("return a + b"), r.json()
    show = httpx.post(server.url + "/api/show", json={"model": SERVED_NAME}, timeout=60).json()
    assert "insert" in show["capabilities"], show["capabilities"]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=900) as c:
        yield c


def _scored(client, ids: list[int]):
    """The prompt's logprobs as an evaluation harness asks for them: echo, logprobs, one new token."""
    reply = client.completions.create(model=SERVED_NAME, prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                      temperature=0)
    return reply.choices[0].logprobs


def test_echo_scores_the_prompt_as_the_model_generates_it(server, client, qwen25_coder_dir):
    tok = AutoTokenizer.from_pretrained(str(qwen25_coder_dir))
    context = tok.encode("def add(a, b):\n    return")
    made = client.completions.create(model=SERVED_NAME, prompt=context, max_tokens=4, temperature=0, logprobs=1)
    generated = made.choices[0].logprobs
    scored = _scored(client, context + tok.encode("".join(generated.tokens)))
    assert len(scored.token_logprobs) == len(context) + 4 + 1  # the prompt, then the one new token
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    # A token's logprob after its context is the same whether the model wrote it or was given it.
    assert scored.token_logprobs[len(context):-1] == pytest.approx(generated.token_logprobs, abs=1e-3)
    assert scored.tokens[len(context):-1] == generated.tokens


def test_echo_scoring_prefers_the_right_continuation(client, qwen25_coder_dir):
    tok = AutoTokenizer.from_pretrained(str(qwen25_coder_dir))
    context = tok.encode("# Python\nnumbers = [3, 1, 2]\nnumbers.")

    def loglikelihood(continuation: str) -> float:
        ids = tok.encode(continuation)
        return sum(_scored(client, context + ids).token_logprobs[len(context):len(context) + len(ids)])

    assert loglikelihood("sort()") > loglikelihood("sorted()")  # a list method, not a built-in

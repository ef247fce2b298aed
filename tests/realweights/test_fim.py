"""Fill-in-the-middle on the real Qwen2.5-Coder-0.5B-Instruct (its GGUF, converted to float32): the code
between a prefix and a suffix, through OpenAI's `suffix` and Ollama's, greedy; Ollama lists the model as able
to "insert". Slow on a CPU: short replies."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import SERVED_NAME, start_server

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

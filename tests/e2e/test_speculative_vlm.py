"""Speculative decoding (prompt lookup) on vision-language models (Qwen2.5-VL, Qwen3-VL): rows carry their own rope positions
(the image's delta), which advance by each row's accepted run; greedy text equals the server without it."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

PROMPT = "Say it again: red green blue, red green blue, red green blue, red green blue, red green"


def _image_uri(seed: int) -> str:
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (224, 300, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module", params=["qwen25vl_dir", "qwen3vl_dir"])
def servers(request, make_module_server):
    model_dir = request.getfixturevalue(request.param)
    kw = dict(prefill_step_size=64, block_size=16, max_num_seqs=4)
    return make_module_server(model_dir, **kw), make_module_server(model_dir, speculative="ngram", **kw)


def _texts(live, n: int = 3) -> list[str]:
    out = []
    with openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120) as c:
        for i in range(n):
            content = [{"type": "text", "text": PROMPT}]
            if i % 2 == 0:
                content.insert(0, {"type": "image_url", "image_url": {"url": _image_uri(i)}})
            r = c.chat.completions.create(model=live.model_name, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=40)
            out.append(r.choices[0].message.content)
    return out


def test_vlm_greedy_text_unchanged_with_prompt_lookup(servers):
    off, spec = servers
    assert _texts(spec) == _texts(off)
    status = httpx.get(f"{spec.url}/v1/status", timeout=30).json()["speculative"]
    assert status["mode"] == "ngram" and status["num_steps"] > 0 and status["num_accepted"] > 0

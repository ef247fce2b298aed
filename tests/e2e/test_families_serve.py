"""The real server starts on every model family's fixture and answers the official client, whole and
streamed, with the same greedy text both ways and several requests at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from mlxhost.testing.families import FAMILIES, build_family_folder

MESSAGES = [{"role": "user", "content": "Tell me about unified memory."}]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_server_starts_and_serves(family, tmp_path, make_server):
    path = build_family_folder(tmp_path / family, family)
    live = make_server(path, max_num_seqs=8, block_size=16)
    with openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120) as client:
        def ask(_=None):
            r = client.chat.completions.create(model=live.model_name, messages=MESSAGES, max_tokens=24,
                                               temperature=0)
            return r.choices[0].message.content, r.usage.completion_tokens

        whole, n = ask()
        assert n > 0
        stream = client.chat.completions.create(model=live.model_name, messages=MESSAGES, max_tokens=24,
                                                temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == whole
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, range(4))) == [(whole, n)] * 4

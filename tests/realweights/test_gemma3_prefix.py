"""Gemma 3 270M from its GGUF (sliding-window layers of 512 tokens, one global layer in six) served with the
prefix cache on: a second prompt that extends a first one past the window reuses its blocks and still
continues exactly as mlx-lm does on the whole prompt."""

from __future__ import annotations

import mlx_lm
import openai
import pytest
from mlx_lm.sample_utils import make_sampler

pytestmark = pytest.mark.needs("gemma3-270m")

MAX_NEW = 4
TEXT = ("The river ran past the old mill, under the stone bridge and into the valley where the farmers grew "
        "wheat, barley and apples. Every autumn the village held a market on the square by the church. ")


@pytest.fixture(scope="module")
def server(gemma3_gguf):
    from tests.e2e.conftest import start_server

    live = start_server(gemma3_gguf, max_num_seqs=2, prefill_step_size=256, block_size=16)
    yield live
    live.stop()


def test_prefix_past_the_sliding_window_is_reused_exactly(server, gemma3_dir):
    model, tokenizer = mlx_lm.load(str(gemma3_dir))
    ids = tokenizer.encode(TEXT * 20)
    assert len(ids) > 600  # past the 512-token window: the sliding layers' cache has wrapped
    first, second = ids[:560], ids[:608]
    want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt=second, max_tokens=MAX_NEW,
                                                    sampler=make_sampler(temp=0.0))]
    with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=600) as client:
        client.completions.create(model="tiny", prompt=first, max_tokens=1, temperature=0.0)
        r = client.completions.create(model="tiny", prompt=second, max_tokens=MAX_NEW, temperature=0.0, logprobs=1)
    assert r.usage.prompt_tokens_details.cached_tokens >= 544  # 34 whole blocks of the first prompt
    assert r.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in want]

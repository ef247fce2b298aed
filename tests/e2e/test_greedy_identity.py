"""Greedy output is token-identical alone, batched with 15 others, and through mlx-lm's own generator.

Batching (left-padded batch caches, rows joining and leaving), chunked prefill (prompts longer than
`prefill_step_size`) and the pipelined decode must not change a single greedy token. The reference is
`mlx_lm.stream_generate` on the same weights and prompt ids. Compared: token ids (engine level), and over
HTTP the per-token strings, their logprobs, the text and the usage.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import mlx_lm
import openai
import pytest
from mlx_lm.sample_utils import make_sampler

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.engine.runner.batch import make_buckets
from mlxhost.models.loader import load_model

MODEL = "tiny"  # the served name tests/e2e/conftest.py gives
PREFILL_STEP = 16
# 16 prompts; those over PREFILL_STEP tokens are prefilled in 2-5 chunks.
PROMPT_LENS = [1, 2, 5, 9, 15, 16, 17, 23, 31, 32, 33, 40, 47, 55, 64, 70]
MAX_NEW = 12
LONG_NEW = 40  # the first wave keeps decoding while the second wave prefills
LOGPROB_TOL = 2e-3  # float32 batched vs. single-row: ~1e-6 apart; a different token is ~1e-2 or more

TEXT = (
    "The quick brown fox jumps over the lazy dog while the old man reads a long book about rivers, "
    "mountains and the history of small towns. In the morning the teacher opens the window, the students "
    "write a short story, and the server answers every request with a stream of tokens. Later that evening "
    "the wind moved the clouds over the valley, the river grew quiet, and a young engineer wrote a scheduler "
    "that could batch many prompts together without changing a single answer. "
)

MODEL_FIXTURES = ["qwen3_model_dir", "llama_model_dir", "qwen3_4bit_model_dir"]


@dataclass
class Case:
    model_dir: object
    loaded: object
    prompts: list[list[int]]
    ref_ids: list[list[int]]  # greedy continuation of each prompt, LONG_NEW tokens or up to EOS
    ref_logprobs: list[list[float]]

    def expected(self, i: int, max_tokens: int) -> tuple[list[int], list[float]]:
        return self.ref_ids[i][:max_tokens], self.ref_logprobs[i][:max_tokens]

    def decode_each(self, ids: list[int]) -> list[str]:
        return [self.loaded.tokenizer.decode([t]) for t in ids]


def _reference(loaded, prompt: list[int]) -> tuple[list[int], list[float]]:
    ids, lps = [], []
    for r in mlx_lm.stream_generate(loaded.model, loaded.tokenizer, prompt=prompt, max_tokens=LONG_NEW,
                                    sampler=make_sampler(temp=0.0)):
        ids.append(r.token)
        lps.append(r.logprobs[r.token].item())
    return ids, lps


@pytest.fixture(scope="module", params=MODEL_FIXTURES)
def case(request) -> Case:
    model_dir = request.getfixturevalue(request.param)
    loaded = load_model(str(model_dir))
    ids = loaded.tokenizer.encode(TEXT * 2)
    assert len(ids) >= max(PROMPT_LENS)
    # Different starting points so prompts are not prefixes of each other.
    prompts = [ids[i : i + n] for i, n in enumerate(PROMPT_LENS)]
    refs = [_reference(loaded, p) for p in prompts]
    return Case(model_dir, loaded, prompts, [r[0] for r in refs], [r[1] for r in refs])


def _max_tokens(i: int) -> int:
    return LONG_NEW if i % 2 == 0 else MAX_NEW


# -- engine level: exact token ids -------------------------------------------------------------------


def _run_engine(case: Case, order: list[int], join_after_steps: int, num_first_wave: int,
                buckets: list[int] | None = None) -> dict[str, tuple]:
    """Adds `order[:num_first_wave]`, steps `join_after_steps` times, adds the rest, steps to the end."""
    core = EngineCore(case.loaded.model, case.loaded.tokenizer,
                      EngineConfig(max_num_seqs=16, prefill_step_size=PREFILL_STEP), max_model_len=4096,
                      buckets=buckets)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    finish: dict[str, str] = {}

    def add(i: int) -> None:
        # Mixed logprob settings: rows that ask for none or for fewer alternatives share the batch.
        sp = SamplingParams(max_tokens=_max_tokens(i), temperature=0.0, logprobs=i % 3 != 0, top_logprobs=i % 4)
        core.add_request(Request(f"r{i}", case.prompts[i], sp, case.loaded.eos_token_ids))
        tokens[f"r{i}"], logprobs[f"r{i}"] = [], []

    def step() -> None:
        for out in core.step():
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.logprobs or []
            if out.finish_reason:
                finish[out.request_id] = out.finish_reason

    for i in order[:num_first_wave]:
        add(i)
    for _ in range(join_after_steps):
        step()
    for i in order[num_first_wave:]:
        add(i)
    for _ in range(10_000):
        if not core.has_work:
            break
        step()
    assert not core.has_work
    return {rid: (tokens[rid], logprobs[rid], finish.get(rid)) for rid in tokens}


def _check_engine_result(case: Case, i: int, got) -> None:
    ids, lps, finish = got
    want_ids, want_lps = case.expected(i, _max_tokens(i))
    assert ids == want_ids, f"prompt {i} ({len(case.prompts[i])} tokens)"
    eos = want_ids[-1] in case.loaded.eos_token_ids
    assert finish == ("stop" if eos else "length")
    if i % 3 != 0:
        assert [lp.token_id for lp in lps] == ids
        assert all(math.isclose(lp.logprob, w, abs_tol=LOGPROB_TOL) for lp, w in zip(lps, want_lps))
        for lp in lps:
            assert len(lp.top) == i % 4
            if lp.top:  # greedy: the chosen token is the best alternative
                assert lp.top[0][0] == lp.token_id
                assert math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-5)
    else:
        assert lps == []


def test_engine_alone_matches_mlx_lm(case):
    for i in range(len(case.prompts)):
        result = _run_engine(case, [i], join_after_steps=0, num_first_wave=1)
        _check_engine_result(case, i, result[f"r{i}"])


@pytest.mark.parametrize("buckets", [None, make_buckets(16)], ids=["exact-batch", "bucketed-batch"])
def test_engine_batched_matches_mlx_lm(case, buckets):
    # Longest prompts first so the second wave joins while chunked prefills and decodes are in flight.
    # With buckets the batch is padded with filler rows, which must not change any live row.
    order = sorted(range(len(case.prompts)), key=lambda i: -len(case.prompts[i]))
    result = _run_engine(case, order, join_after_steps=3, num_first_wave=8, buckets=buckets)
    for i in range(len(case.prompts)):
        _check_engine_result(case, i, result[f"r{i}"])


# -- HTTP level --------------------------------------------------------------------------------------


def _check_http_result(case: Case, i: int, max_tokens: int, tokens, lps, text, finish, usage) -> None:
    want_ids, want_lps = case.expected(i, max_tokens)
    where = f"prompt {i} ({len(case.prompts[i])} tokens)"
    assert tokens == case.decode_each(want_ids), where
    assert all(math.isclose(a, b, abs_tol=LOGPROB_TOL) for a, b in zip(lps, want_lps)), where
    assert len(lps) == len(want_ids)
    assert text == case.loaded.tokenizer.decode(want_ids, skip_special_tokens=True), where
    assert finish == ("stop" if want_ids[-1] in case.loaded.eos_token_ids else "length")
    assert usage.prompt_tokens == len(case.prompts[i])
    assert usage.completion_tokens == len(want_ids)


def test_http_alone_matches_mlx_lm(case, make_server):
    live = make_server(case.model_dir, max_num_seqs=16, prefill_step_size=PREFILL_STEP)
    with openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120) as client:
        for i, prompt in enumerate(case.prompts):
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_NEW, temperature=0.0,
                                          logprobs=1)
            ch = r.choices[0]
            _check_http_result(case, i, MAX_NEW, ch.logprobs.tokens, ch.logprobs.token_logprobs, ch.text,
                               ch.finish_reason, r.usage)


async def _stream_one(client, prompt, max_tokens, first_chunk: asyncio.Event | None = None):
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0.0, logprobs=1, stream=True,
                                             stream_options={"include_usage": True})
    tokens, lps, text, finish, usage = [], [], [], None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text.append(ch.text)
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                lps += ch.logprobs.token_logprobs
            finish = ch.finish_reason or finish
        if first_chunk is not None:
            first_chunk.set()
    return tokens, lps, "".join(text), finish, usage


@pytest.mark.anyio
@pytest.mark.parametrize("decode_buckets", ["off", "on"])
async def test_http_16_concurrent_match_mlx_lm(case, make_server, decode_buckets):
    live = make_server(case.model_dir, max_num_seqs=16, prefill_step_size=PREFILL_STEP, decode_buckets=decode_buckets)
    async with openai.AsyncOpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120) as client:
        # Wave 1 (long generations) is decoding when wave 2 arrives and is prefilled in chunks.
        wave1 = [i for i in range(len(case.prompts)) if i % 2 == 0]
        wave2 = [i for i in range(len(case.prompts)) if i % 2 == 1]
        started = {i: asyncio.Event() for i in wave1}
        tasks1 = {i: asyncio.ensure_future(_stream_one(client, case.prompts[i], LONG_NEW, started[i])) for i in wave1}
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), timeout=120)
        results2 = await asyncio.gather(*(_stream_one(client, case.prompts[i], MAX_NEW) for i in wave2))
        results1 = await asyncio.gather(*tasks1.values())
    for i, res in zip(wave1, results1):
        _check_http_result(case, i, LONG_NEW, *res)
    for i, res in zip(wave2, results2):
        _check_http_result(case, i, MAX_NEW, *res)

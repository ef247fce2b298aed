"""The official openai client against the real server: chat and completions, sync and async, streamed and not."""

from __future__ import annotations

import re

import pytest
from tokenizers import Tokenizer

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story"}]
PROMPT = "Once upon a time"
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def hf_tokenizer(qwen3_model_dir):
    # The raw `tokenizers` file, independent of the server's (mlx-lm) tokenizer path.
    return Tokenizer.from_file(str(qwen3_model_dir / "tokenizer.json"))


def chatml(messages) -> str:
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def chat(client, **kw):
    kw.setdefault("messages", MESSAGES)
    return client.chat.completions.create(model="tiny", **kw)


def complete(client, **kw):
    kw.setdefault("prompt", PROMPT)
    return client.completions.create(model="tiny", **kw)


def collect_chat_stream(stream):
    """(text pieces, finish_reason, usage, chunks) of a streamed chat completion."""
    pieces, finish, usage, chunks = [], None, None, []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
            finish = ch.finish_reason or finish
    return pieces, finish, usage, chunks


def collect_completion_stream(stream):
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.text)
            finish = ch.finish_reason or finish
    return pieces, finish, usage


def _plain(token: str, min_len: int) -> bool:
    word = token.strip()
    return len(word) >= min_len and word.isascii() and word.isalpha()


def clean_span(tokens: list[str], min_len: int) -> int:
    """Index of the first token of plain ASCII letters (at least `min_len`) after another plain token."""
    for i in range(1, len(tokens)):
        if _plain(tokens[i], min_len) and _plain(tokens[i - 1], 1):
            return i
    raise AssertionError(f"no plain token pair in {tokens}")


# -- basics ------------------------------------------------------------------------------------------


def test_health_and_models(client, http):
    assert http.get("/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].object == "model"


def test_model_alias_is_accepted(client, qwen3_model_dir):
    # The folder name works as an alias of the served name.
    r = client.completions.create(model=qwen3_model_dir.name, prompt=PROMPT, max_tokens=2)
    assert r.model == qwen3_model_dir.name
    assert r.usage.completion_tokens >= 1


def test_chat_usage_and_length(client, hf_tokenizer):
    r = chat(client, max_tokens=8, temperature=0.0, extra_body=IGNORE_EOS)
    choice = r.choices[0]
    assert r.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(hf_tokenizer.encode(chatml(MESSAGES)).ids)
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_content_parts_render_like_a_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story"}]}]
    joined = [{"role": "user", "content": "Tell me a story"}]
    a = chat(client, messages=parts, max_tokens=6, temperature=0.0, extra_body=IGNORE_EOS)
    b = chat(client, messages=joined, max_tokens=6, temperature=0.0, extra_body=IGNORE_EOS)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.choices[0].message.content == b.choices[0].message.content


def test_max_completion_tokens(client):
    r = chat(client, max_completion_tokens=5, temperature=0.0, extra_body=IGNORE_EOS)
    assert r.usage.completion_tokens == 5


def test_completion_usage_and_length(client, hf_tokenizer):
    r = complete(client, max_tokens=7, temperature=0.0, extra_body=IGNORE_EOS)
    choice = r.choices[0]
    assert r.object == "text_completion"
    assert choice.text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(hf_tokenizer.encode(PROMPT).ids)
    assert r.usage.completion_tokens == 7


def test_completion_token_id_prompt(client, hf_tokenizer):
    ids = hf_tokenizer.encode(PROMPT).ids
    by_text = complete(client, max_tokens=6, temperature=0.0, extra_body=IGNORE_EOS)
    by_ids = complete(client, prompt=ids, max_tokens=6, temperature=0.0, extra_body=IGNORE_EOS)
    assert by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text


# -- streaming ---------------------------------------------------------------------------------------


def test_chat_stream_equals_non_stream(client):
    whole = chat(client, max_tokens=16, temperature=0.0, extra_body=IGNORE_EOS)
    stream = chat(client, max_tokens=16, temperature=0.0, extra_body=IGNORE_EOS, stream=True,
                  stream_options={"include_usage": True})
    pieces, finish, usage, chunks = collect_chat_stream(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert len(pieces) > 1
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == "length"
    # The usage chunk comes last, with no choices, and matches the non-streamed usage.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 16)
    assert usage.total_tokens == usage.prompt_tokens + 16


def test_chat_stream_without_usage_option_has_no_usage(client):
    stream = chat(client, max_tokens=4, temperature=0.0, stream=True)
    _, _, usage, chunks = collect_chat_stream(stream)
    assert usage is None
    assert all(c.choices for c in chunks)


def test_completion_stream_equals_non_stream(client):
    whole = complete(client, max_tokens=16, temperature=0.0, extra_body=IGNORE_EOS)
    stream = complete(client, max_tokens=16, temperature=0.0, extra_body=IGNORE_EOS, stream=True,
                      stream_options={"include_usage": True})
    pieces, finish, usage = collect_completion_stream(stream)
    assert "".join(pieces) == whole.choices[0].text
    assert finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 16)


@pytest.mark.anyio
async def test_async_chat_and_completion(async_client):
    sync_like = await async_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,
                                                            temperature=0.0, extra_body=IGNORE_EOS)
    stream = await async_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,
                                                         temperature=0.0, extra_body=IGNORE_EOS, stream=True,
                                                         stream_options={"include_usage": True})
    pieces, usage = [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        pieces += [ch.delta.content for ch in chunk.choices if ch.delta.content]
    assert sync_like.choices[0].message.content
    assert "".join(pieces) == sync_like.choices[0].message.content
    assert usage.completion_tokens == sync_like.usage.completion_tokens == 10

    comp = await async_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=9, temperature=0.0,
                                                 extra_body=IGNORE_EOS)
    stream = await async_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=9, temperature=0.0,
                                                   extra_body=IGNORE_EOS, stream=True)
    text = "".join([ch.text async for chunk in stream for ch in chunk.choices])
    assert comp.choices[0].text and text == comp.choices[0].text
    assert comp.usage.completion_tokens == 9


# -- stop strings ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_completion(client):
    """A greedy completion with its per-token strings: stop strings are picked from it so they surely hit."""
    r = complete(client, max_tokens=24, temperature=0.0, logprobs=0, extra_body=IGNORE_EOS)
    return r.choices[0].text, r.choices[0].logprobs.tokens


@pytest.fixture(scope="module")
def greedy_chat(client):
    r = chat(client, max_tokens=24, temperature=0.0, logprobs=True, extra_body=IGNORE_EOS)
    return r.choices[0].message.content, [t.token for t in r.choices[0].logprobs.content]


def _stop_cases(text: str, tokens: list[str]) -> dict[str, str]:
    i = clean_span(tokens, 2)
    j = clean_span(tokens[i + 1 :], 3) + i + 1
    inside = tokens[j].strip()[1:3]  # strictly inside one token
    across = tokens[i - 1][-1:] + tokens[i][:2]  # the end of one token and the start of the next
    assert across in text and inside in text
    return {"across": across, "inside": inside}


def _expected_before(text: str, stops: list[str]) -> str:
    return text[: min(text.find(s) for s in stops if s in text)]


@pytest.mark.parametrize("kind", ["across", "inside"])
@pytest.mark.parametrize("stream", [False, True])
def test_completion_stop_string(client, greedy_completion, kind, stream):
    text, tokens = greedy_completion
    stop = _stop_cases(text, tokens)[kind]
    stops = ["never-in-this-text", stop]
    if stream:
        pieces, finish, _ = collect_completion_stream(
            complete(client, max_tokens=24, temperature=0.0, stop=stops, extra_body=IGNORE_EOS, stream=True))
        got = "".join(pieces)
        assert all(stop not in p for p in pieces)
    else:
        r = complete(client, max_tokens=24, temperature=0.0, stop=stops, extra_body=IGNORE_EOS)
        got, finish = r.choices[0].text, r.choices[0].finish_reason
        assert r.usage.completion_tokens < 24
    assert finish == "stop"
    assert stop not in got
    assert got == _expected_before(text, stops)


@pytest.mark.parametrize("kind", ["across", "inside"])
@pytest.mark.parametrize("stream", [False, True])
def test_chat_stop_string(client, greedy_chat, kind, stream):
    text, tokens = greedy_chat
    stop = _stop_cases(text, tokens)[kind]
    if stream:
        pieces, finish, _, _ = collect_chat_stream(
            chat(client, max_tokens=24, temperature=0.0, stop=stop, extra_body=IGNORE_EOS, stream=True))
        got = "".join(pieces)
    else:
        r = chat(client, max_tokens=24, temperature=0.0, stop=stop, extra_body=IGNORE_EOS)
        got, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop"
    assert stop not in got
    assert got == _expected_before(text, [stop])


def test_earliest_of_several_stop_strings_wins(client, greedy_completion):
    text, tokens = greedy_completion
    cases = _stop_cases(text, tokens)
    # Listed latest-first: the one that occurs first in the text must still win.
    stops = sorted(cases.values(), key=lambda s: -text.find(s))
    r = complete(client, max_tokens=24, temperature=0.0, stop=stops, extra_body=IGNORE_EOS)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: min(text.find(s) for s in stops)]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_on_the_last_allowed_token_reports_stop(client, greedy_completion, stream):
    text, tokens = greedy_completion
    stop = _stop_cases(text, tokens)["across"]
    # The number of tokens whose text first contains the stop string: max_tokens ends there too.
    k = next(k for k in range(1, len(tokens) + 1) if stop in "".join(tokens[:k]))
    assert text.startswith("".join(tokens[:k]))
    kw = dict(max_tokens=k, temperature=0.0, stop=stop, extra_body=IGNORE_EOS)
    if stream:
        pieces, finish, _ = collect_completion_stream(complete(client, stream=True, **kw))
        got = "".join(pieces)
    else:
        r = complete(client, **kw)
        got, finish = r.choices[0].text, r.choices[0].finish_reason
    assert got == _expected_before(text, [stop])
    assert finish == "stop"


def test_eos_finishes_with_stop_unless_ignored(client, hf_tokenizer):
    eos = hf_tokenizer.token_to_id("<|im_end|>")
    r = complete(client, max_tokens=5, temperature=0.0, logit_bias={str(eos): 100})
    assert (r.choices[0].finish_reason, r.choices[0].text, r.usage.completion_tokens) == ("stop", "", 1)
    r = complete(client, max_tokens=5, temperature=0.0, logit_bias={str(eos): 100}, extra_body=IGNORE_EOS)
    # Special tokens are not rendered as text.
    assert (r.choices[0].finish_reason, r.choices[0].text, r.usage.completion_tokens) == ("length", "", 5)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_prefix_at_the_end_is_released(client, greedy_completion, stream):
    # The output ends with the start of this stop string: held back while it might match, then released.
    text, _ = greedy_completion
    stop = text[-2:] + "\x07never"
    if stream:
        pieces, finish, _ = collect_completion_stream(
            complete(client, max_tokens=24, temperature=0.0, stop=stop, extra_body=IGNORE_EOS, stream=True))
        got = "".join(pieces)
    else:
        r = complete(client, max_tokens=24, temperature=0.0, stop=stop, extra_body=IGNORE_EOS)
        got, finish = r.choices[0].text, r.choices[0].finish_reason
    assert finish == "length"
    assert got == text


# -- sampling options --------------------------------------------------------------------------------


def test_chat_logprobs(client):
    r = chat(client, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3, extra_body=IGNORE_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_chat_logprobs_streamed(client):
    stream = chat(client, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS,
                  stream=True)
    entries = [e for chunk in stream for ch in chunk.choices if ch.logprobs for e in ch.logprobs.content]
    assert len(entries) == 6
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0.0 for e in entries)


def test_chat_without_logprobs_has_none(client):
    r = chat(client, max_tokens=3, temperature=0.0, top_logprobs=3)
    assert r.choices[0].logprobs is None


def test_completion_logprobs(client):
    r = complete(client, max_tokens=6, temperature=0.0, logprobs=2, extra_body=IGNORE_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0.0
        assert 1 <= len(top) <= 2  # two alternatives (one key if both decode to the same string)
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)


def test_seed_makes_sampling_repeatable(client):
    def sample(seed):
        r = complete(client, max_tokens=16, temperature=1.0, seed=seed, extra_body=IGNORE_EOS)
        return r.choices[0].text

    first = sample(1234)
    assert first == sample(1234)
    # Near-uniform random weights: two seeds agreeing on 16 tokens would mean the seed is ignored.
    assert first != sample(4321)


@pytest.mark.anyio
async def test_seeded_request_is_repeatable_inside_a_batch(async_client):
    import asyncio

    async def sample(seed, prompt=PROMPT):
        r = await async_client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=1.0,
                                                  seed=seed, extra_body=IGNORE_EOS)
        return r.choices[0].text

    alone = await sample(77)
    others = [sample(None, prompt=f"noise {i}") for i in range(5)]
    batched, *_ = await asyncio.gather(sample(77), *others)
    assert batched == alone


def test_logit_bias_forces_a_token(client, hf_tokenizer):
    [token_id] = hf_tokenizer.encode(" river").ids
    for temperature in (0.0, 1.0):
        r = complete(client, max_tokens=5, temperature=temperature, logit_bias={str(token_id): 100},
                     extra_body=IGNORE_EOS)
        assert r.choices[0].text == " river" * 5


def test_logit_bias_can_ban_the_greedy_token(client, greedy_completion, hf_tokenizer):
    _, tokens = greedy_completion
    [first_id] = hf_tokenizer.encode(tokens[0]).ids  # a whole word piece: it encodes back to one id
    banned = complete(client, max_tokens=1, temperature=0.0, logprobs=0, extra_body=IGNORE_EOS,
                      logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != tokens[0]


def test_penalties_are_accepted_and_change_greedy_output(client, greedy_completion):
    text, tokens = greedy_completion
    assert len(set(tokens)) < len(tokens), "the plain greedy output should repeat some token"
    r = complete(client, max_tokens=24, temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0,
                 extra_body=IGNORE_EOS | {"repetition_penalty": 1.3}, logprobs=0)
    assert r.usage.completion_tokens == 24
    assert r.choices[0].text != text
    assert len(set(r.choices[0].logprobs.tokens)) > len(set(tokens))


def test_top_k_top_p_min_p_accepted(client):
    for extra in ({"top_k": 5}, {"top_k": -1}, {"min_p": 0.05}, {"top_k": 100_000}):
        r = complete(client, max_tokens=4, temperature=0.8, top_p=0.9, extra_body=IGNORE_EOS | extra)
        assert r.usage.completion_tokens == 4


def test_top_k_1_is_greedy(client, greedy_completion):
    text, _ = greedy_completion
    r = complete(client, max_tokens=24, temperature=1.0, extra_body=IGNORE_EOS | {"top_k": 1})
    assert r.choices[0].text == text


# -- metrics -----------------------------------------------------------------------------------------


def test_metrics_after_requests(client, server):
    chat(client, max_tokens=4, temperature=0.0, extra_body=IGNORE_EOS)
    list(complete(client, max_tokens=4, temperature=0.0, extra_body=IGNORE_EOS, stream=True))
    m = server.metrics()
    assert m['mlxhost_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert m['mlxhost_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert m["mlxhost_prompt_tokens_total"] > 0
    assert m["mlxhost_completion_tokens_total"] >= 8
    assert m["mlxhost_num_requests_running"] == 0
    assert m["mlxhost_num_requests_waiting"] == 0
    assert m["mlxhost_time_to_first_token_seconds_count"] >= 2
    assert m["mlxhost_inter_token_latency_seconds_count"] >= 6
    assert m["mlxhost_request_latency_seconds_count"] >= 2
    assert not any(re.search(r'status="5\d\d"', k) for k in m)

"""`n > 1`: several choices from one prompt, prefilled once (the other choices start from the prefix cache),
whole and streamed, each choice identical to what a single request gives."""

from __future__ import annotations

import random

WORDS = "memory batch token cache prefix stream model layer server apple silicon".split()


def long_messages(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(400))}]


def test_n_choices_whole_share_the_prompt(client, server):
    messages = long_messages(1)
    single = client.chat.completions.create(model=server.model_name, messages=messages, max_tokens=8, temperature=0)
    r = client.chat.completions.create(model=server.model_name, messages=long_messages(1) + [
        {"role": "user", "content": "again"}], max_tokens=8, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 1  # greedy: every choice is the same text
    assert r.usage.prompt_tokens > single.usage.prompt_tokens
    assert 3 <= r.usage.completion_tokens <= 3 * 8  # the three choices' tokens; the prompt counts once
    # Choices 1 and 2 started from choice 0's prompt blocks (block size 128).
    assert r.usage.prompt_tokens_details.cached_tokens >= 128


def test_n_choices_seeded_differ_and_stream_matches_whole(client, server):
    kw = dict(model=server.model_name, messages=long_messages(2), max_tokens=10, temperature=1.0, seed=7, n=2)
    whole = client.chat.completions.create(**kw)
    texts = [c.message.content for c in whole.choices]
    assert texts[0] != texts[1]  # each choice has its own seed
    got = {0: "", 1: ""}
    finishes = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [got[0], got[1]] == texts and set(finishes) == {0, 1}


def test_n_completions(client, server):
    r = client.completions.create(model=server.model_name, prompt="hello there", max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text

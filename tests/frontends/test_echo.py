"""A text completion's `echo` without a model: the prompt before the reply (as sent, or its ids decoded), whole
and streamed; with `logprobs`, the engine is asked to score the prompt and its entries come first, the first
token's null; `echo` with `suffix` refused."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from mlxhost.engine.request import RequestOutput, TokenLogprob
from mlxhost.frontends.app import create_app
from tests.frontends.fake_models import NAME, REPLY, FakeModels, InstantEngine


class ScoringEngine(InstantEngine):
    """Answers REPLY; scores the prompt when asked (logprob -i for token i), and each output token -0.5."""

    def generate(self, request):
        self.requests.append(request)
        sp = request.sampling
        prompt = request.prompt_token_ids
        scored = ([TokenLogprob(prompt[0], None)] + [TokenLogprob(t, -float(i), ((t, -float(i)),) * sp.prompt_logprobs)
                                                      for i, t in enumerate(prompt[1:], 1)]
                  if sp.prompt_logprobs is not None else None)
        ids = list(REPLY.encode())
        lps = [TokenLogprob(t, -0.5, ((t, -0.5),) * sp.top_logprobs) for t in ids] if sp.logprobs else None

        async def outputs():
            yield RequestOutput(request.request_id, ids[:1], REPLY[:1], len(prompt), 1, logprobs=lps and lps[:1],
                                prompt_logprobs=scored)
            yield RequestOutput(request.request_id, ids[1:], REPLY[1:], len(prompt), len(ids), "length",
                                logprobs=lps and lps[1:])

        return outputs()


@pytest.fixture
def app():
    models = FakeModels()
    models.engine = ScoringEngine()
    return TestClient(create_app(models)), models


def test_echo_puts_the_prompt_first(app):
    client, models = app
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "ab", "echo": True, "max_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "ab" + REPLY
    assert models.engine.requests[-1].sampling.prompt_logprobs is None  # no logprobs asked: nothing to score
    ids = client.post("/v1/completions", json={"model": NAME, "prompt": [104, 105], "echo": True, "max_tokens": 5})
    assert ids.json()["choices"][0]["text"] == "hi" + REPLY  # token ids: decoded


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt(app, stream):
    client, models = app
    body = {"model": NAME, "prompt": "abc", "echo": True, "logprobs": 1, "max_tokens": 5, "stream": stream}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert models.engine.requests[-1].sampling.prompt_logprobs == 1
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        for c in chunks:
            for key in lp:
                lp[key] += (c["choices"][0]["logprobs"] or {}).get(key, [])
        # The prompt in the first chunk with text (an empty one goes out at once, before the prefill ends)
        assert next(c for c in chunks if c["choices"][0]["text"])["choices"][0]["text"].startswith("abc")
    else:
        text, lp = r.json()["choices"][0]["text"], r.json()["choices"][0]["logprobs"]
    assert text == "abc" + REPLY
    assert lp["tokens"] == list("abc" + REPLY)
    assert lp["token_logprobs"] == [None, -1.0, -2.0] + [-0.5] * len(REPLY)
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"b": -1.0}


def test_echo_with_suffix_is_refused(app):
    client, _ = app
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "a", "suffix": "b", "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_score_the_prompt_once(app, stream):
    client, models = app
    body = {"model": NAME, "prompt": "abc", "echo": True, "logprobs": 0, "max_tokens": 5, "n": 2, "stream": stream}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert [q.sampling.prompt_logprobs for q in models.engine.requests] == [0, None]  # the copy reuses choice 0's
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        firsts = {}
        for c in chunks:
            choice = c["choices"][0]
            if choice["text"]:  # empty keep-alive chunks go out before the prefill ends
                firsts.setdefault(choice["index"], choice)
        choices = [firsts[0], firsts[1]]
    else:
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for choice in choices:
        assert choice["text"].startswith("abc")
        assert choice["logprobs"]["token_logprobs"][:3] == [None, -1.0, -2.0]

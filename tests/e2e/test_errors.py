"""Every bad input gets the OpenAI error object with a 4xx status; none reaches a 5xx or breaks the server."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from mlxhost.serving.schemas import MAX_STOP_STRINGS

MAX_MODEL_LEN = 64
M = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def chat(**kw):
    return {"model": "tiny", "messages": M, "max_tokens": 2, **kw}


def comp(**kw):
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **kw}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# (id, path, body: dict | raw str, status, param or None to skip the check)
BAD = [
    ("malformed-json", CHAT, '{"model": "tiny", "messages": [', 400, None),
    ("json-array", COMP, "[]", 400, None),
    ("json-null", COMP, "null", 400, None),
    ("empty-body", CHAT, "", 400, None),
    ("trailing-garbage", COMP, json.dumps(comp()) + "}", 400, None),
    ("messages-int", CHAT, chat(messages=5), 400, "messages"),
    ("message-not-object", CHAT, chat(messages=["hi"]), 400, "messages.0"),
    ("content-int", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, None),
    ("content-image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, None),
    ("role-unknown", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role"),
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("model-int", CHAT, chat(model=5), 400, "model"),
    ("max-tokens-fraction", CHAT, chat(max_tokens=3.5), 400, "max_tokens"),
    ("logprobs-not-bool", CHAT, chat(logprobs="many"), 400, "logprobs"),
    ("stream-options-int", CHAT, chat(stream=True, stream_options=5), 400, "stream_options"),
    ("missing-messages", CHAT, without(chat(), "messages"), 400, "messages"),
    ("missing-model-chat", CHAT, without(chat(), "model"), 400, "model"),
    ("missing-model-comp", COMP, without(comp(), "model"), 400, "model"),
    ("missing-prompt", COMP, without(comp(), "prompt"), 400, "prompt"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages"),
    ("empty-prompt", COMP, comp(prompt=""), 400, "prompt"),
    ("empty-prompt-ids", COMP, comp(prompt=[]), 400, "prompt"),
    ("two-prompts", COMP, comp(prompt=["a", "b"]), 400, "prompt"),
    ("prompt-mixed-types", COMP, comp(prompt=[1, "a"]), 400, None),
    ("prompt-lone-surrogate", COMP, '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt"),
    ("temperature-5", CHAT, chat(temperature=5), 400, "temperature"),
    ("temperature-negative", CHAT, chat(temperature=-0.1), 400, "temperature"),
    ("temperature-nan", CHAT, '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None),
    ("top-p-0", CHAT, chat(top_p=0), 400, "top_p"),
    ("top-p-above-1", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("top-k-below-minus-1", CHAT, chat(top_k=-5), 400, "top_k"),
    ("min-p-above-1", CHAT, chat(min_p=1.5), 400, "min_p"),
    ("max-tokens-0", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", COMP, comp(max_tokens=-3), 400, "max_tokens"),
    ("max-completion-tokens-0", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("top-logprobs-50", CHAT, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("top-logprobs-negative", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    ("completion-logprobs-50", COMP, comp(logprobs=50), 400, "logprobs"),
    ("presence-penalty-3", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("frequency-penalty-minus-3", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition-penalty-0", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("seed-too-large", CHAT, chat(seed=2**70), 400, "seed"),
    ("seed-too-small", CHAT, chat(seed=-(2**63) - 1), 400, "seed"),
    ("n-129", CHAT, chat(n=129), 400, "n"),
    ("n-0", COMP, comp(n=0), 400, "n"),
    ("echo-with-suffix", COMP, comp(echo=True, suffix="}"), 400, "echo"),
    ("chat-echo", CHAT, chat(echo=True), 400, "echo"),
    ("prompt-id-too-large", COMP, comp(prompt=[1, 2, 10**6]), 400, "prompt"),
    ("prompt-id-negative", COMP, comp(prompt=[-1]), 400, "prompt"),
    ("prompt-id-huge", COMP, comp(prompt=[2**70]), 400, "prompt"),
    ("logit-bias-key-word", CHAT, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit-bias-key-float", CHAT, chat(logit_bias={"5.5": 1}), 400, "logit_bias"),
    ("logit-bias-key-outside-vocab", CHAT, chat(logit_bias={"999999": 1}), 400, "logit_bias"),
    ("logit-bias-key-negative", CHAT, chat(logit_bias={"-1": 1}), 400, "logit_bias"),
    ("logit-bias-value-200", CHAT, chat(logit_bias={"5": 200}), 400, None),
    ("too-many-stops", CHAT, chat(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), 400, "stop"),
    ("stop-int", CHAT, chat(stop=5), 400, None),
    ("unknown-model-chat", CHAT, chat(model="gpt-4o"), 404, "model"),
    ("unknown-model-comp", COMP, comp(model="nope"), 404, "model"),
    ("unknown-model-streamed", CHAT, chat(model="nope", stream=True), 404, "model"),
    ("bad-input-streamed", CHAT, chat(temperature=9, stream=True), 400, "temperature"),
    # Output-changing extensions this server does not implement are named; bookkeeping is accepted.
    ("best-of", COMP, comp(best_of=3), 400, "best_of"),
    ("suffix", COMP, comp(suffix="}"), 400, "suffix"),
    ("guided-json", CHAT, chat(guided_json={"type": "object"}), 400, "guided_json"),
    ("functions", CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    ("several-bad-fields", CHAT, chat(temperature=5, top_p=0, min_tokens=3, bogus=1), 400, "temperature, top_p, min_tokens"),
]


@pytest.fixture(scope="module")
def small_server(make_module_server, qwen3_model_dir):
    return make_module_server(qwen3_model_dir, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def http(small_server):
    with httpx.Client(base_url=small_server.url, timeout=60) as c:
        yield c


def send(http, path, body) -> httpx.Response:
    if isinstance(body, str):
        return http.post(path, content=body.encode(), headers={"content-type": "application/json"})
    return http.post(path, json=body)


def assert_error_shape(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    return error


@pytest.mark.parametrize("path, body, status, param", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_gets_openai_error(http, path, body, status, param):
    error = assert_error_shape(send(http, path, body), status)
    if param is not None:
        assert error["param"] == param


def test_unknown_model_error_code(http):
    error = assert_error_shape(send(http, CHAT, chat(model="gpt-4o")), 404)
    assert error["code"] == "model_not_found"
    assert "gpt-4o" in error["message"]


def test_context_length_message_names_both_numbers(http):
    # 60 prompt ids + 10 new tokens > 64.
    error = assert_error_shape(send(http, COMP, comp(prompt=[5] * 60, max_tokens=10)), 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "max_tokens"
    numbers = set(re.findall(r"\d+", error["message"]))
    assert {"64", "60", "10"} <= numbers


def test_prompt_alone_beyond_context(http):
    error = assert_error_shape(send(http, COMP, comp(prompt=[5] * 80, max_tokens=None)), 400)
    assert error["code"] == "context_length_exceeded"
    assert {"80", "64"} <= set(re.findall(r"\d+", error["message"]))


def test_chat_beyond_context(http):
    long = [{"role": "user", "content": "word " * 100}]
    error = assert_error_shape(send(http, CHAT, chat(messages=long, max_tokens=4)), 400)
    assert error["code"] == "context_length_exceeded"


def test_exactly_at_context_limit_is_accepted(http):
    r = send(http, COMP, comp(prompt=[5] * 60, max_tokens=4, ignore_eos=True))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (60, 4, 64)


def test_default_max_tokens_fills_the_context(http):
    body = without(comp(prompt=[5] * 50, ignore_eos=True), "max_tokens")
    r = send(http, COMP, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 50
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_wrong_method_and_unknown_path(http):
    assert_error_shape(http.get(CHAT), 405)
    assert_error_shape(http.get("/v1/nothing-here"), 404)
    head = http.head(CHAT)  # HEAD is GET without the body: the same 405, no body
    assert head.status_code == 405 and head.headers["allow"] == "POST" and head.content == b""


@pytest.mark.parametrize("path", ["/", "/health", "/v1/models", "/metrics"])
def test_head_is_get_without_the_body(http, path):
    # Claude Code sends `HEAD /` before every run.
    r = http.head(path)
    assert r.status_code == 200 and r.content == b""


def test_several_bad_fields_are_one_400_naming_each(http):
    error = assert_error_shape(send(http, CHAT, chat(temperature=5, top_p=0, n=0, use_beam_search=True)), 400)
    assert error["message"].startswith("4 problems: ") and "more problem" not in error["message"]
    for field in ("temperature", "top_p", "n", "use_beam_search"):
        assert f"{field}: " in error["message"]


def test_bookkeeping_and_unknown_fields_are_accepted(http):
    r = send(http, CHAT, chat(store=False, metadata={"k": "v"}, service_tier="auto", prompt_cache_key="p",
                              safety_identifier="s", verbosity="low", prediction={"type": "content", "content": "x"},
                              reasoning_effort="xhigh", stream_options=None, bogus=1))
    assert r.status_code == 200, r.text


def test_openai_client_raises_typed_errors(small_server):
    with openai.OpenAI(base_url=small_server.base_url, api_key="x", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as exc:
            client.chat.completions.create(model="nope", messages=M)
        assert exc.value.status_code == 404
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="tiny", messages=M, temperature=5)
        assert exc.value.body["param"] == "temperature"


@pytest.mark.parametrize("extra", [{"seed": -1}, {"seed": 2**64 - 1}, {"top_k": 10**6}, {"stop": ""}, {"stop": []},
                                   {"min_p": 1.0}, {"top_p": 1e-9}, {"temperature": 1e-30}],
                         ids=["seed-neg", "seed-max", "top-k-huge", "stop-empty", "stops-empty", "min-p-1",
                              "top-p-tiny", "temp-tiny"])
def test_edge_values_are_served(http, extra):
    r = send(http, COMP, comp(max_tokens=3, ignore_eos=True, **extra))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_server_still_serves_after_bad_inputs_and_never_5xx(http, small_server):
    for _, path, body, status, _ in BAD:
        assert send(http, path, body).status_code == status
    for extra in ({"seed": 2**70}, {"top_k": 10**6}):
        send(http, COMP, comp(**extra))
    # Unseeded sampling after all that: it uses mx.random's global state, which a failing step could break.
    for temperature in (0.0, 1.0):
        ok = send(http, CHAT, chat(max_tokens=4, temperature=temperature, ignore_eos=True))
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 4
    metrics = small_server.metrics()
    assert metrics['mlxhost_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 2
    assert metrics['mlxhost_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 1
    assert not [k for k in metrics if re.search(r'status="5\d\d"', k)]
    assert metrics["mlxhost_num_requests_running"] == 0

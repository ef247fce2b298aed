"""Tool calling, structured output and reasoning through the official `openai` client, on the random-weight
demo fixture (its chat template takes tools, Hermes style). A random model never calls a tool or writes
JSON by itself: every valid call and document here is the grammar's doing."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from mlxhost.testing.demo import DemoModelConfig, build_model_folder
from mlxhost.testing.tag_tokens import add_tag_tokens

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client, model, **kw):
    """(content, reasoning, {index: (id, name, arguments)}, finish_reason) assembled from the chunks."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for tc in delta.tool_calls or ():
            cid, name, args = calls.get(tc.index, (None, None, ""))
            calls[tc.index] = (tc.id or cid, (tc.function.name if tc.function else None) or name,
                               args + ((tc.function.arguments or "") if tc.function else ""))
        finish = choice.finish_reason or finish
    return content, reasoning, calls, finish


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_are_schema_valid_whole_and_streamed(client, server, seed, choice):
    kw = dict(messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=1.0,
              seed=seed, max_tokens=120)
    whole = client.chat.completions.create(model=server.model_name, **kw)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    check_calls(msg.tool_calls)
    assert len(msg.tool_calls) == 1 and not msg.content
    if isinstance(choice, dict):
        assert msg.tool_calls[0].function.name == "get_time"
    content, _, calls, finish = streamed(client, server.model_name, **kw)
    assert finish == "tool_calls" and not content and "<tool_call>" not in content
    # Same seed, same tokens: the streamed fragments assemble to exactly the whole answer's arguments.
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments) for c in msg.tool_calls]


def test_parallel_required_calls_each_valid(client, server):
    r = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=7, max_tokens=400)
    calls = r.choices[0].message.tool_calls
    check_calls(calls)
    assert "<tool_call>" not in (r.choices[0].message.content or "")


def test_top_logprobs_of_a_forced_call_leave_out_masked_tokens(client, server):
    # Where the grammar allows fewer than top_logprobs tokens, the rest are -inf: left out, not a 500.
    r = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       temperature=0, max_tokens=12, logprobs=True, top_logprobs=5)
    entries = r.choices[0].logprobs.content
    assert entries and all(t.logprob > -1e9 and all(a.logprob > -1e9 for a in t.top_logprobs) for t in entries)
    assert any(len(t.top_logprobs) < 5 for t in entries)


def test_tool_round_trip(client, server):
    first = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False, seed=5, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})},
    ]
    second = client.chat.completions.create(model=server.model_name, messages=history, tools=TOOLS, max_tokens=16,
                                            temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_none_and_auto(client, server):
    none = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=16, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason != "tool_calls"
    auto = client.chat.completions.create(model=server.model_name, messages=MESSAGES, tools=TOOLS, max_tokens=16,
                                          temperature=0)
    msg = auto.choices[0].message
    if msg.tool_calls:
        check_calls(msg.tool_calls)
    else:
        assert msg.content and "<tool_call>" not in msg.content


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format(client, server, stream):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 100},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
              "required": ["name", "score", "tags"], "additionalProperties": False}
    kw = dict(messages=MESSAGES, max_tokens=120, temperature=1.0, seed=3,
              response_format={"type": "json_schema", "json_schema": {"name": "card", "schema": schema, "strict": True}})
    if stream:
        text, _, _, finish = streamed(client, server.model_name, **kw)
    else:
        r = client.chat.completions.create(model=server.model_name, **kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_json_object_response_format(client, server):
    r = client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=200, temperature=0.7,
                                       seed=11, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # any object is allowed, so a random model may run to max_tokens: the prefix is still an object's
        assert r.choices[0].message.content.startswith("{")


def test_thinking_goes_to_reasoning_content(client, server):
    kw = dict(messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    r = client.chat.completions.create(model=server.model_name, **kw)
    msg = r.choices[0].message
    assert msg.model_extra.get("reasoning_content") and not msg.content
    content, reasoning, _, _ = streamed(client, server.model_name, **kw)
    assert not content and reasoning == msg.model_extra["reasoning_content"]


@pytest.mark.parametrize("kw, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
    ({"tools": TOOLS, "tool_choice": "required", "extra_body": {"ignore_eos": True}}, "ignore_eos"),
])
def test_bad_requests_are_400s_naming_the_field(client, server, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=8, **kw)
    assert err.value.body["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_leaves_no_tag_text(client, server, stream):
    """Cut inside its forced call, a reply has neither the call nor its half-written text, in all three dialects."""
    kw = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=10)
    if stream:
        content, _, calls, finish = streamed(client, server.model_name, **kw)
    else:
        r = client.chat.completions.create(model=server.model_name, **kw)
        content, calls, finish = r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason
    assert finish == "length" and not content and not calls

    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    akw = dict(model=server.model_name, max_tokens=10, messages=MESSAGES, tool_choice={"type": "any"},
               tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS],
               extra_body={"temperature": 0})
    if stream:
        with claude.messages.stream(**akw) as s:
            message = s.get_final_message()
    else:
        message = claude.messages.create(**akw)
    assert message.stop_reason == "max_tokens" and not [b for b in message.content if b.type == "text" and b.text]

    rkw = dict(model=server.model_name, input="Weather in Paris?", tool_choice="required", temperature=0,
               max_output_tokens=10, tools=[{"type": "function", "name": t["function"]["name"],
                                             "parameters": t["function"]["parameters"]} for t in TOOLS])
    if stream:
        events = list(client.responses.create(stream=True, **rkw))
        assert not [e for e in events if e.type == "response.output_text.delta"]
        response = events[-1].response
    else:
        response = client.responses.create(**rkw)
    assert response.status == "incomplete" and response.output_text == ""


# Its `<think>` tokens make it a reasoning model, which a random one never leaves: answer directly.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def tagged_server(tmp_path_factory, make_module_server):
    """The demo model with `<tool_call>`, `</tool_call>`, `<think>`... as added tokens, as in Qwen's tokenizer."""
    folder = build_model_folder(tmp_path_factory.mktemp("tagged"), DemoModelConfig(vocab_size=2064))
    add_tag_tokens(folder)
    return make_module_server(folder, max_num_seqs=8, prefill_step_size=64)


@pytest.fixture(scope="module")
def tagged_client(tagged_server):
    with openai.OpenAI(base_url=tagged_server.base_url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_when_the_tag_is_a_token(tagged_client, tagged_server, choice):
    kw = dict(messages=MESSAGES, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=1.0, seed=4,
              max_tokens=200, extra_body=NO_THINKING)
    whole = tagged_client.chat.completions.create(model=tagged_server.model_name, **kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    check_calls(whole.choices[0].message.tool_calls)
    content, _, calls, finish = streamed(tagged_client, tagged_server.model_name, **kw)
    assert finish == "tool_calls" and not content and calls


def test_a_grammar_that_cannot_go_on_is_a_400_or_a_stream_error(tagged_client, tagged_server):
    # A forced string that spells an added token is one llguidance cannot follow (its mask offers the
    # token, then refuses it): the request ends with the grammar's reason, as a 400, never a 500.
    schema = {"type": "object", "properties": {"tag": {"const": "<tool_call>"}}, "required": ["tag"]}
    kw = dict(messages=MESSAGES, max_tokens=40, temperature=0, extra_body=NO_THINKING,
              response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    with pytest.raises(openai.BadRequestError) as err:
        tagged_client.chat.completions.create(model=tagged_server.model_name, **kw)
    assert err.value.body["code"] == "grammar_failed"
    assert "json_schema grammar could not continue" in err.value.body["message"]
    body = {"model": tagged_server.model_name, "stream": True, **{k: v for k, v in kw.items() if k != "extra_body"},
            **NO_THINKING}
    with httpx.stream("POST", tagged_server.base_url + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert errors and "grammar could not continue" in errors[0]["message"]
    assert errors[0]["type"] == "invalid_request_error" and errors[0]["code"] == "grammar_failed"
    # The server goes on serving.
    ok = tagged_client.chat.completions.create(model=tagged_server.model_name, messages=MESSAGES, max_tokens=4)
    assert ok.choices[0].finish_reason in ("stop", "length")

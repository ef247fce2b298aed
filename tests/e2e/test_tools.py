"""Tool calling, structured output and reasoning through the official `openai` client, on the random-weight
demo fixture (its chat template takes tools, Hermes style). A random model never calls a tool or writes
JSON by itself: every valid call and document here is the grammar's doing."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

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

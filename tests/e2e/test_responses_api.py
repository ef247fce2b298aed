"""OpenAI Responses through the official `openai` client, on the random-weight demo fixture. Function calls
are valid because the grammar forces them (`tool_choice="required"`); temperature 0 makes a streamed and a
whole response the same tokens."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city", "parameters": WEATHER,
          "strict": True}]


def test_create_plain(client, server):
    r = client.responses.create(model=server.model_name, input="Say hi.", instructions="Be brief.",
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert isinstance(r.output_text, str) and r.output_text
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.usage.output_tokens_details.reasoning_tokens == 0


def test_stream_events_and_text(client, server):
    kw = dict(model=server.model_name, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
              max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 10 and final.id == events[0].response.id


def check_call(item) -> None:
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_")
    jsonschema.validate(json.loads(item.arguments), WEATHER)


def test_forced_function_call_whole_and_streamed(client, server):
    kw = dict(model=server.model_name, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1
    check_call(calls[0])
    # The SDK's stream helper assembles the events into the same response.
    with client.responses.stream(**kw) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    assert types.index("response.output_item.added") < types.index("response.function_call_arguments.done")
    streamed = [o for o in final.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]


def test_json_schema_text_format(client, server):
    schema = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["score"], "additionalProperties": False}
    r = client.responses.create(model=server.model_name, input="Rate it.", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "rating", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_chaining_with_previous_response_id(client, server):
    first = client.responses.create(model=server.model_name, input="Weather in Paris?", tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=120)
    call = next(o for o in first.output if o.type == "function_call")
    second = client.responses.create(model=server.model_name, previous_response_id=first.id, tools=TOOLS,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": json.dumps({"temp_c": 21})}], max_output_tokens=4)
    assert second.previous_response_id == first.id
    # The stored conversation (first input + its call) comes before the new input.
    assert second.usage.input_tokens > first.usage.input_tokens
    # Tools are per request (not carried over), as on OpenAI's: the same ones keep the prompt's start.
    third = client.responses.create(model=server.model_name, previous_response_id=second.id, input="Thanks.",
                                    tools=TOOLS, max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens
    assert third.usage.input_tokens_details.cached_tokens > 0  # the prefix cache held the conversation so far


def test_store_false_is_not_chainable(client, server):
    r = client.responses.create(model=server.model_name, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=server.model_name, input="Again", previous_response_id=r.id,
                                max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_get_and_delete(client, server):
    r = client.responses.create(model=server.model_name, input="Hi", max_output_tokens=3, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    deleted = httpx.delete(f"{server.base_url}/responses/{r.id}", timeout=60)
    assert deleted.status_code == 200 and deleted.json() == {"id": r.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "response_format"),
    ({"background": True}, "background"),
    ({"background": True, "temperature": 3, "extra_body": {"top_logprobs": 2}}, "temperature, background, top_logprobs"),
])
def test_bad_requests_are_400s(client, server, kw, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=server.model_name, input="Hi", max_output_tokens=2, **kw)
    assert err.value.body["param"] == param


def test_codex_fields_and_tools_are_accepted(client, server):
    # What Codex CLI sends besides input: bookkeeping (client_metadata, prompt_cache_key, include), a
    # namespace of function tools (flattened: the model sees its functions) and a hosted tool (skipped).
    namespace = {"type": "namespace", "name": "agents", "description": "Sub-agents.",
                 "tools": [{**TOOLS[0], "name": "spawn_agent"}]}
    r = client.responses.create(
        model=server.model_name, input="Hi", max_output_tokens=120, temperature=0, store=False,
        include=["reasoning.encrypted_content"], prompt_cache_key="k", reasoning={"summary": "auto"},
        tools=[namespace, {"type": "web_search", "external_web_access": False}], tool_choice="required",
        parallel_tool_calls=False, extra_body={"client_metadata": {"turn_id": "t1"}, "bogus": 1})
    assert r.metadata == {"mlxhost_skipped_tools": "web_search"}
    calls = [item for item in r.output if item.type == "function_call"]
    assert [(c.name, c.namespace) for c in calls] == [("spawn_agent", "agents")]

"""SmolLM2 served from its GGUF: streamed text equals the whole on real multi-byte text, structured output
parses, and the second turn of a conversation reuses the first turn's prefix through the real template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.needs("smollm2")

MULTIBYTE = "Café naïve, 東京タワー, 你好, 🎉👍🏽"
FORCED = "né 東京 🎉👍🏽"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "country": {"type": "string", "maxLength": 20}},
          "required": ["city", "country"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(smollm2_server):
    with openai.OpenAI(base_url=smollm2_server.base_url, api_key="x", max_retries=0, timeout=300) as c:
        yield c


def _chat(client, messages, stream: bool = False, **kw):
    args = dict(model="tiny", messages=messages, temperature=0.0, **kw)
    if not stream:
        r = client.chat.completions.create(**args)
        return r.choices[0].message.content, r.usage
    text, usage = [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        usage = chunk.usage or usage
        text += [c.delta.content or "" for c in chunk.choices]
    return "".join(text), usage


def test_streamed_equals_whole_on_multibyte_text(client):
    # Emoji and CJK characters span several byte-level tokens: a stream that cut inside a character would
    # show U+FFFD or differ from the whole text.
    messages = [{"role": "user", "content": f"Repeat exactly: {MULTIBYTE}"}]
    whole, usage = _chat(client, messages, max_tokens=12)
    streamed, _ = _chat(client, messages, stream=True, max_tokens=12)
    assert streamed == whole
    # Only a character cut by max_tokens may end the text unfinished (U+FFFD), as in every OpenAI server.
    assert "\ufffd" not in whole.rstrip("\ufffd")
    assert any(ord(ch) > 0x2E80 for ch in whole), whole  # it did write CJK or emoji
    assert usage.completion_tokens == 12


def test_forced_multibyte_text_streams_whole(client):
    # An enum schema forces every byte of the string, wherever the tokens split it.
    schema = {"type": "object", "properties": {"s": {"enum": [FORCED]}}, "required": ["s"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Say something."}]
    whole, _ = _chat(client, messages, max_tokens=40, response_format=fmt)
    streamed, _ = _chat(client, messages, stream=True, max_tokens=40, response_format=fmt)
    assert json.loads(whole) == {"s": FORCED}
    assert streamed == whole


def test_json_schema_output_parses(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    text, _ = _chat(client, [{"role": "user", "content": "Where is the Eiffel Tower? Answer in JSON."}],
                    max_tokens=40, response_format=fmt)
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)


def test_second_turn_reuses_the_first_turns_prefix(client):
    system = {"role": "system", "content": "You are a concise assistant. Answer in one short sentence. "
                                           "Geography questions get the capital city only."}
    turn1 = [system, {"role": "user", "content": "What is the capital of France?"}]
    answer, first = _chat(client, turn1, max_tokens=8)
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Italy?"}]
    _, second = _chat(client, turn2, max_tokens=4)
    cached = second.prompt_tokens_details.cached_tokens
    # Everything up to the end of turn 1's prompt is the same tokens under the ChatML template.
    assert cached > 0
    assert cached >= first.prompt_tokens - 16  # whole 16-token blocks of turn 1's prompt

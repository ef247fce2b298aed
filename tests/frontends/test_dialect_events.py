"""The Anthropic and Responses renderers over a reply with reasoning, text and a tool call, without a
model: streamed events and whole objects agree, and follow each dialect's grammar."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from mlxhost.engine.request import RequestOutput
from mlxhost.frontends.anthropic.protocol import MessagesRequest
from mlxhost.frontends.anthropic.render import MessageBuilder
from mlxhost.frontends.anthropic.translate import to_chat_request
from mlxhost.frontends.common.errors import APIError
from mlxhost.frontends.common.gateway import Whole
from mlxhost.frontends.common.sse import heartbeats
from mlxhost.frontends.common.stream import stream as stream_frames
from mlxhost.frontends.responses.protocol import ResponsesRequest
from mlxhost.frontends.responses.render import ResponseFrames, ResponseRenderer
from mlxhost.frontends.responses.translate import chat_messages, input_items
from mlxhost.serving.chat_output import OutputSpec

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
SPEC = OutputSpec(reasoning_tags=("<think>", "</think>"), starts_in_reasoning=True, tool_format="hermes", tools=TOOLS)
REPLY = ["mull", "ing</think>Hel", "lo<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>"]
EOS = 7


def outputs(finish: str = "stop") -> list[RequestOutput]:
    n = len(REPLY)
    return [RequestOutput("r", [EOS if i == n - 1 and finish == "stop" else 1], text, 10, i + 1,
                          finish if i == n - 1 else None, num_cached_tokens=4) for i, text in enumerate(REPLY)]


def opened(progress=None) -> SimpleNamespace:
    return SimpleNamespace(prepared=SimpleNamespace(output=SPEC, request=SimpleNamespace(num_prompt_tokens=10)),
                           model=SimpleNamespace(tokenizer=None, eos_token_ids=frozenset({EOS})),
                           progress=lambda: progress)


def test_anthropic_stream_and_whole_agree():
    builder = MessageBuilder("m", opened(), ())
    outs = outputs()
    text = builder.start() + "".join(builder.chunk(o) for o in outs) + builder.stop(outs[-1])
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert types.count("content_block_stop") == 3
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    # Sent before the prefill: the whole prompt counts as input; the end has the split (4 from the cache).
    assert events[0]["message"]["usage"]["input_tokens"] == 10
    assert events[-2]["usage"]["input_tokens"] == 6 and events[-2]["usage"]["cache_read_input_tokens"] == 4
    partial = "".join(e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta")
    whole = MessageBuilder("m", opened(), ()).message(Whole("".join(REPLY), [1, 1, EOS], [], outs[-1]))
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    assert whole["content"][2]["input"] == json.loads(partial) == {"x": 1}
    assert whole["content"][0]["thinking"] == "mulling" and whole["content"][1]["text"] == "Hello"
    assert whole["usage"] == {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4,
                              "cache_creation_input_tokens": 0}


def test_responses_stream_and_whole_agree():
    renderer = ResponseRenderer({"id": "resp_1", "object": "response"}, SPEC)
    events = renderer.begin()
    outs = outputs()
    for o in outs:
        events += renderer.feed(o.text, final=o.finished)
    response, done = renderer.finish(outs[-1])
    events.append(done)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == added
    assert done["type"] == "response.completed" and response["status"] == "completed"
    reasoning, message, call = response["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "mulling"}]
    assert message["content"][0]["text"] == "Hello" and call["arguments"] == '{"x":1}'
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": 4}

    whole = ResponseRenderer({"id": "resp_2"}, SPEC)
    whole.feed("".join(REPLY), final=True)
    def strip(items):  # ids are fresh each time
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]

    assert strip(whole.finish(outs[-1])[0]["output"]) == strip(response["output"])


def test_responses_items_round_trip_into_chat_messages():
    renderer = ResponseRenderer({"id": "resp_1"}, SPEC)
    renderer.feed("".join(REPLY), final=True)
    body = ResponsesRequest(model="m", input=[{"role": "developer", "content": "rules"},
                                              {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                           {"type": "input_text", "text": "b"}]}])
    conversation = input_items(body) + renderer.items
    conversation.append({"type": "function_call_output", "call_id": renderer.items[2]["call_id"], "output": "ok"})
    messages = chat_messages(conversation)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[1]["content"] == "a\nb"
    assistant = messages[2]
    assert assistant["content"] == "Hello" and assistant["reasoning_content"] == "mulling"
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x":1}'}


def test_anthropic_translation():
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "stop_sequences": ["END"],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "x"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "text", "text": "and"},
                                         {"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]}]})
    chat = to_chat_request(body)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[2].tool_calls[0].function.arguments == {"a": 1} and chat.messages[2].reasoning_content == "t"
    assert chat.messages[4].content[1].url == "data:image/png;base64,AAAA"
    assert chat.tool_choice.function.name == "f" and chat.parallel_tool_calls is False
    assert chat.chat_template_kwargs == {"enable_thinking": True} and chat.stop == ["END"]


def test_anthropic_blocks_in_the_wrong_turn_are_400s():
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
        {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "r"}]}]})
    with pytest.raises(APIError) as err:
        to_chat_request(body)
    assert err.value.status == 400 and err.value.param == "messages.0.content.0"


# -- heartbeats while the prompt prefills ------------------------------------------------------------------


class SlowOutputs:
    """Engine outputs that come only once the test lets them (a prefill that lasts as long as it must), and
    note whether the stream was left early (the engine's streams abort their request then)."""

    def __init__(self, outs: list[RequestOutput]) -> None:
        self.outs, self.go, self.left = outs, asyncio.Event(), False

    async def __aiter__(self):
        try:
            await self.go.wait()
            for o in self.outs:
                yield o
        except asyncio.CancelledError:
            self.left = True
            raise


def timer(every_s: float) -> SimpleNamespace:
    return SimpleNamespace(heartbeat_s=every_s, on_output=lambda out: None, done=lambda out: None)


async def read_until_heartbeats(stream, source: SlowOutputs, is_heartbeat, num: int) -> list[str]:
    """The stream's frames; the outputs are let through once `num` heartbeats came."""
    frames, beats = [], 0
    async for frame in stream:
        frames.append(frame)
        beats += is_heartbeat(frame)
        if beats == num:
            source.go.set()
    return frames


def test_anthropic_stream_starts_at_once_and_pings_until_the_first_token():
    source = SlowOutputs(outputs())
    stream = stream_frames(source.__aiter__(), MessageBuilder("m", opened(), ()), timer(0.01))
    frames = asyncio.run(read_until_heartbeats(stream, source, lambda f: f == MessageBuilder.ping(), 3))
    names = [line[len("event: "):] for f in frames for line in f.splitlines() if line.startswith("event: ")]
    # message_start and a ping at once, then a ping per quiet interval, then the reply.
    first = names.index("content_block_start")
    assert names[0] == "message_start" and first >= 4 and set(names[1:first]) == {"ping"}
    assert "ping" not in names[first:] and names[-1] == "message_stop"


def test_anthropic_pings_carry_the_prefill_progress():
    progress = {"id": "r", "state": "prefilling", "prefill_tokens": 8000, "prefilled_tokens": 3072,
                "cached_tokens": 1024, "prefill_tokens_per_s": 51.2, "output_tokens": 0, "priority": 0}
    source = SlowOutputs(outputs())
    stream = stream_frames(source.__aiter__(), MessageBuilder("m", opened(progress), ()), timer(0.01))
    frames = asyncio.run(read_until_heartbeats(stream, source, lambda f: f.startswith("event: ping"), 2))
    pings = [json.loads(f.split("data: ", 1)[1]) for f in frames if f.startswith("event: ping")]
    assert pings[0] == {"type": "ping", "prefill": {"state": "prefilling", "prefilled_tokens": 3072,
                                                    "prefill_tokens": 8000, "cached_tokens": 1024,
                                                    "prefill_tokens_per_s": 51.2}}
    assert MessageBuilder.ping({**progress, "state": "decoding"}) == MessageBuilder.ping()


def test_responses_stream_keeps_alive_with_in_progress_events():
    source = SlowOutputs(outputs())
    renderer = ResponseRenderer({"id": "resp_1", "object": "response"}, SPEC)
    done = []
    stream = stream_frames(source.__aiter__(), ResponseFrames(renderer, done.append), timer(0.01))

    def is_beat(frame: str) -> bool:
        return frame.startswith("event: response.in_progress\n")

    frames = asyncio.run(read_until_heartbeats(stream, source, is_beat, 2))
    assert "event: response.created" in frames[0] and "event: response.in_progress" in frames[0]
    first = next(i for i, f in enumerate(frames) if not is_beat(f) and i > 0)
    assert first >= 3 and all(is_beat(f) for f in frames[1:first]) and not any(is_beat(f) for f in frames[first:])
    beats = [json.loads(f.split("data: ", 1)[1]) for f in frames[1:first]]
    seqs = [b["sequence_number"] for b in beats]
    assert seqs == sorted(set(seqs)) and all(b["response"]["id"] == "resp_1" for b in beats)
    assert all(b["response"]["status"] == "in_progress" and b["response"]["output"] == [] for b in beats)
    assert "response.output_item.added" in frames[first] and done and done[0]["status"] == "completed"


def test_leaving_during_the_prefill_stops_the_engine_stream():
    async def main() -> SlowOutputs:
        source = SlowOutputs(outputs())
        beats = heartbeats(source.__aiter__(), 0.01)
        assert await anext(beats) is None  # a heartbeat: no output yet
        await beats.aclose()  # the client left
        await asyncio.sleep(0)  # the cancellation lands
        return source

    assert asyncio.run(main()).left


def test_heartbeats_pass_outputs_through_and_end_with_them():
    async def main() -> list:
        async def quick():
            for o in outputs():
                yield o

        return [o async for o in heartbeats(quick(), 5.0)]

    assert [o.text for o in asyncio.run(main())] == REPLY

"""The official openai and anthropic clients through a prefill that outlasts several heartbeat intervals: the
keep-alive chunks and events parse without error, and the answer follows. The engine is held between steps
(no timing assumption); the heartbeat interval is shortened."""

from __future__ import annotations

import threading

import anthropic
import openai
import pytest

from tests.e2e.test_streaming import HELLO, engine_held, fast_heartbeat  # noqa: F401 (a fixture)

_BOUND_S = 60  # hang bounds, not timing checks
NUM_BEATS = 3


def consume(stream, is_beat, release_engine) -> tuple[list, int]:
    """The stream's items; the engine is let go once NUM_BEATS heartbeats were parsed."""
    items, beats = [], 0
    for item in stream:
        items.append(item)
        beats += is_beat(item)
        if beats == NUM_BEATS:
            release_engine()
    return items, beats


def test_openai_chat_stream_parses_keep_alive_chunks_then_the_answer(server, fast_heartbeat):  # noqa: F811
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=_BOUND_S, max_retries=0)
    with engine_held(server) as (_, release):
        stream = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, temperature=0,
                                                stream=True)

        def is_beat(chunk) -> bool:
            delta = chunk.choices[0].delta if chunk.choices else None
            return delta is not None and delta.content is None and delta.role is None and not chunk.choices[0].finish_reason

        chunks, beats = consume(stream, is_beat, release)
    assert beats >= NUM_BEATS
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)  # the answer came after the beats


def test_openai_completions_stream_parses_keep_alive_chunks(server, fast_heartbeat):  # noqa: F811
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=_BOUND_S, max_retries=0)
    with engine_held(server) as (_, release):
        stream = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0, stream=True)
        chunks, beats = consume(stream, lambda c: c.choices[0].text == "" and not c.choices[0].finish_reason,
                                release)
    assert beats >= NUM_BEATS and chunks[-1].choices[0].finish_reason == "length"


def test_openai_responses_stream_parses_repeated_in_progress_events(server, fast_heartbeat):  # noqa: F811
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=_BOUND_S, max_retries=0)
    # The SDK's stream helper keeps a snapshot of the response and checks each lifecycle event against it.
    with engine_held(server) as (_, release), client.responses.stream(model="tiny", input="hello",
                                                                      max_output_tokens=4) as stream:
        events, beats = consume(stream, lambda e: e.type == "response.in_progress", release)
    assert beats >= NUM_BEATS
    assert events[-1].type == "response.incomplete"  # max_output_tokens reached
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_anthropic_stream_skips_pings_and_gets_the_answer(server, fast_heartbeat):  # noqa: F811
    client = anthropic.Anthropic(base_url=server.url, api_key="x", timeout=_BOUND_S, max_retries=0)
    seen = []
    with engine_held(server) as (_, release):
        # The SDK skips ping events (the wire test below counts them): the engine is let go after several
        # heartbeat intervals (a hold, not a timing check).
        timer = threading.Timer(0.3, release)
        timer.start()
        with client.messages.stream(model="tiny", messages=HELLO, max_tokens=4) as stream:
            for event in stream:
                seen.append(event.type)
            message = stream.get_final_message()
        timer.join()
    assert seen[0] == "message_start" and "ping" not in seen
    assert message.stop_reason == "max_tokens" and message.content


def test_whole_replies_are_plain_json_after_a_long_prefill(server, fast_heartbeat):  # noqa: F811
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=_BOUND_S, max_retries=0)
    result = {}
    with engine_held(server) as (_, release):
        t = threading.Thread(target=lambda: result.setdefault("reply", client.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=4, temperature=0)))
        t.start()
        t.join(0.3)  # several heartbeat intervals while the engine is held (a hang bound, not a timing check)
        release()
        t.join(_BOUND_S)
    assert result["reply"].choices[0].message.content is not None


@pytest.mark.parametrize("path", ["/v1/messages"])
def test_anthropic_pings_are_events_on_the_wire(server, fast_heartbeat, path):  # noqa: F811
    import httpx

    body = {"model": "tiny", "messages": HELLO, "max_tokens": 4, "stream": True}
    with engine_held(server) as (_, release), httpx.Client(timeout=_BOUND_S) as c, \
            c.stream("POST", server.url + path, json=body) as r:
        lines = r.iter_lines()
        pings = 0
        for line in lines:
            pings += line == "event: ping"
            if pings == NUM_BEATS:
                release()
                break
        rest = list(lines)
    assert any("message_stop" in line for line in rest)

"""Streaming text: whole UTF-8 characters only, stop strings across chunks, and disconnects that free slots.

The random fixture model cannot be made to emit an emoji, so the detokenizer is tested on its own with the
fixture tokenizer, feeding the ids of real multi-byte text one at a time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time

import httpx
import pytest
from mlx_lm.utils import load_tokenizer

from mlxhost.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

UTF8_TEXTS = [
    "emoji 😀🚀 flag 🇯🇵 family 👨‍👩‍👧 heart ❤️",
    "rare 𝄞 🦀 ꙮ 龘 Ꮚ",
    "你好，世界！日本語のテキスト 한국어",
    "héllo naïve café Ångström",
    " leading space, then\ttabs\nand newlines\n\n",
]
_POLL_S = 0.05
_BOUND_S = 60  # bounds for polling loops: a hang fails the test instead of blocking the suite


@pytest.fixture(scope="module")
def tokenizer(qwen3_model_dir):
    return load_tokenizer(qwen3_model_dir)


# -- the detokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", UTF8_TEXTS)
def test_detokenizer_never_emits_a_broken_character(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    for piece in pieces:
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # no lone surrogates either
    assert "".join(pieces) == text


def test_detokenizer_holds_back_split_characters(tokenizer):
    # Characters the tokenizer never merged are split into byte tokens: the detokenizer must wait for
    # the last byte instead of emitting U+FFFD.
    text = "rare 𝄞 🦀 ꙮ 龘 Ꮚ"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split()), "expected byte-level tokens for rare characters"
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = [detok.add(t) for t in ids]
    assert "" in pieces  # at least one token completed no character
    assert "".join(pieces) + detok.flush() == text


def test_detokenizer_keeps_the_leading_space(tokenizer):
    # mlx-lm's streaming detokenizer drops it; /v1/completions must keep "Hello" + " world".
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"))
    out = "".join(detok.add(t) for t in tokenizer.encode(" world, again")) + detok.flush()
    assert out == " world, again"


def test_detokenizer_flush_shows_a_truncated_character(tokenizer):
    ids = tokenizer.encode("🦀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add(ids[0]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_detokenizer_skips_special_tokens(tokenizer):
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer, [])
    out = [detok.add(t) for t in tokenizer.encode("ok")] + [detok.add(eos), detok.flush()]
    assert "".join(out) == "ok"


# -- stop strings ------------------------------------------------------------------------------------


def feed_all(matcher: StopStringMatcher, chunks) -> tuple[list[str], bool]:
    out = []
    for chunk in chunks:
        text, hit = matcher.feed(chunk)
        out.append(text)
        if hit:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_inside_one_chunk():
    out, hit = feed_all(StopStringMatcher(["END"]), ["abcENDxyz"])
    assert hit and out == ["abc"]


def test_stop_across_chunk_boundaries():
    out, hit = feed_all(StopStringMatcher(["STOP"]), ["hello S", "T", "O", "P and more"])
    assert hit
    assert "".join(out) == "hello "
    assert out[0] == "hello "  # "S" is held back from the first chunk


def test_held_back_prefix_is_released_when_it_is_not_a_stop():
    m = StopStringMatcher(["STOP"])
    assert m.feed("ab ST") == ("ab ", False)
    assert m.feed("ON") == ("STON", False)
    assert m.feed("xS") == ("x", False)
    assert m.flush() == "S"  # the end of the generation releases what was held
    assert m.flush() == ""


def test_no_stop_strings_passes_text_through():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    m = StopStringMatcher([""])  # an empty stop string is ignored, not a match everywhere
    assert m.feed("abc") == ("abc", False)


def test_multiple_stop_strings_earliest_match_wins():
    out, hit = feed_all(StopStringMatcher(["world", "lo w"]), ["hel", "lo world"])
    assert hit and "".join(out) == "hel"
    out, hit = feed_all(StopStringMatcher(["zzz", "b"]), ["aab", "zzz"])
    assert hit and "".join(out) == "aa"


def test_overlapping_prefixes_hold_the_longest():
    m = StopStringMatcher(["abc", "bcd"])
    assert m.feed("xab") == ("x", False)  # "ab" could start "abc"
    assert m.feed("cd") == ("", True)  # "abc" found first (at 1), before "bcd" (at 2)


def test_stop_string_longer_than_chunks_and_repeated_prefix():
    out, hit = feed_all(StopStringMatcher(["aab"]), ["a", "a", "a", "b", "c"])
    assert hit and "".join(out) == "a"


# -- disconnects free their slot (one slot, so the next request can only run once it is freed) -------

# A generation far longer than any test: if the slot is not freed, the second request never starts.
# Above the model's 4096 positions on purpose (the server only warns): rope works at any position.
LONG_CONTEXT = 65_536
LONG_MAX_TOKENS = 60_000


@pytest.fixture
def one_slot_server(make_server, qwen3_model_dir):
    return make_server(qwen3_model_dir, max_num_seqs=1, max_model_len=LONG_CONTEXT)


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + _BOUND_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(_POLL_S)


def next_event(lines) -> str:
    """The payload of the next SSE `data:` line."""
    while True:
        line = next(lines)
        if line.startswith("data: "):
            return line[6:]


def short_request_completes(live) -> None:
    r = httpx.post(live.base_url + "/completions", timeout=_BOUND_S,
                   json={"model": "tiny", "prompt": "after", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_closed_stream_frees_its_slot(one_slot_server, path):
    live = one_slot_server
    body = {"model": "tiny", "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "stream": True}
    body |= {"prompt": "go"} if path == "/completions" else {"messages": [{"role": "user", "content": "go"}]}
    with httpx.Client(timeout=_BOUND_S) as c:
        with c.stream("POST", live.base_url + path, json=body) as r:
            assert r.status_code == 200
            # next() instead of a for loop: leaving a for loop over httpx's iterator would close it here.
            lines = r.iter_lines()
            for _ in range(5):
                json.loads(next_event(lines))
            assert live.num_running() == 1
        # Leaving the block closes the connection mid-stream.
    short_request_completes(live)
    wait_until(lambda: live.num_running() == 0, "the running gauge to return to 0")
    assert live.metrics()["mlxhost_num_requests_waiting"] == 0


def test_timed_out_non_streaming_request_frees_its_slot(one_slot_server):
    live = one_slot_server
    body = {"model": "tiny", "prompt": "go", "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}
    failures = []

    def doomed():
        try:
            httpx.post(live.base_url + "/completions", json=body, timeout=httpx.Timeout(_BOUND_S, read=1.0))
        except httpx.ReadTimeout:
            return
        failures.append("the long request was expected to time out on the client side")

    thread = threading.Thread(target=doomed)
    thread.start()
    wait_until(lambda: live.num_running() == 1 or not thread.is_alive(), "the long request to start")
    thread.join(timeout=_BOUND_S)
    assert not failures
    short_request_completes(live)
    wait_until(lambda: live.num_running() == 0, "the running gauge to return to 0")


def test_waiting_request_runs_after_the_slot_frees(one_slot_server):
    # A second streamed request waits behind the first; aborting the first lets it through.
    live = one_slot_server
    long_body = {"model": "tiny", "prompt": "go", "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "stream": True}
    short_body = {"model": "tiny", "prompt": "next", "max_tokens": 4, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=_BOUND_S) as c1, httpx.Client(timeout=_BOUND_S) as c2:
        with c1.stream("POST", live.base_url + "/completions", json=long_body) as first:
            lines = first.iter_lines()
            next_event(lines)
            with c2.stream("POST", live.base_url + "/completions", json=short_body) as second:
                wait_until(lambda: live.metrics()["mlxhost_num_requests_waiting"] == 1, "the second to wait")
                first.close()
                events = [line for line in second.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    texts = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
    assert texts[-1]["finish_reason"] == "length"
    wait_until(lambda: live.num_running() == 0, "the running gauge to return to 0")


def test_full_queue_answers_429(make_server, qwen3_model_dir):
    live = make_server(qwen3_model_dir, max_num_seqs=1, max_num_waiting=1, max_model_len=LONG_CONTEXT)
    body = {"model": "tiny", "prompt": "go", "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=_BOUND_S) as c1, httpx.Client(timeout=_BOUND_S) as c2:
        with c1.stream("POST", live.base_url + "/completions", json=body) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the connection
            # Its first token: the engine runs it (the empty chunk before it goes out at once, while queued).
            while not json.loads(next_event(lines))["choices"][0]["text"]:
                pass
            with c2.stream("POST", live.base_url + "/completions", json=body) as waiting:
                wait_until(lambda: live.metrics()["mlxhost_num_requests_waiting"] == 1, "the second to wait")
                r = httpx.post(live.base_url + "/completions", json=body, timeout=_BOUND_S)
                assert r.status_code == 429
                assert r.headers["retry-after"]
                assert r.json()["error"]["type"] == "rate_limit_error"
                assert r.json()["error"]["code"] == "server_busy"
                assert waiting.status_code == 200
    short_request_completes(live)
    wait_until(lambda: live.num_running() == 0, "the running gauge to return to 0")


# -- streams show life while the prompt prefills ------------------------------------------------------


@contextlib.contextmanager
def engine_held(live):
    """The served engine stalled between two steps until `release()` or the block's end: a prefill that
    lasts as long as the test needs, without a timing assumption. (A call queued on the engine thread, as
    /v1/cache/stats runs its own; the test reaches the engine through the app.) Yields (engine, release)."""
    engine = next(iter(live.server.config.app.state.models.loaded_engines()))
    inside, release = threading.Event(), threading.Event()

    def hold(core) -> None:
        inside.set()
        release.wait(_BOUND_S)

    engine._inbox.put(("call", (hold, concurrent.futures.Future())))
    assert inside.wait(_BOUND_S)
    try:
        yield engine, release.set
    finally:
        release.set()


@pytest.fixture
def fast_heartbeat(monkeypatch):
    monkeypatch.setattr("mlxhost.frontends.common.gateway.HEARTBEAT_S", 0.05)


def read_heartbeats(lines, is_heartbeat, num: int) -> list[str]:
    """Lines up to and including the `num`-th heartbeat."""
    seen, beats = [], 0
    while beats < num:
        line = next(lines)
        seen.append(line)
        beats += is_heartbeat(line)
    return seen


HELLO = [{"role": "user", "content": "hello"}]


def data_of(line: str) -> dict | None:
    return json.loads(line[len("data: "):]) if line.startswith("data: {") else None


def empty_delta(line: str) -> bool:
    data = data_of(line)
    return data is not None and data["choices"] and data["choices"][0]["delta"] == {}


def empty_text(line: str) -> bool:
    data = data_of(line)
    return data is not None and data["choices"] and data["choices"][0]["text"] == ""


def empty_ollama_line(line: str) -> bool:
    data = json.loads(line) if line.startswith("{") else None
    return data is not None and not data["done"] and data["message"]["content"] == ""


# Every heartbeat is an event clients parse (and their idle timers count), never an SSE comment.
BEATS = [  # path, request fields, whether a line is the dialect's heartbeat, what its stream starts with, its end
    ("/v1/messages", {"max_tokens": 4, "messages": HELLO}, lambda line: line == "event: ping", "event: message_start",
     "message_stop"),
    ("/v1/responses", {"max_output_tokens": 4, "input": "hello"}, lambda line: line == "event: response.in_progress",
     "event: response.created", "response.incomplete"),  # max_output_tokens reached
    ("/v1/chat/completions", {"max_tokens": 4, "messages": HELLO}, empty_delta, "data: ", "[DONE]"),
    ("/v1/completions", {"max_tokens": 4, "prompt": "hello"}, empty_text, "data: ", "[DONE]"),
    ("/api/chat", {"options": {"num_predict": 4}, "messages": HELLO}, empty_ollama_line, "{", '"done": true'),
]


@pytest.mark.parametrize("path, fields, beat, first, last", BEATS, ids=[b[0] for b in BEATS])
def test_streams_start_at_once_and_beat_during_the_prefill(server, fast_heartbeat, path, fields, beat, first, last):
    body = {"model": "tiny", "stream": True, **fields}
    if path != "/api/chat":
        body["temperature"] = 0
    with httpx.Client(timeout=_BOUND_S) as c:
        with engine_held(server) as (_, release):
            with c.stream("POST", server.url + path, json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                head = [line for line in read_heartbeats(lines, beat, 3) if line]
                # The engine was held throughout: what came is the stream's start and heartbeats.
                assert head[0].startswith(first), head
                others = [line for line in head if not beat(line)]
                if path == "/v1/messages":
                    # message_start and its ping at once (the ping's lines are the beat's).
                    assert [line for line in others if line.startswith("event: ")] == ["event: message_start"]
                    start = json.loads(others[1][len("data: "):])
                    assert start["message"]["usage"]["input_tokens"] > 0
                elif path == "/v1/chat/completions":  # the role chunk, at once
                    assert len(others) == 1
                    assert json.loads(others[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                elif path == "/v1/responses":
                    assert [line for line in others if line.startswith("event: ")] == ["event: response.created"]
                else:  # an empty chunk or line at once, then the same while prefilling
                    assert others == [] or all(line.startswith("data: ") for line in others)
                release()  # the reply follows, and the stream ends as it always does
                tail = [line for line in lines if line.startswith(("data: ", "{"))]
    ends = [line.replace('"done":true', '"done": true') for line in tail]
    assert ends and last in ends[-1], tail[-3:]


def test_a_client_gone_during_the_prefill_aborts_its_request(server, fast_heartbeat):
    body = {"model": "tiny", "max_tokens": 2000, "ignore_eos": True, "messages": HELLO, "stream": True}
    with engine_held(server) as (engine, _):
        with httpx.Client(timeout=_BOUND_S) as c, c.stream("POST", server.url + "/v1/messages", json=body) as r:
            assert r.status_code == 200
            read_heartbeats(r.iter_lines(), lambda line: line == "event: ping", 2)
        # Gone before the engine ran a step for it: the stream ends (a ping's write fails, or the
        # disconnect is seen) and its request is aborted.
        wait_until(lambda: engine.num_active == 0, "the stream to be dropped")
    wait_until(lambda: server.num_running() == 0, "the request to be aborted")

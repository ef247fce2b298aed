"""Recorded HTTP responses: a fixed set of requests to every front door, streamed and whole, good and bad,
replayed through the real app over a scripted engine and compared byte for byte with tests/frontends/recorded.json
(ids, timestamps and durations masked). A change to what clients receive shows up here as a diff to review;
`MLXHOST_RECORD=1 pytest tests/frontends/test_recorded.py` writes the file anew after an intended change."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from fake_models import FakeModels
from fastapi.testclient import TestClient

from mlxhost.engine.request import RequestOutput
from mlxhost.frontends.app import create_app
from mlxhost.structured.grammar import GrammarFailure

RECORDED = Path(__file__).parent / "recorded.json"
TOOL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather for a city",
                    "input_schema": OPENAI_TOOLS[0]["function"]["parameters"]}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
                    "parameters": OPENAI_TOOLS[0]["function"]["parameters"]}]
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
ANTHROPIC = {"anthropic-version": "2023-06-01"}


class ScriptedEngine:
    """Answers in three chunks. The prompt's last words choose the script: `weather` a tool call,
    `shutdown` a server shutdown after the first chunk, `grammar` a grammar failure, `crash` an engine error."""

    kv_capacity_tokens = None

    def __init__(self) -> None:
        self.requests: list = []

    def generate(self, request):
        self.requests.append(request)
        prompt = bytes(request.prompt_token_ids).decode("utf-8", errors="replace").rstrip().removesuffix("assistant:")
        constraint = request.sampling.constraint
        text = (TOOL_REPLY if "weather" in prompt[-200:] else
                json.dumps({"title": "Greeting"}) if constraint is not None and constraint.kind == "json_schema" else
                "Hello there, friend.")
        n = len(text)
        cuts = [0, n // 3, 2 * n // 3, n]
        rid, num_prompt = request.request_id, request.num_prompt_tokens
        script = next((word for word in ("shutdown", "grammar", "crash") if word in prompt[-120:]), None)

        async def outputs():
            for i in range(3):
                piece = text[cuts[i]:cuts[i + 1]]
                if i == 1 and script == "shutdown":
                    yield RequestOutput(rid, [], "", num_prompt, i, finish_reason="abort", error="server shutting down")
                    return
                if i == 1 and script == "grammar":
                    yield RequestOutput(rid, [], "", num_prompt, i, error=GrammarFailure("the json grammar could not continue"))
                    return
                if i == 1 and script == "crash":
                    yield RequestOutput(rid, [], "", num_prompt, i, error="engine failed")
                    return
                last = i == 2
                yield RequestOutput(rid, [1] * len(piece) if not last else [1] * (len(piece) - 1) + [0], piece,
                                    num_prompt, cuts[i + 1], "stop" if last else None, num_cached_tokens=4)

        return outputs()


def chat(content: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


def scenarios() -> list[tuple[str, str, str, dict | str | None, dict]]:
    """(name, method, path, body, headers)."""
    out = []
    for stream in (False, True):
        s = "stream" if stream else "whole"
        extra = {"stream": stream}
        out += [
            (f"openai chat {s}", "POST", "/v1/chat/completions", chat("hi", **extra), {}),
            (f"openai chat n=2 {s}", "POST", "/v1/chat/completions", chat("hi", n=2, **extra), {}),
            (f"openai chat tools {s}", "POST", "/v1/chat/completions",
             chat("what is the weather", tools=OPENAI_TOOLS, **extra), {}),
            (f"openai chat json_schema {s}", "POST", "/v1/chat/completions",
             chat("title please", response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
                  **extra), {}),
            (f"openai chat shutdown {s}", "POST", "/v1/chat/completions", chat("shutdown", **extra), {}),
            (f"openai chat shutdown n=2 {s}", "POST", "/v1/chat/completions", chat("shutdown", n=2, **extra), {}),
            (f"openai chat grammar {s}", "POST", "/v1/chat/completions", chat("grammar", **extra), {}),
            (f"openai chat crash {s}", "POST", "/v1/chat/completions", chat("crash", **extra), {}),
            (f"openai completions {s}", "POST", "/v1/completions",
             {"model": "tiny", "prompt": "Once upon", "max_tokens": 8, **extra}, {}),
            (f"openai completions shutdown {s}", "POST", "/v1/completions",
             {"model": "tiny", "prompt": "shutdown", "max_tokens": 8, **extra}, {}),
            (f"anthropic {s}", "POST", "/v1/messages", chat("hi", max_tokens=16, system="Be brief.", **extra), ANTHROPIC),
            (f"anthropic tools {s}", "POST", "/v1/messages",
             chat("what is the weather", max_tokens=64, tools=ANTHROPIC_TOOLS, **extra), ANTHROPIC),
            (f"anthropic shutdown {s}", "POST", "/v1/messages", chat("shutdown", max_tokens=16, **extra), ANTHROPIC),
            (f"anthropic grammar {s}", "POST", "/v1/messages", chat("grammar", max_tokens=16, **extra), ANTHROPIC),
            (f"anthropic crash {s}", "POST", "/v1/messages", chat("crash", max_tokens=16, **extra), ANTHROPIC),
            (f"responses {s}", "POST", "/v1/responses", {"model": "tiny", "input": "hi", "store": False, **extra}, {}),
            (f"responses tools {s}", "POST", "/v1/responses",
             {"model": "tiny", "input": "what is the weather", "tools": RESPONSES_TOOLS, "store": False, **extra}, {}),
            (f"responses shutdown {s}", "POST", "/v1/responses",
             {"model": "tiny", "input": "shutdown", "store": False, **extra}, {}),
            (f"responses crash {s}", "POST", "/v1/responses", {"model": "tiny", "input": "crash", "store": False, **extra}, {}),
            (f"ollama chat {s}", "POST", "/api/chat", chat("hi", **extra), {}),
            (f"ollama chat tools {s}", "POST", "/api/chat", chat("what is the weather", tools=OPENAI_TOOLS, **extra), {}),
            (f"ollama chat shutdown {s}", "POST", "/api/chat", chat("shutdown", **extra), {}),
            (f"ollama generate {s}", "POST", "/api/generate", {"model": "tiny", "prompt": "hi", **extra}, {}),
            (f"openai completions crash {s}", "POST", "/v1/completions",
             {"model": "tiny", "prompt": "crash", "max_tokens": 8, **extra}, {}),
            (f"responses grammar {s}", "POST", "/v1/responses",
             {"model": "tiny", "input": "grammar", "store": False, **extra}, {}),
            (f"ollama chat grammar {s}", "POST", "/api/chat", chat("grammar", **extra), {}),
            (f"ollama generate crash {s}", "POST", "/api/generate", {"model": "tiny", "prompt": "crash", **extra}, {}),
        ]
    out += [
        ("openai chat bad sampling", "POST", "/v1/chat/completions", chat("hi", temperature=-1, top_p=7), {}),
        ("openai chat no messages", "POST", "/v1/chat/completions", {"model": "tiny"}, {}),
        ("openai chat bad json", "POST", "/v1/chat/completions", "{not json", {}),
        ("openai chat tool_choice without tools", "POST", "/v1/chat/completions",
         chat("hi", tool_choice={"type": "function", "function": {"name": "nope"}}), {}),
        ("openai completions bad", "POST", "/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 3, "n": 1}, {}),
        ("anthropic no max_tokens", "POST", "/v1/messages", chat("hi"), ANTHROPIC),
        ("anthropic count_tokens", "POST", "/v1/messages/count_tokens", chat("hi"), ANTHROPIC),
        ("responses bad", "POST", "/v1/responses", {"model": "tiny", "input": "hi", "temperature": 9}, {}),
        ("ollama chat bad", "POST", "/api/chat", {"model": "tiny", "messages": "nope"}, {}),
        ("models", "GET", "/v1/models", None, {}),
        ("ollama version", "GET", "/api/version", None, {}),
        ("not found", "GET", "/v1/nothing-here", None, {}),
    ]
    return out


MASKS = [
    (re.compile(r'"(created|created_at|completed_at|expires_at|started_at)": ?("[^"]*"|\d+(\.\d+)?)'), r'"\1": 0'),
    (re.compile(r'"(total_duration|load_duration|prompt_eval_duration|eval_duration)": ?\d+'), r'"\1": 0'),
    (re.compile(r'\b(chatcmpl|cmpl|msg|resp|call|toolu|fc|rs|req|item)([-_])[A-Za-z0-9]{6,}'), r'\1\2ID'),
    (re.compile(r'"(id|item_id|call_id|tool_call_id|response_id|previous_response_id)": ?"[^"]*"'), r'"\1": "ID"'),
    (re.compile(r'"(system_fingerprint|version)": ?"[^"]*"'), r'"\1": "V"'),
]


def masked(text: str) -> str:
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return text


def record_all() -> dict[str, dict]:
    models = FakeModels()
    models.engine = ScriptedEngine()
    client = TestClient(create_app(models), raise_server_exceptions=False)
    recorded = {}
    with client:
        for name, method, path, body, headers in scenarios():
            kwargs = {"headers": headers}
            if isinstance(body, str):
                kwargs["content"] = body
                kwargs["headers"] = {**headers, "content-type": "application/json"}
            elif body is not None:
                kwargs["json"] = body
            r = client.request(method, path, **kwargs)
            recorded[name] = {"status": r.status_code, "content_type": r.headers.get("content-type", ""),
                              "body": masked(r.text)}
    return recorded


def test_responses_are_as_recorded():
    got = record_all()
    if os.environ.get("MLXHOST_RECORD") == "1":
        RECORDED.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
        pytest.skip(f"wrote {len(got)} responses to {RECORDED.name}")
    want = json.loads(RECORDED.read_text())
    assert sorted(got) == sorted(want), "the set of scenarios changed: record again"
    changed = [name for name in want if got[name] != want[name]]
    assert not changed, "responses differ from the recording: " + ", ".join(changed) + "\n" + "\n".join(
        f"--- {name}\nwant {want[name]}\ngot  {got[name]}" for name in changed[:3])

"""What real agent clients send is served: request bodies captured from Claude Code and Codex CLI
(tests/frontends/fixtures, see its README) replayed through the real app over a fake model, streamed and
whole; bookkeeping and unknown fields are accepted, namespace tools flattened, hosted tools skipped
unless forced, effort mapped; a bad request is one 400 naming every offending field. No MLX, no server."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
from fake_models import JSON_REPLY, NAME, REPLY, fake_client

from mlxhost.serving.model import ServedModel
from mlxhost.serving.prepare import make_request
from mlxhost.serving.schemas import ChatCompletionRequest, system_merged

FIXTURES = Path(__file__).parent / "fixtures"
CLAUDE_CODE = ["claude_code_first_turn", "claude_code_title", "claude_code_continue", "claude_code_tool_search"]
CODEX = ["codex_first_turn", "codex_resume"]
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def fixture(name: str) -> dict:
    body = json.loads((FIXTURES / f"{name}.json").read_text())
    body["model"] = NAME  # the captures name a model this fake serves under another name
    return body


@pytest.fixture
def app():
    client, models = fake_client()
    with client:
        yield client, models


def sse_events(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# -- replays -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CLAUDE_CODE)
@pytest.mark.parametrize("stream", [True, False])
def test_claude_code_requests_are_served(app, name, stream):
    client, models = app
    body = {**fixture(name), "stream": stream}
    r = client.post("/v1/messages?beta=true", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    expected = JSON_REPLY if name == "claude_code_title" else REPLY
    if stream:
        events = sse_events(r)
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    else:
        assert r.json()["type"] == "message"
        text = "".join(b.get("text", "") for b in r.json()["content"])
    assert text == expected
    render = models.last_render
    assert render["kwargs"].get("reasoning_effort") == "high"  # output_config.effort
    roles = [m["role"] for m in render["messages"]]
    # Claude Code's billing line (a per-conversation hash) is not for the model, nor for the prefix cache.
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
    assert render["messages"][0]["content"].startswith("You are a Claude agent")
    # `system` first; the system message Claude Code puts after the first user turn comes next, apart from it.
    assert roles[0] == "system" and roles.count("system") == (1 if name == "claude_code_title" else 2)
    if name != "claude_code_title":
        assert roles[1:3] == ["system", "user"]
        mid = body["messages"][1]  # Claude Code's first-turn system message, as it was sent
        text = mid["content"] if isinstance(mid["content"], str) else "\n".join(b["text"] for b in mid["content"])
        assert mid["role"] == "system" and render["messages"][1]["content"] == text
        # Tools deferred until a tool search loads them are not in the list at the top (tool_search_loads_...).
        assert len(render["tools"]) == len([t for t in body["tools"] if not t.get("defer_loading")])


def test_tool_search_loads_deferred_tools_where_it_found_them(app):
    """Claude Code 2.1.332 defers tools (`defer_loading`) and its ToolSearch answers with `tool_reference`
    blocks: the definitions appear in the tool result, in the encoding ToolSearch describes to the model; the
    tool list at the top, and so the cached prompt prefix, stays the first turn's."""
    client, models = app
    body = fixture("claude_code_tool_search")
    r = client.post("/v1/messages?beta=true", json={**body, "stream": False})
    assert r.status_code == 200, r.text
    render = models.last_render
    shown = [t["function"]["name"] for t in render["tools"]]
    assert "WebFetch" not in shown and "DeferredToolPlaceholder" not in shown and "ToolSearch" in shown
    result = render["messages"][-1]
    assert result["role"] == "tool" and result["tool_call_id"] == "toolu_1"
    lines = result["content"].split("\n")
    assert lines[0] == "<functions>" and lines[-1] == "</functions>" and len(lines) == 4
    loaded = [json.loads(line.removeprefix("<function>").removesuffix("</function>")) for line in lines[1:3]]
    tools = {t["name"]: t for t in body["tools"]}
    assert [t["name"] for t in loaded] == ["WebFetch", "NotebookEdit"]
    assert all(t["parameters"] == tools[t["name"]]["input_schema"] for t in loaded)
    # Callable all the same: the tool-call grammar (built for `auto` too) takes the loaded tools' names.
    grammar = models.engine.requests[-1].sampling.constraint.grammar
    assert "WebFetch" in grammar and "NotebookEdit" in grammar and "DeferredToolPlaceholder" not in grammar
    first = fixture("claude_code_tool_search")
    first["messages"] = first["messages"][:-2]  # the turn before the search: the same tools at the top
    assert client.post("/v1/messages?beta=true", json={**first, "stream": False}).status_code == 200
    assert [t["function"]["name"] for t in models.last_render["tools"]] == shown
    assert "WebFetch" not in models.engine.requests[-1].sampling.constraint.grammar  # not loaded yet
    # A loaded tool's call is a call (the parser takes names outside the list at the top).
    models.engine.reply = '<tool_call>\n{"name": "WebFetch", "arguments": {"url": "https://example.com"}}\n</tool_call>'
    r = client.post("/v1/messages?beta=true", json={**body, "stream": False})
    assert [b["type"] for b in r.json()["content"]] == ["tool_use"] and r.json()["content"][0]["name"] == "WebFetch"


def test_claude_code_request_tokens_are_counted(app):
    client, models = app
    body = {k: v for k, v in fixture("claude_code_continue").items() if k not in ("max_tokens", "stream")}
    r = client.post("/v1/messages/count_tokens?beta=true", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] == len(models.tokenizer.encode(models.tokenizer.apply_chat_template(
        models.last_render["messages"])))
    assert not models.engine.requests  # counted, never generated


@pytest.mark.parametrize("name", CODEX)
@pytest.mark.parametrize("stream", [True, False])
def test_codex_requests_are_served(app, name, stream):
    client, models = app
    body = {**fixture(name), "stream": stream}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    response = [e for e in sse_events(r) if e["type"] == "response.completed"][0]["response"] if stream else r.json()
    assert response["status"] == "completed" and response["output"][-1]["content"][0]["text"] == REPLY
    assert response["metadata"] == {"mlxhost_skipped_tools": "web_search"}
    render = models.last_render
    names = [t["function"]["name"] for t in render["tools"]]
    # The namespace's functions are among the model's tools; the hosted web_search is not.
    assert {"exec_command", "spawn_agent", "close_agent", "wait_agent"} <= set(names)
    assert "web_search" not in names and "multi_agent_v1" not in names
    # Codex's two developer messages are one system message.
    assert [m["role"] for m in render["messages"]][:2] == ["system", "user"]
    assert "<skills_instructions>" in render["messages"][0]["content"]


def test_a_namespaced_call_comes_back_with_its_namespace(app):
    client, models = app
    call = {"name": "spawn_agent", "arguments": {"message": "look"}}
    models.engine.reply = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    for stream in (False, True):
        r = client.post("/v1/responses", json={**fixture("codex_first_turn"), "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            events = sse_events(r)
            added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
            assert added[0]["namespace"] == "multi_agent_v1"
            response = events[-1]["response"]
        else:
            response = r.json()
        item = response["output"][0]
        assert (item["type"], item["name"], item["namespace"]) == ("function_call", "spawn_agent", "multi_agent_v1")


# -- accepted, mapped, skipped -------------------------------------------------------------------


def test_unknown_and_bookkeeping_fields_are_accepted_and_logged(app, caplog):
    client, _ = app
    caplog.set_level(logging.DEBUG)
    extra = {"bogus": 1, "metadata": {"user_id": "u"}, "context_management": {"edits": []}, "container": "c",
             "service_tier": "auto", "inference_geo": "us"}
    r = client.post("/v1/messages", json={"model": NAME, "max_tokens": 4, "messages": HI, **extra})
    assert r.status_code == 200, r.text
    logged = " ".join(rec.getMessage() for rec in caplog.records if rec.levelno == logging.DEBUG)
    assert all(name in logged for name in extra)
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": HI, "max_tokens": 4, "bogus": 1,
                                                  "prediction": {"type": "content", "content": "x"},
                                                  "verbosity": "low", "store": True})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("wanted, effort", [("low", "low"), ("high", "high"), ("max", "high")])
def test_output_config_effort_is_the_reasoning_effort(app, wanted, effort):
    client, models = app
    r = client.post("/v1/messages", json={"model": NAME, "max_tokens": 4, "messages": HI,
                                          "output_config": {"effort": wanted}})
    assert r.status_code == 200, r.text
    assert models.last_render["kwargs"]["reasoning_effort"] == effort


@pytest.mark.parametrize("wanted, kwargs", [("xhigh", {"reasoning_effort": "high"}),
                                            ("none", {"reasoning_effort": "none", "enable_thinking": False})])
def test_responses_reasoning_effort(app, wanted, kwargs):
    client, models = app
    r = client.post("/v1/responses", json={"model": NAME, "input": "hi", "reasoning": {"effort": wanted}})
    assert r.status_code == 200, r.text
    assert models.last_render["kwargs"] == kwargs


def test_anthropic_system_messages_in_place(app):
    client, models = app
    messages = [{"role": "system", "content": [{"type": "text", "text": "more rules"}]}, *HI,
                {"role": "assistant", "content": "ok"}, {"role": "system", "content": "later rules"},
                {"role": "user", "content": "go"}]
    r = client.post("/v1/messages", json={"model": NAME, "max_tokens": 4, "system": "rules", "messages": messages})
    assert r.status_code == 200, r.text
    rendered = models.last_render["messages"]
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "system", "user"]
    assert rendered[0]["content"] == "rules\n\nmore rules"  # adjacent: one system message
    bad = [{"role": "system", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}]}]
    r = client.post("/v1/messages", json={"model": NAME, "max_tokens": 4, "messages": bad + HI})
    assert r.status_code == 400 and "messages.0.content.0" in r.json()["error"]["message"]


def test_template_that_takes_system_only_first_gets_them_merged():
    class FirstSystemOnly:
        chat_template = "strict"

        def __init__(self):
            self.rendered = None

        def encode(self, text, add_special_tokens=True):
            return list(text.encode())

        def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False, **kw):
            if any(m["role"] == "system" for m in messages[1:]):
                raise ValueError("System role only at the start")
            self.rendered = messages
            return "|".join(m["content"] for m in messages)

    tok = FirstSystemOnly()
    model = ServedModel(name="t", aliases=frozenset(), tokenizer=tok, max_model_len=4096, vocab_size=256,
                        eos_token_ids=frozenset({0}), default_max_tokens=4, created=0)
    body = ChatCompletionRequest(model="t", messages=[{"role": "user", "content": "u"},
                                                      {"role": "system", "content": "s"}])
    make_request(model, body)
    assert tok.rendered == system_merged([{"role": "user", "content": "u"}, {"role": "system", "content": "s"}])
    assert tok.rendered == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


def test_anthropic_server_tools_are_skipped(app, caplog):
    client, models = app
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
             {"type": "bash_20250124", "name": "bash"}, {"type": "code_execution_20250825", "name": "code"}, WEATHER]
    r = client.post("/v1/messages", json={"model": NAME, "max_tokens": 4, "messages": HI, "tools": tools,
                                          "mcp_servers": [{"type": "url", "url": "https://x", "name": "m"}]})
    assert r.status_code == 200, r.text
    assert [t["function"]["name"] for t in models.last_render["tools"]] == ["get_weather"]
    warned = " ".join(rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING)
    assert "web_search_20250305" in warned and "bash_20250124" in warned and "mcp_servers" in warned


def test_responses_hosted_and_custom_tools_are_skipped(app):
    client, models = app
    tools = [{"type": "web_search_preview"}, {"type": "file_search", "vector_store_ids": ["v"]},
             {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
             {"type": "mcp", "server_label": "s", "server_url": "https://x"}, {"type": "local_shell"},
             {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark",
                                                                  "definition": "start: /.+/"}},
             {"type": "function", "name": "f", "parameters": {"type": "object"}}]
    r = client.post("/v1/responses", json={"model": NAME, "input": "hi", "tools": tools})
    assert r.status_code == 200, r.text
    assert [t["function"]["name"] for t in models.last_render["tools"]] == ["f"]
    skipped = r.json()["metadata"]["mlxhost_skipped_tools"]
    assert all(kind in skipped for kind in ("web_search_preview", "file_search", "mcp", "custom apply_patch"))
    assert [t["type"] for t in r.json()["tools"]] == [t["type"] for t in tools]  # echoed as sent


# -- refused -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/messages", {"max_tokens": 4, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                      "tool_choice": {"type": "tool", "name": "web_search"}}),
    ("/v1/messages", {"max_tokens": 4, "messages": HI, "tools": [{"type": "bash_20250124", "name": "bash"}],
                      "tool_choice": {"type": "any"}}),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": "required"}),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "custom", "name": "apply_patch"}],
                       "tool_choice": {"type": "custom", "name": "apply_patch"}}),
])
def test_a_forced_tool_that_cannot_run_is_a_400(app, path, body):
    client, _ = app
    r = client.post(path, json={"model": NAME, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "tool_choice" in error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("path, body, fields", [
    ("/v1/chat/completions", {"messages": HI, "temperature": 5, "best_of": 3, "guided_json": {"type": "object"},
                              "functions": [{"name": "f"}], "top_p": 0, "bogus": 1},
     ["temperature", "best_of", "guided_json", "functions", "top_p"]),
    ("/v1/responses", {"input": "hi", "temperature": 3, "background": True, "prompt": {"id": "p"},
                       "conversation": "conv_1", "include": ["message.output_text.logprobs"], "top_logprobs": 2},
     ["temperature", "background", "prompt", "conversation", "include", "top_logprobs"]),
    ("/v1/messages", {"max_tokens": 0, "messages": HI, "temperature": 1.5, "top_k": -1,
                      "stop_sequences": ["s"] * 17, "thinking": {"type": "enabled", "budget_tokens": 0}},
     ["max_tokens", "temperature", "top_k", "stop_sequences", "thinking"]),
])
def test_one_400_names_every_bad_field_and_is_logged(app, caplog, path, body, fields):
    client, _ = app
    caplog.set_level(logging.INFO)
    r = client.post(path, json={"model": NAME, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "more problem" not in error["message"]
    assert all(f in error["message"] for f in fields), error["message"]
    assert error["message"].startswith(f"{len(fields)} problems: ")
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert sorted(error["param"].split(", ")) == sorted(fields)
    logged = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith(f"POST {path} -> 400")]
    assert logged and all(f in logged[-1] for f in fields)


def test_harmless_values_of_refused_fields_pass(app):
    client, _ = app
    harmless = {"best_of": 1, "use_beam_search": False, "stop_token_ids": [], "skip_special_tokens": True,
                "add_generation_prompt": True, "function_call": "auto", "echo": False}
    r = client.post("/v1/chat/completions", json={"model": NAME, "messages": HI, "max_tokens": 4, **harmless})
    assert r.status_code == 200, r.text
    r = client.post("/v1/responses", json={"model": NAME, "input": "hi", "background": False, "top_logprobs": 0,
                                           "include": ["reasoning.encrypted_content"], "truncation": "auto"})
    assert r.status_code == 200, r.text


# -- HEAD ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/health", "/v1/models", "/metrics"])
def test_head_answers_like_get(app, path):
    client, _ = app
    r = client.head(path)
    assert r.status_code == 200 and r.content == b""


def test_fixtures_are_what_the_clients_send():
    # The replays above are only worth something while the fixtures keep the fields that broke them.
    first = json.loads((FIXTURES / "claude_code_first_turn.json").read_text())
    assert {"context_management", "output_config", "thinking", "metadata"} <= set(first)
    assert any(m["role"] == "system" for m in first["messages"])
    codex = json.loads((FIXTURES / "codex_first_turn.json").read_text())
    assert {"client_metadata", "prompt_cache_key", "include", "store"} <= set(codex)
    assert {"namespace", "web_search", "function"} <= {t["type"] for t in codex["tools"]}
    title = copy.deepcopy(json.loads((FIXTURES / "claude_code_title.json").read_text()))
    assert title["output_config"]["format"]["type"] == "json_schema"


def test_a_screenshot_turn_keeps_the_tools_and_the_calls_before_it(app):
    """Claude Code sends screenshots as images in tool results and user turns: on a vision-language model the
    template still gets the listed tools, the earlier tool calls and the template arguments."""
    client, models = app
    seen = {}

    class Builder:  # stands in for the multimodal prompt builder
        def build(self, messages, parts, tools=None, **kwargs):
            seen.update(messages=messages, parts=parts, tools=tools, kwargs=kwargs)
            return [1, 2, 3], ()

    models.served = copy.copy(models.served)
    models.served.multimodal = Builder()
    png = "data:image/png;base64,iVBORw0KGgo="
    body = {"model": NAME, "max_tokens": 8, "tools": [WEATHER], "thinking": {"type": "disabled"}, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png.split(",")[1]}}]}]}]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert [t["function"]["name"] for t in seen["tools"]] == ["get_weather"]
    assert seen["kwargs"] == {"enable_thinking": False} and len(seen["parts"]) == 1
    assert seen["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert seen["messages"][2]["role"] == "tool" and seen["messages"][2]["tool_call_id"] == "t1"

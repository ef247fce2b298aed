"""The Ollama front door without a model: options and messages translated into the internal request,
tool calls and reasoning rendered back, keep_alive reaching the model manager, load/unload-only requests,
and /api/pull mapped onto the project's pull (a fake download; the real one on a machine without network)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from mlxhost.frontends.app import create_app
from mlxhost.frontends.common.errors import APIError, install_error_handlers
from mlxhost.frontends.common.gateway import Gateway
from mlxhost.frontends.common.metrics import Metrics
from mlxhost.frontends.ollama.protocol import ChatRequest, keep_alive_seconds
from mlxhost.frontends.ollama.pulling import default_pull, hub_id, pull_lines
from mlxhost.frontends.ollama.routes import add_ollama_routes
from mlxhost.frontends.ollama.translate import chat_fields
from tests.frontends.fake_models import NAME, FakeModels

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


class KeepAliveModels(FakeModels):
    """The fake manager, plus what the Ollama routes ask of a real one."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[tuple[str, float]] = []
        self.unloads: list[str] = []
        self.loads: list[str] = []

    def keep_alive(self, name: str, seconds: float) -> None:
        self.kept.append((name, seconds))

    def source(self, name: str) -> str:
        return "/nonexistent/tiny"

    def expires_in(self, name: str):
        return None

    def cards(self) -> list[dict]:
        return [{"id": NAME, "object": "model", "status": "loaded", "weight_bytes": 1000, "max_model_len": 4096}]

    async def load(self, name: str) -> None:
        self.loads.append(name)

    async def unload(self, name: str) -> bool:
        self.unloads.append(name)
        return True


@pytest.fixture
def fake():
    models = KeepAliveModels()
    return TestClient(create_app(models)), models


def chat(**kw) -> dict:
    return chat_fields(ChatRequest(model=NAME, messages=[{"role": "user", "content": "hi"}], **kw))


# -- translation ---------------------------------------------------------------------------------------


def test_options_map_onto_sampling_fields():
    fields = chat(options={"temperature": 0.2, "top_p": 0.9, "top_k": 0, "seed": 7, "num_predict": 12,
                           "stop": ["\n\n"], "repeat_penalty": 1.1, "repeat_last_n": 20, "presence_penalty": 0.5,
                           "frequency_penalty": 0.25, "min_p": 0.05, "num_ctx": 8192, "num_gpu": 99,
                           "mirostat": 0, "typical_p": 1.0, "some_future_option": 1})
    assert {k: fields[k] for k in ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop",
                                   "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p")} == {
        "temperature": 0.2, "top_p": 0.9, "top_k": 0, "seed": 7, "max_tokens": 12, "stop": ["\n\n"],
        "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25, "min_p": 0.05}
    assert "max_tokens" not in chat(options={"num_predict": -1})  # until done: no cap
    assert "repetition_penalty" not in chat(options={"repeat_penalty": 1.3, "repeat_last_n": 0})


@pytest.mark.parametrize("options, named", [({"mirostat": 2}, "mirostat"), ({"typical_p": 0.5}, "typical_p"),
                                            ({"tfs_z": 0.9}, "tfs_z"),
                                            ({"repeat_penalty": 1.2, "repeat_last_n": 64}, "repeat_last_n")])
def test_options_that_change_output_are_refused(options, named):
    with pytest.raises(APIError) as exc:
        chat(options=options)
    assert exc.value.status == 400 and named in exc.value.message and exc.value.param == "options"


def test_format_think_and_logprobs():
    assert chat(format="json")["response_format"] == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert chat(format=schema)["response_format"]["json_schema"]["schema"] == schema
    assert chat(think=False)["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat(think="high")["reasoning_effort"] == "high"
    assert chat(logprobs=True, top_logprobs=3)["top_logprobs"] == 3
    with pytest.raises(APIError):
        chat(format="yaml")


def test_images_and_tool_history():
    body = ChatRequest(model=NAME, messages=[
        {"role": "user", "content": "what is this", "images": [PNG]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "a", "arguments": {"x": 1}}}, {"function": {"name": "b", "arguments": {}}}]},
        {"role": "tool", "content": "from b", "tool_name": "b"},
        {"role": "tool", "content": "from a"}])
    user, assistant, tool_b, tool_a = chat_fields(body)["messages"]
    assert user["content"][0]["image_url"]["url"].startswith("data:image/png;base64,iVBOR")
    assert user["content"][1] == {"type": "text", "text": "what is this"}
    ids = {c["function"]["name"]: c["id"] for c in assistant["tool_calls"]}
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"x": 1}
    assert tool_b["tool_call_id"] == ids["b"] and tool_a["tool_call_id"] == ids["a"]


@pytest.mark.parametrize("value, seconds", [("5m", 300), ("1h30m", 5400), ("90s", 90), ("250ms", 0.25), (10, 10),
                                            ("0", 0), (0, 0), (-1, math.inf), ("-1m", math.inf), ("120", 120)])
def test_keep_alive_durations(value, seconds):
    assert keep_alive_seconds(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["soon", "5 m", "m5", ""])
def test_bad_keep_alive(value):
    with pytest.raises(ValueError):
        keep_alive_seconds(value)


# -- rendering and the model manager -------------------------------------------------------------------


def test_tool_call_and_reasoning_rendered(fake):
    client, models = fake
    models.engine.reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": NAME, "messages": [{"role": "user", "content": "weather?"}], "tools": tools, "stream": False}
    r = client.post("/api/chat", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["message"]["tool_calls"] == [{"function": {"name": "get_weather",
                                                                "arguments": {"city": "Paris"}}}]
    lines = [json.loads(x) for x in client.post("/api/chat", json={**body, "stream": True}).text.splitlines()]
    calls = [c for o in lines for c in o.get("message", {}).get("tool_calls", ())]
    assert calls == [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "stop"
    assert models.last_render["tools"][0]["function"]["name"] == "get_weather"


def test_keep_alive_reaches_the_manager_and_load_only_requests(fake):
    client, models = fake
    r = client.post("/api/chat", json={"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                       "keep_alive": "10m", "stream": False})
    assert r.status_code == 200 and models.kept == [(NAME, 600)]
    loaded = client.post("/api/generate", json={"model": NAME, "keep_alive": -1}).json()
    assert loaded["done"] is True and loaded["done_reason"] == "load" and models.loads == [NAME]
    assert models.kept[-1] == (NAME, math.inf)
    unloaded = client.post("/api/generate", json={"model": NAME, "keep_alive": 0}).json()
    assert unloaded["done_reason"] == "unload" and models.unloads == [NAME]
    bad = client.post("/api/chat", json={"model": NAME, "messages": [], "keep_alive": "later"})
    assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def test_generate_refuses_suffix_and_template(fake):
    client, _ = fake  # the fake's vocabulary has no fill-in-the-middle markers (tests/frontends/test_fim.py)
    for extra in ({"suffix": "}"}, {"template": "{{ .Prompt }}"}):
        r = client.post("/api/generate", json={"model": NAME, "prompt": "def f(", "stream": False, **extra})
        assert r.status_code == 400 and set(r.json()) == {"error"}


def test_errors_are_ollama_shaped_only_on_api_paths(fake):
    client, _ = fake
    r = client.post("/api/chat", json={"messages": []})
    assert r.status_code == 400 and isinstance(r.json()["error"], str) and "model" in r.json()["error"]
    assert isinstance(client.post("/v1/chat/completions", json={}).json()["error"], dict)


# -- pull ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, repo", [("mlx-community/Qwen3-0.6B-4bit", "mlx-community/Qwen3-0.6B-4bit"),
                                        ("hf.co/owner/model", "owner/model"),
                                        ("huggingface.co/owner/model:latest", "owner/model")])
def test_hub_ids(name, repo):
    assert hub_id(name) == repo


@pytest.mark.parametrize("name", ["llama3.2", "llama3.2:1b", "hf.co/owner/model:Q4_K_M", "a/b/c"])
def test_not_hub_ids(name):
    with pytest.raises(APIError) as exc:
        hub_id(name)
    assert exc.value.status == 400


def pull_app(pull_fn) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    add_ollama_routes(app, Gateway(KeepAliveModels(), Metrics(lambda: None)), pull_fn=pull_fn)
    return TestClient(app)


def test_pull_streams_status_lines_from_the_projects_pull():
    pulled = []
    client = pull_app(lambda repo: pulled.append(repo) or f"/cache/{repo}")
    lines = [json.loads(x) for x in client.post("/api/pull", json={"model": "hf.co/owner/model"}).text.splitlines()]
    assert pulled == ["owner/model"]
    assert lines[0] == {"status": "pulling manifest"} and lines[-1] == {"status": "success"}
    assert "/cache/owner/model" in lines[-2]["status"]
    whole = client.post("/api/pull", json={"model": "owner/model", "stream": False})
    assert whole.json() == {"status": "success"}


def test_pull_failure_is_an_ollama_error():
    from mlxhost.models.pull import HubError

    def fail(repo):
        raise HubError(f"{repo}: not found on the Hugging Face hub")

    client = pull_app(fail)
    lines = [json.loads(x) for x in client.post("/api/pull", json={"model": "owner/model"}).text.splitlines()]
    assert lines[-1] == {"error": "pull failed: owner/model: not found on the Hugging Face hub"}
    whole = client.post("/api/pull", json={"name": "owner/model", "stream": False})
    assert whole.status_code == 502 and whole.json() == {"error": "pull failed: owner/model: not found on the "
                                                                  "Hugging Face hub"}


def test_real_pull_without_the_hub_says_why(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    async def run():
        return [obj async for obj in pull_lines("mlxhost-tests/no-such-model", default_pull)]

    lines = asyncio.run(run())
    assert lines[0] == {"status": "pulling manifest"} and "HF_HUB_OFFLINE" in lines[-1]["error"]


# -- keep_alive in the real model manager --------------------------------------------------------------


def test_manager_keep_alive_sets_the_idle_ttl_of_the_current_load():
    from mlxhost.server.manager import ModelState
    from tests.server.test_manager import Clock, make_manager, spec, use

    async def run():
        clock = Clock()
        manager, loader = make_manager([spec("a"), spec("p", pinned=True)], clock=clock)
        manager.load_pinned()
        manager.start(asyncio.get_running_loop())
        await use(manager, "a")
        assert manager.expires_in("a") is None  # no ttl configured: only unloaded for room
        manager.keep_alive("a", 30)
        assert manager.expires_in("a") == 30
        clock.now += 29
        assert await manager.expire_idle() == []
        clock.now += 1
        assert await manager.expire_idle() == ["a"] and manager.state("a") is ModelState.NOT_LOADED
        await use(manager, "a")
        assert manager.expires_in("a") is None  # the keep_alive was for the load that ended
        manager.keep_alive("p", 30)  # a pinned model stays for any keep_alive but 0
        assert manager.expires_in("p") is None and await manager.expire_idle() == []
        manager.keep_alive("p", 0)
        assert await manager.expire_idle() == ["p"]
        manager.close()

    asyncio.run(run())

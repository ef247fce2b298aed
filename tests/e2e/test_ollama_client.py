"""The Ollama API through the official `ollama` Python client, unmodified, against a live server on the
random-weight demo fixture: chat (whole and streamed), generate, embed, list, show, ps, tools, structured
output, errors in Ollama's shape. Random weights: the tests check shapes and fields, not what is said."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from tests.e2e.conftest import SERVED_NAME

OPTIONS = {"temperature": 0, "num_predict": 8, "seed": 1}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer",
        "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                  "parameters": {"type": "object", "required": ["city"],
                                                                 "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def oc(server):
    return ollama.Client(host=server.url, timeout=120)


def check_final(r, prompt_min: int = 1) -> None:
    assert r.done is True and r.done_reason in ("stop", "length")
    assert r.prompt_eval_count >= prompt_min and 1 <= r.eval_count <= OPTIONS["num_predict"]
    for field in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(r, field), int) and getattr(r, field) >= 0, field
    assert r.total_duration >= r.eval_duration


def test_version_list_show_ps(oc, server):
    assert httpx.get(server.url + "/api/version").json()["version"]
    listed = oc.list()
    assert [m.model for m in listed.models] == [SERVED_NAME]
    entry = listed.models[0]
    assert entry.size > 0 and entry.digest and entry.details.family == "qwen3" and entry.modified_at is not None
    shown = oc.show(SERVED_NAME)
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert shown.template and shown.details.family == "qwen3"
    assert shown.modelinfo["qwen3.context_length"] > 0
    running = oc.ps()
    assert [m.model for m in running.models] == [SERVED_NAME]
    assert running.models[0].expires_at is not None and running.models[0].context_length > 0


def test_chat_whole(oc):
    r = oc.chat(model=SERVED_NAME, messages=[{"role": "user", "content": "Hello"}], options=OPTIONS)
    assert r.message.role == "assistant" and isinstance(r.message.content, str)
    assert r.model == SERVED_NAME and r.created_at
    check_final(r)


def test_chat_with_latest_tag_and_history(oc):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    r = oc.chat(model=f"{SERVED_NAME}:latest", messages=messages, options=OPTIONS)
    check_final(r, prompt_min=5)


def test_chat_streamed(oc):
    parts = list(oc.chat(model=SERVED_NAME, messages=[{"role": "user", "content": "Count"}], options=OPTIONS,
                         stream=True))
    assert parts and all(p.done is False for p in parts[:-1]) and parts[-1].done is True
    assert sum(1 for p in parts[:-1] if p.message.content) >= 1
    check_final(parts[-1])
    assert parts[-1].eval_count == OPTIONS["num_predict"] or parts[-1].done_reason == "stop"


def test_generate_whole_streamed_and_context(oc):
    r = oc.generate(model=SERVED_NAME, prompt="Once upon a time", system="You tell stories.", options=OPTIONS)
    assert isinstance(r.response, str)
    check_final(r)
    assert len(r.context) == r.prompt_eval_count + r.eval_count
    follow = oc.generate(model=SERVED_NAME, prompt="And then?", context=r.context, options=OPTIONS)
    assert follow.prompt_eval_count > len(r.context)  # the earlier conversation's tokens came first
    parts = list(oc.generate(model=SERVED_NAME, prompt="abc", raw=True, options=OPTIONS, stream=True))
    assert parts[-1].done is True and parts[-1].prompt_eval_count >= 1
    assert "".join(p.response for p in parts[:-1]) is not None


def test_embed_and_older_embeddings(oc):
    r = oc.embed(model=SERVED_NAME, input=["first text", "second"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == len(r.embeddings[1]) > 0
    assert abs(sum(x * x for x in r.embeddings[0]) - 1.0) < 1e-3 and r.prompt_eval_count >= 2
    assert len(oc.embed(model=SERVED_NAME, input="one", dimensions=16).embeddings[0]) == 16
    old = oc.embeddings(model=SERVED_NAME, prompt="first text")
    assert old.embedding == pytest.approx(r.embeddings[0], abs=1e-5)


def test_tools_accepted_and_history_with_calls(oc):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                  "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "22 C and sunny", "tool_name": "get_weather"}]
    r = oc.chat(model=SERVED_NAME, messages=messages, tools=[WEATHER_TOOL], options=OPTIONS)
    check_final(r)
    for call in r.message.tool_calls or ():  # a random model rarely calls; any call it makes is whole
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)

    def add_two_numbers(a: int, b: int) -> int:
        """Add two numbers

        Args:
          a: The first number
          b: The second number
        """
        return a + b

    # The client turns a Python function into a tool definition from its signature and docstring.
    check_final(oc.chat(model=SERVED_NAME, messages=[{"role": "user", "content": "2 + 3?"}], tools=[add_two_numbers],
                        options=OPTIONS))


def test_structured_output_schema_and_json(oc):
    options = {**OPTIONS, "num_predict": 64}
    r = oc.chat(model=SERVED_NAME, messages=[{"role": "user", "content": "A city"}], format=CITY, options=options)
    jsonschema.validate(json.loads(r.message.content), CITY)
    g = oc.generate(model=SERVED_NAME, prompt="JSON please", format="json", options=options)
    assert isinstance(json.loads(g.response), dict)


def test_errors_in_ollama_shape(oc, server):
    with pytest.raises(ollama.ResponseError) as exc:
        oc.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 404 and "no-such-model" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        oc.chat(model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}], options={"mirostat": 2})
    assert exc.value.status_code == 400 and "mirostat" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        oc.delete(SERVED_NAME)
    assert exc.value.status_code == 403 and "does not delete" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        oc.pull("llama3.2:1b")
    assert exc.value.status_code == 400 and "Hugging Face" in exc.value.error
    bad = httpx.post(server.url + "/api/chat", json={"model": SERVED_NAME, "messages": "nope"})
    assert bad.status_code == 400 and isinstance(bad.json()["error"], str)


def test_default_is_streamed_ndjson(server):
    """Without `stream`, Ollama streams: newline-delimited JSON objects, the last one `done`."""
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "options": OPTIONS}
    with httpx.stream("POST", server.url + "/api/chat", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        objs = [json.loads(x) for x in r.iter_lines() if x]
    assert objs[-1]["done"] is True and all(o["done"] is False for o in objs[:-1])


def test_open_webui_connection_calls(server):
    """What Open WebUI's Ollama connection sends: the version check, the model list, a streamed chat."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.get("/api/version").status_code == 200
        names = [m["name"] for m in http.get("/api/tags").json()["models"]]
        assert SERVED_NAME in names
        body = {"model": names[0], "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "options": {"num_predict": 4}}
        with http.stream("POST", "/api/chat", json=body) as r:
            objs = [json.loads(x) for x in r.iter_lines() if x]
        assert objs[-1]["done"] is True and objs[-1]["eval_count"] >= 1


def test_images_reach_a_vision_model(qwen25vl_dir, make_module_server):
    """`images` (the client base64-encodes the bytes) become image parts of a vision-language model's prompt."""
    import io

    import numpy as np
    from PIL import Image

    live = make_module_server(qwen25vl_dir, max_num_seqs=2)
    vc = ollama.Client(host=live.url, timeout=300)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    text_only = vc.chat(model=SERVED_NAME, messages=[{"role": "user", "content": "What is this?"}], options=OPTIONS)
    seen = vc.chat(model=SERVED_NAME, messages=[{"role": "user", "content": "What is this?",
                                                 "images": [buf.getvalue()]}], options=OPTIONS)
    check_final(seen)
    assert seen.prompt_eval_count > text_only.prompt_eval_count  # the picture's tokens are in the prompt
    assert "vision" in vc.show(SERVED_NAME).capabilities
    g = vc.generate(model=SERVED_NAME, prompt="Describe", images=[buf.getvalue()], options=OPTIONS)
    assert g.prompt_eval_count > text_only.prompt_eval_count


def test_keep_alive_unloads_and_expires(qwen3_model_dir, llama_model_dir, serve_module_app):
    """keep_alive on a second, unpinned model: "10m" shows in ps as its expiry, 0 unloads it once the
    request ends, a request with no messages loads it again (`ollama run` / `ollama stop` do this)."""
    import time
    from datetime import datetime, timezone

    from mlxhost.config import EngineConfig, ModelSpec, ServerConfig
    from mlxhost.server.app import build_app

    specs = (ModelSpec("chat", str(qwen3_model_dir), pinned=True), ModelSpec("other", str(llama_model_dir)))
    live = serve_module_app(build_app(ServerConfig(models=specs, engine=EngineConfig(max_num_seqs=4))))
    mc = ollama.Client(host=live.url, timeout=120)
    mc.chat(model="other", messages=[{"role": "user", "content": "hi"}], options=OPTIONS, keep_alive="10m")
    (entry,) = [m for m in mc.ps().models if m.model == "other"]
    left = (entry.expires_at - datetime.now(timezone.utc)).total_seconds()
    assert 500 < left <= 600
    mc.chat(model="other", messages=[{"role": "user", "content": "hi"}], options=OPTIONS, keep_alive=0)
    deadline = time.monotonic() + 60  # a bound for the poll, not a timing check
    while "other" in [m.model for m in mc.ps().models] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [m.model for m in mc.ps().models] == ["chat"]
    loaded = mc.chat(model="other", messages=[])
    assert loaded.done_reason == "load" and "other" in [m.model for m in mc.ps().models]
    assert mc.generate(model="other", keep_alive=0).done_reason == "unload"
    assert [m.model for m in mc.ps().models] == ["chat"]


def test_lora_adapters_are_ollama_models(qwen3_model_dir, tmp_path_factory, serve_module_app):
    """A LoRA adapter served as a model is listed by tags and ps and answers chat under its name."""
    from mlxhost.config import LoraSpec, ServerConfig
    from mlxhost.server.app import build_app
    from mlxhost.testing.lora_fixtures import train_adapter

    adapter = train_adapter(qwen3_model_dir, tmp_path_factory.mktemp("ollama-lora") / "alpha", seed=1, rank=4)
    live = serve_module_app(build_app(ServerConfig(model=str(qwen3_model_dir), served_model_name=SERVED_NAME,
                                                   loras=(LoraSpec("alpha", str(adapter)),))))
    lc = ollama.Client(host=live.url, timeout=120)
    assert {m.model for m in lc.list().models} == {SERVED_NAME, "alpha"}
    r = lc.chat(model="alpha", messages=[{"role": "user", "content": "hi"}], options=OPTIONS, keep_alive="5m")
    check_final(r)
    assert "alpha" in {m.model for m in lc.ps().models}
    assert lc.show("alpha").details is not None

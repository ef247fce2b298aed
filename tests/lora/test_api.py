"""LoRA adapters over HTTP, through the OpenAI client: each served as a model (`NAME` and `BASE:NAME`) listed
with its base, its greedy text mlx-lm's with the adapter loaded, alone and in concurrent requests mixing
adapters and the base; loaded and unloaded at run time (a 409 while in use); a malformed adapter a clear 400
at load and a start-up error."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from mlxhost.config import LoraSpec, ServerConfig
from mlxhost.lora.adapters import AdapterError
from mlxhost.models.loader import load_model
from mlxhost.server.app import build_app
from tests.e2e.conftest import start_app

pytestmark = pytest.mark.e2e  # a live server: the e2e lane

PROMPT = [5, 77, 300, 12, 9, 400, 23, 8, 61, 1200, 7]
MAX_NEW = 10


@pytest.fixture(scope="module")
def live(qwen3_model_dir, adapters):
    config = ServerConfig(model=str(qwen3_model_dir), served_model_name="tiny",
                          loras=(LoraSpec("alpha", adapters["alpha"]), LoraSpec("beta", adapters["beta"])))
    server = start_app(build_app(config))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def text_of(qwen3_model_dir, reference):
    tokenizer = load_model(str(qwen3_model_dir)).tokenizer

    def text(name: str | None, max_tokens: int = MAX_NEW) -> str:
        return tokenizer.decode(reference(name, PROMPT, max_tokens))

    return text


def complete(client: openai.OpenAI, model: str, max_tokens: int = MAX_NEW) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_adapters_are_listed_with_their_base(live):
    cards = {m.id: m for m in openai.OpenAI(base_url=live.base_url, api_key="x").models.list().data}
    assert set(cards) == {"tiny", "alpha", "beta"}
    assert cards["alpha"].parent == cards["alpha"].root == "tiny"
    assert cards["alpha"].status == "loaded"  # configured adapters load with their base
    one = httpx.get(f"{live.base_url}/models/tiny:beta").json()
    assert one["id"] == "beta" and one["parent"] == "tiny"


def test_name_and_base_colon_name_give_mlx_lm_s_text(live, text_of):
    client = openai.OpenAI(base_url=live.base_url, api_key="x")
    assert complete(client, "alpha") == complete(client, "tiny:alpha") == text_of("alpha")
    assert complete(client, "beta") == text_of("beta")
    assert complete(client, "tiny") == text_of(None)
    assert len({text_of(n) for n in (None, "alpha", "beta")}) == 3


def test_concurrent_requests_mixing_adapters_and_the_base(live, text_of):
    client = openai.OpenAI(base_url=live.base_url, api_key="x")
    models = ["tiny", "alpha", "beta", "tiny:alpha"] * 3
    with ThreadPoolExecutor(len(models)) as pool:
        texts = list(pool.map(lambda m: complete(client, m), models))
    for model, text in zip(models, texts):
        assert text == text_of(None if model == "tiny" else model.split(":")[-1]), model


def test_unknown_adapter_names_are_404(live):
    client = openai.OpenAI(base_url=live.base_url, api_key="x")
    for model in ("gamma", "nobase:alpha", "tiny:gamma"):
        with pytest.raises(openai.NotFoundError):
            complete(client, model)


def test_load_at_run_time_409_while_in_use_then_unload(live, adapters, text_of):
    http = httpx.Client(base_url=live.url, timeout=120)
    card = http.post("/v1/models/gamma/load", json={"lora_path": adapters["gamma"]}).json()
    assert card["id"] == "gamma" and card["status"] == "loaded" and card["parent"] == "tiny"
    client = openai.OpenAI(base_url=live.base_url, api_key="x")
    assert complete(client, "gamma") == text_of("gamma")
    stream = client.completions.create(model="gamma", prompt=PROMPT, max_tokens=400, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # running now
    busy = http.post("/v1/models/gamma/unload", json={})
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "model_busy"
    stream.close()
    for _ in range(200):  # the abort reaches the engine at its next step
        done = http.post("/v1/models/gamma/unload", json={})
        if done.status_code == 200:
            break
    assert done.status_code == 200 and done.json()["status"] == "not_loaded"
    # A request for it loads it again, as a model loads on first use.
    assert complete(client, "gamma") == text_of("gamma")
    assert http.get("/v1/models/gamma").json()["status"] == "loaded"


def test_a_malformed_adapter_is_a_clear_400(live, tmp_path, adapters):
    http = httpx.Client(base_url=live.url, timeout=60)
    (tmp_path / "adapter_config.json").write_text('{"fine_tune_type": "lora", "lora_parameters": {"rank": 4}}')
    (tmp_path / "adapters.safetensors").write_bytes(b"\x00" * 8)
    for body, needle in (({"lora_path": str(tmp_path / "nowhere")}, "does not exist"),
                         ({"lora_path": str(tmp_path)}, "has no scale"),
                         ({"lora_path": adapters["gamma"], "base": "nope"}, "does not exist")):
        r = http.post("/v1/models/broken/load", json=body)
        assert r.status_code in (400, 404) and needle in r.json()["error"]["message"], r.json()
    r = http.post("/v1/models/tiny/load", json={"lora_path": adapters["gamma"]})
    assert r.status_code == 400 and "already a model's name" in r.json()["error"]["message"]
    assert "broken" not in {c["id"] for c in http.get("/v1/models").json()["data"]}


def test_a_malformed_adapter_fails_start_up(qwen3_model_dir, tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"fine_tune_type": "dora", "lora_parameters": {"scale": 1}}')
    (tmp_path / "adapters.safetensors").write_bytes(b"\x00" * 8)
    with pytest.raises(AdapterError, match="dora"):
        build_app(ServerConfig(model=str(qwen3_model_dir), loras=(LoraSpec("bad", str(tmp_path)),)))

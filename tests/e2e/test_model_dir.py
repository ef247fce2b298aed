"""`mlxhost serve --model-dir DIR`: every model folder inside DIR served by its folder's name, loaded on
first use; `GET /v1/models/{id}` through the openai client; `/docs` with only local assets; the start-up
banner; a vision-language folder without the `vision` extra is a 400 naming it."""

from __future__ import annotations

import io
import re
import shutil

import httpx
import openai
import pytest

from mlxhost.config import EngineConfig, ServerConfig
from mlxhost.models.catalog import model_dir_specs
from mlxhost.server.app import build_app
from mlxhost.server.banner import make_ready_hook


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, qwen3_model_dir, llama_model_dir):
    root = tmp_path_factory.mktemp("model-dir")
    shutil.copytree(qwen3_model_dir, root / "qwen-tiny")
    shutil.copytree(llama_model_dir, root / "llama-tiny")
    return root


@pytest.fixture(scope="module")
def live(model_dir, serve_module_app):
    config = ServerConfig(models=tuple(model_dir_specs(model_dir)), max_loaded_models=2,
                          engine=EngineConfig(max_num_seqs=4, prefill_step_size=64))
    app = build_app(config)
    banner = io.StringIO()
    app.state.on_ready = make_ready_hook(config, app.state.models, app.state.model_specs, 8000, out=banner)
    server = serve_module_app(app)
    server.banner = banner.getvalue()
    return server


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


def test_every_folder_is_a_model_loaded_on_first_use(live, client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"qwen-tiny", "llama-tiny"}
    assert {c.model_extra["status"] for c in cards.values()} == {"not_loaded"}
    for name in ("qwen-tiny", "llama-tiny"):
        r = client.completions.create(model=name, prompt="The quick brown fox", max_tokens=4, temperature=0)
        assert r.model == name and r.usage.completion_tokens >= 1
    assert {m.model_extra["status"] for m in client.models.list().data} == {"loaded"}


def test_models_retrieve(live, client):
    card = client.models.retrieve("qwen-tiny")
    assert card.id == "qwen-tiny" and card.object == "model" and card.owned_by == "mlxhost"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found" and "qwen-tiny" in err.value.body["message"]


@pytest.mark.parametrize("path,marker", [("/docs", "swagger"), ("/redoc", "redoc")])
def test_docs_use_only_local_assets(live, path, marker):
    page = httpx.get(live.url + path, timeout=30)
    assert page.status_code == 200 and marker in page.text.lower()
    urls = re.findall(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""", page.text)
    assert urls and not [u for u in urls if u.startswith(("http:", "https:", "//"))], urls
    for url in urls:
        assert httpx.get(live.url + url, timeout=30).status_code == 200, url


def test_banner_names_url_models_memory_and_a_snippet(live):
    text = live.banner
    assert "ready on http://127.0.0.1:8000" in text
    assert "qwen-tiny" in text and "llama-tiny" in text and "load on first use" in text
    assert "ceiling" in text and "GiB" in text
    assert "/v1/chat/completions" in text and "curl http://127.0.0.1:8000/v1/chat/completions" in text
    assert "python3 -c 'import json, urllib.request as u" in text  # the standard library only: no openai needed


def test_vlm_without_vision_extra_is_a_400_naming_it(tmp_path_factory, qwen25vl_dir, serve_module_app, monkeypatch):
    root = tmp_path_factory.mktemp("vlm-dir")
    shutil.copytree(qwen25vl_dir, root / "vl")
    monkeypatch.setattr("mlxhost.models.extras.has_vision", lambda: False)
    server = serve_module_app(build_app(ServerConfig(models=tuple(model_dir_specs(root)))))
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   json={"model": "vl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert 'pip install "mlxhost[vision]"' in r.json()["error"]["message"]

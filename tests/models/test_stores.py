"""Ollama and LM Studio stores, fabricated: listed with their names and sizes, resolved by `ollama:NAME[:TAG]`,
served by name, and never written to."""

from __future__ import annotations

import hashlib
import json
from argparse import Namespace

import mlx.core as mx
import numpy as np
import pytest

from mlxhost.models.catalog import model_dir_specs, run_list, scan_model_dir
from mlxhost.models.loader import ModelLoadError, load_model
from mlxhost.models.stores import resolve_ollama, scan_ollama
from tests.models.gguf_files import write_gguf
from tests.models.test_gguf import _model

pytest.importorskip("gguf")


def _blob(store, data: bytes, media_type: str) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (store / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def _ollama_store(root, gguf_bytes: bytes) -> None:
    """Two tags of one model, one in a user namespace, and one whose blob is gone."""
    (root / "blobs").mkdir(parents=True)
    layers = [_blob(root, gguf_bytes, "application/vnd.ollama.image.model"),
              _blob(root, b"{{ .Prompt }}", "application/vnd.ollama.image.template"),
              _blob(root, b'{"stop": ["<|im_end|>"]}', "application/vnd.ollama.image.params")]
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:0",
                           "size": 2}, "layers": layers}
    for rel in ("registry.ollama.ai/library/tiny/latest", "registry.ollama.ai/library/tiny/q8",
                "registry.ollama.ai/someone/tool/1b"):
        path = root / "manifests" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(manifest))
    gone = dict(manifest, layers=[dict(layers[0], digest="sha256:" + "f" * 64)])
    (root / "manifests/registry.ollama.ai/library/gone").mkdir(parents=True)
    (root / "manifests/registry.ollama.ai/library/gone/latest").write_text(json.dumps(gone))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model, weights, hparams = _model("qwen2")
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, "qwen2", weights, hparams)
    return model, path


@pytest.fixture
def store(tmp_path, tiny_gguf, monkeypatch):
    root = tmp_path / "ollama"
    _ollama_store(root, tiny_gguf[1].read_bytes())
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    monkeypatch.setenv("MLXHOST_GGUF_CACHE", str(tmp_path / "gguf-cache"))
    monkeypatch.setenv("MLXHOST_GGUF_DTYPE", "float32")
    return root


def _snapshot(root) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_ollama_store_is_listed_by_name_and_size(store, tiny_gguf, capsys):
    models = {m.name: m for m in scan_ollama(store)}
    assert sorted(models) == ["someone/tool:1b", "tiny:latest", "tiny:q8"]  # "gone" lost its blob
    size = tiny_gguf[1].stat().st_size + len(b"{{ .Prompt }}") + len(b'{"stop": ["<|im_end|>"]}')
    assert models["tiny:latest"].num_bytes == size and models["tiny:latest"].has_template
    rows = {m.name: m for m in scan_model_dir(store)}
    assert sorted(rows) == sorted(models) and rows["tiny:q8"].servable and rows["tiny:q8"].family == "gguf:qwen2"
    assert run_list(Namespace(model_dir=[], no_hf_cache=True, server=None)) == 0
    out = capsys.readouterr().out
    assert f"Ollama ({store})" in out and "tiny:latest" in out and "someone/tool:1b" in out


def test_ollama_names_resolve_to_their_blob(store):
    blob = resolve_ollama("ollama:tiny")
    assert blob == resolve_ollama("ollama:tiny:latest") == resolve_ollama("ollama:registry.ollama.ai/library/tiny")
    assert resolve_ollama("ollama:someone/tool:1b") == blob  # the same GGUF, shared by digest
    with pytest.raises(ModelLoadError, match="did you mean tiny:latest"):
        resolve_ollama("ollama:tiny:lates")
    with pytest.raises(ModelLoadError, match="not an Ollama model name"):
        resolve_ollama("ollama:")


def test_served_by_name_without_writing_into_the_store(store, tiny_gguf):
    before = _snapshot(store)
    loaded = load_model("ollama:tiny:q8")
    ids = [5, 77, 120, 3]
    np.testing.assert_allclose(np.array(loaded.model(mx.array([ids]))[0]), np.array(tiny_gguf[0](mx.array([ids]))[0]),
                               atol=1e-4)
    assert loaded.source == "ollama:tiny:q8"
    specs = {s.name: s for s in model_dir_specs(store)}
    assert load_model(specs["tiny:latest"].source).config == loaded.config  # --model-dir serves the blob
    assert _snapshot(store) == before


def test_lmstudio_and_plain_gguf_folders(tmp_path, tiny_gguf):
    root = tmp_path / "lmstudio"
    for rel in ("publisher-a/Tiny-GGUF/tiny-Q4_K_M.gguf", "publisher-b/Two-GGUF/two-Q8_0.gguf",
                "publisher-b/Two-GGUF/two-F16.gguf", "loose.gguf"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(tiny_gguf[1].read_bytes())
    mlx_folder = root / "mlx-community" / "Tiny-4bit"
    mlx_folder.mkdir(parents=True)
    (mlx_folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    rows = {m.name: m for m in scan_model_dir(root)}
    assert sorted(rows) == ["loose", "mlx-community/Tiny-4bit", "publisher-a/Tiny-GGUF",
                            "publisher-b/Two-GGUF/two-F16", "publisher-b/Two-GGUF/two-Q8_0"]
    assert rows["publisher-a/Tiny-GGUF"].path == root / "publisher-a/Tiny-GGUF/tiny-Q4_K_M.gguf"
    assert all(r.servable for r in rows.values())

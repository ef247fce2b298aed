"""A process serving text models through mlx-lm keeps PyTorch out (models/torch_free.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from mlxhost.models.torch_free import TORCH_ENV, follow_parent, is_text_model, keep_torch_out


def _folder(tmp_path, name, config):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_text_models_are_told_apart_from_the_others(tmp_path):
    assert is_text_model(None)  # the demo model
    assert is_text_model(_folder(tmp_path, "qwen3", {"model_type": "qwen3"}))
    vlm = {"model_type": "qwen2_vl", "vision_config": {"model_type": "qwen2_vl"}}
    assert not is_text_model(_folder(tmp_path, "vlm", vlm))
    assert not is_text_model(_folder(tmp_path, "bert", {"model_type": "bert"}))
    assert not is_text_model(_folder(tmp_path, "whisper", {"model_type": "whisper"}))
    assert not is_text_model(str(tmp_path / "missing"))  # a hub id or a typo: torch stays
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    assert not is_text_model(str(bad))


def test_nothing_is_hidden_when_asked_to_keep_torch_or_once_transformers_is_in(monkeypatch):
    environ = {TORCH_ENV: "1"}
    assert not keep_torch_out(environ)
    monkeypatch.setitem(sys.modules, "transformers", sys.modules.get("transformers") or object())
    assert not keep_torch_out({})


# A torch that says it is 2.11 (so transformers counts it as installed) and fails when imported: whoever imports
# it shows up. `hide` runs keep_torch_out first, as `mlxhost serve` does for a text model.
_PROBE = textwrap.dedent("""
    import importlib.util, os, sys
    if sys.argv[1] == "hide":
        from mlxhost.models.torch_free import keep_torch_out
        assert keep_torch_out()
        assert importlib.util.find_spec("torch") is None and os.environ["MLXHOST_IMPORT_TORCH"] == "0"
    from mlxhost.models.loader import load_model
    loaded = load_model(sys.argv[2])
    print("loaded", len(loaded.tokenizer.encode("hello world")) > 0)
""")


def _fake_torch(root):
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    (root / "torch-2.11.0.dist-info").mkdir()
    (root / "torch-2.11.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")


def test_a_text_model_loads_without_importing_an_installed_torch(tmp_path, qwen3_model_dir):
    _fake_torch(tmp_path / "site")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), *sys.path]))
    env.pop(TORCH_ENV, None)
    run = lambda mode: subprocess.run([sys.executable, "-c", _PROBE, mode, str(qwen3_model_dir)],  # noqa: E731
                                      env=env, capture_output=True, text=True, timeout=300)
    hidden = run("hide")
    assert hidden.returncode == 0, hidden.stderr[-2000:]
    assert "loaded True" in hidden.stdout
    # The control: without it, transformers imports the installed torch on the way to the tokenizer (a
    # transformers that stops doing so leaves nothing to keep out: the control is moot then, not failed).
    plain = run("plain")
    if plain.returncode == 0:
        pytest.skip("this transformers loads the tokenizer without importing torch")
    assert "torch was imported" in plain.stderr


def test_serve_keeps_torch_out_only_when_every_model_is_a_text_model(tmp_path):
    from argparse import Namespace

    from mlxhost.server.serve_command import _text_models_only

    text = _folder(tmp_path, "qwen3", {"model_type": "qwen3"})
    vlm = _folder(tmp_path, "vlm", {"model_type": "qwen2_vl", "vision_config": {"model_type": "qwen2_vl"}})
    args = dict(model=text, draft_model=None, extra_models=None, model_dir=None, models_config=None)
    assert _text_models_only(Namespace(**args))
    assert _text_models_only(Namespace(**{**args, "model": None}))  # the demo model
    assert _text_models_only(Namespace(**{**args, "draft_model": text}))
    assert not _text_models_only(Namespace(**{**args, "draft_model": vlm}))
    assert not _text_models_only(Namespace(**{**args, "model": vlm}))
    assert not _text_models_only(Namespace(**{**args, "model": "org/some-hub-id"}))
    for other in ("extra_models", "model_dir", "models_config"):  # models chosen later: torch stays
        assert not _text_models_only(Namespace(**{**args, other: str(tmp_path)}))


def test_a_helper_process_follows_the_server(monkeypatch):
    monkeypatch.delitem(sys.modules, "transformers", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert not follow_parent({})  # started by a server that kept torch: it keeps it too
    assert not follow_parent({TORCH_ENV: "1"})
    assert "torch" not in sys.modules
    assert follow_parent({TORCH_ENV: "0"})
    assert sys.modules["torch"] is None  # the autouse fixture makes it importable again after the test

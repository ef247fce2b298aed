"""What `mlxhost serve MODEL` (and `convert`, `pull`) says when MODEL is a mistyped path, a folder that is no
model, or a hub id the hub cannot give: one line naming the problem and the next step, never a hub-library
message or a traceback; a hub id with no network fails once, without the download's retries."""

import os
import shutil
import socket
import subprocess
import sys

import pytest

from mlxhost.models.loader import ModelLoadError
from mlxhost.models.source import looks_local, resolve_source
from mlxhost.server.cli import main
from tests.models.fake_hub import FakeHub

REPO = "tiny-org/tiny-qwen3"
# A bound for the subprocess, not a timing check: before, an unreachable hub took ~30 s of retries.
_BOUND_S = 60


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def _run(args: list[str], hf_home, endpoint: str, offline: bool, code: str | None = None):
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "1" if offline else "0",
           "HF_HOME": str(hf_home), "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1",
           "no_proxy": "127.0.0.1"}
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN"):
        env.pop(name, None)
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "mlxhost.server.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=_BOUND_S)


def _serve_error(capsys, *argv) -> str:
    assert main(["serve", *argv]) == 2
    return capsys.readouterr().err.strip()


@pytest.mark.parametrize("text,local", [("/models/qwen3", True), ("~/models/Qwen3-0.6B", True), ("./qwen3", True),
                                        ("models/org/name", True), ("mlx-community/Qwen3-0.6B-4bit", False),
                                        ("gpt2", False)])
def test_looks_local(text, local):
    assert looks_local(text) is local


def test_a_missing_path_is_no_such_folder(tmp_path, capsys):
    (tmp_path / "Qwen3-0.6B-4bit").mkdir()
    err = _serve_error(capsys, str(tmp_path / "Qwen3-0.6B"))
    assert err == f"mlxhost serve: no such folder: {tmp_path / 'Qwen3-0.6B'} (did you mean Qwen3-0.6B-4bit?)"
    for path in ("~/no-such-models/Qwen3-0.6B", "./no-such-folder"):
        err = _serve_error(capsys, path)
        assert err == f"mlxhost serve: no such folder: {path}" and "Repo id" not in err


def test_a_relative_path_under_a_folder_here_is_local(tmp_path, monkeypatch, capsys):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    assert _serve_error(capsys, "models/qwen3") == "mlxhost serve: no such folder: models/qwen3"


def test_a_folder_without_config_says_what_is_missing(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _serve_error(capsys, str(empty)) == (
        f"mlxhost serve: {empty} is not a model folder: no config.json (expected a Hugging Face / MLX model"
        " folder, or a .gguf file)")
    (empty / "qwen3").mkdir()
    (empty / "qwen3" / "config.json").write_text("{}")
    assert _serve_error(capsys, str(empty)).endswith(
        "it holds model folders (qwen3): serve one of them, or all with --model-dir " + str(empty))
    some_file = tmp_path / "weights.bin"
    some_file.write_bytes(b"x")
    assert "is a file, not a model folder" in _serve_error(capsys, str(some_file))


def test_gguf_paths_are_left_to_the_gguf_loader(tmp_path):
    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_source(str(gguf)) == gguf
    assert resolve_source(str(tmp_path)) == tmp_path  # a folder holding a .gguf and no config.json


def test_model_entries_and_draft_model_are_checked_at_start(tmp_path, capsys):
    err = _serve_error(capsys, "--model", f"a={tmp_path / 'missing'}")
    assert err == f"mlxhost serve: no such folder: {tmp_path / 'missing'}"
    err = _serve_error(capsys, "--draft-model", str(tmp_path))
    assert "is not a model folder: no config.json" in err


def test_an_invalid_hub_id_is_not_a_hub_library_message(capsys):
    err = _serve_error(capsys, "two words/x y")
    assert err == "mlxhost serve: no such folder, and not a Hugging Face id (namespace/name): two words/x y"


def test_an_unreachable_hub_fails_once_with_the_next_step(tmp_path):
    result = _run(["serve", "some-org/some-model"], tmp_path / "hf", _closed_port_url(), offline=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no retry warnings, nothing printed twice
    assert lines[0].startswith("mlxhost serve: cannot reach the Hugging Face hub (http://127.0.0.1:")
    assert "some-org/some-model is not in its cache" in lines[0]
    assert "serve a local folder, run `mlxhost pull some-org/some-model` when online" in lines[0]
    assert "HF_HUB_OFFLINE=1" in lines[0]


def test_hf_hub_offline_fails_at_once_with_the_next_step(tmp_path):
    result = _run(["serve", "some-org/some-model"], tmp_path / "hf", _closed_port_url(), offline=True)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "mlxhost serve: some-org/some-model is not in the Hugging Face cache, and HF_HUB_OFFLINE is set: serve a"
        " local folder, or unset HF_HUB_OFFLINE and run `mlxhost pull some-org/some-model`")


def test_pull_and_convert_say_the_same(tmp_path):
    result = _run(["pull", "some-org/some-model"], tmp_path / "hf", _closed_port_url(), offline=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("mlxhost pull: cannot reach the Hugging Face hub")
    assert result.stderr.strip().endswith(": check the network (or HTTPS_PROXY) and try again")
    result = _run(["pull", "some-org/some-model"], tmp_path / "hf", _closed_port_url(), offline=True)
    assert result.stderr.strip().splitlines()[-1] == ("mlxhost pull: HF_HUB_OFFLINE is set: unset it to download"
                                                      " some-org/some-model")
    result = _run(["convert", str(tmp_path / "nope"), str(tmp_path / "out")], tmp_path / "hf", _closed_port_url(),
                  offline=True)
    assert result.returncode == 2
    assert result.stderr.strip() == f"mlxhost convert: no such folder: {tmp_path / 'nope'}"


@pytest.fixture(scope="module")
def hub_repo(tmp_path_factory, qwen3_model_dir):
    folder = tmp_path_factory.mktemp("hub-repo") / "m"
    shutil.copytree(qwen3_model_dir, folder)
    return folder


_LOAD = ("from mlxhost.models.loader import load_model; m = load_model({repo!r});"
         " print(m.source, m.config['model_type'])")


def test_a_hub_id_downloads_once_then_loads_from_the_cache_offline(hub_repo, tmp_path):
    with FakeHub(REPO, hub_repo) as hub:
        result = _run([], tmp_path / "hf", hub.url, offline=False, code=_LOAD.format(repo=REPO))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [REPO, "qwen3"]
    assert any(r.startswith(f"GET /{REPO}/resolve/") for r in hub.requests)
    # The hub is gone and HF_HUB_OFFLINE is set: the cached snapshot serves.
    result = _run([], tmp_path / "hf", _closed_port_url(), offline=True, code=_LOAD.format(repo=REPO))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [REPO, "qwen3"]


def test_an_unknown_hub_id_is_named(hub_repo, tmp_path):
    with FakeHub(REPO, hub_repo) as hub:
        result = _run(["serve", "someone/else"], tmp_path / "hf", hub.url, offline=False)
    assert result.returncode == 2
    assert result.stderr.strip() == ("mlxhost serve: someone/else: not found on the Hugging Face hub (a private"
                                     " one needs `hf auth login` or HF_TOKEN)")


def test_resolve_source_raises_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such folder"):
        resolve_source(str(tmp_path / "x"))

"""`mlxhost pull` against a fake hub on 127.0.0.1 (tests/models/fake_hub.py): files land in the
Hugging Face cache layout (or --local-dir) and progress shows on stderr."""

import os
import subprocess
import sys

import pytest

from mlxhost.testing.demo import build_model_folder
from tests.models.fake_hub import COMMIT, FakeHub

REPO = "tiny-org/tiny-qwen3"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return build_model_folder(tmp_path_factory.mktemp("hub-repo"))


def _pull(hub: FakeHub, hf_home, *args: str) -> subprocess.CompletedProcess:
    # CI exports HF_HUB_OFFLINE=1 for the whole run; only this subprocess may reach the (fake) hub.
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(hf_home),
           "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "mlxhost.server.cli", "pull", REPO, *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_pull_fills_the_cache_layout_and_shows_progress(model_folder, tmp_path):
    with FakeHub(REPO, model_folder) as hub:
        result = _pull(hub, tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    repo = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-qwen3"
    assert (repo / "refs" / "main").read_text().strip() == COMMIT
    snapshot = repo / "snapshots" / COMMIT
    for name, data in hub.files.items():
        assert (snapshot / name).read_bytes() == data
        assert (snapshot / name).is_symlink()  # the cache keeps blobs once, snapshots link to them
    assert len(list((repo / "blobs").iterdir())) == len(hub.files)
    assert "pulling tiny-org/tiny-qwen3" in result.stderr
    assert "Fetching" in result.stderr and "%" in result.stderr  # tqdm bars, though stderr is a pipe
    assert str(snapshot) in result.stdout and "qwen3" in result.stdout and "servable" in result.stdout
    assert any(r.startswith("GET /tiny-org/tiny-qwen3/resolve/") for r in hub.requests)


def test_pull_again_downloads_nothing(model_folder, tmp_path):
    with FakeHub(REPO, model_folder) as hub:
        assert _pull(hub, tmp_path / "hf").returncode == 0
        hub.requests.clear()
        assert _pull(hub, tmp_path / "hf").returncode == 0
    assert not any(r.startswith("GET /tiny-org/tiny-qwen3/resolve/") for r in hub.requests)


def test_pull_into_local_dir_at_a_revision(model_folder, tmp_path):
    out = tmp_path / "local"
    with FakeHub(REPO, model_folder) as hub:
        result = _pull(hub, tmp_path / "hf", "--revision", COMMIT, "--local-dir", str(out))
    assert result.returncode == 0, result.stderr
    assert {p.name for p in out.iterdir() if p.is_file()} == set(hub.files)
    assert (out / "config.json").read_bytes() == hub.files["config.json"]


def test_unknown_repo_is_a_clear_error(model_folder, tmp_path):
    with FakeHub("someone/else", model_folder) as hub:
        result = _pull(hub, tmp_path / "hf")
    assert result.returncode == 2
    assert "not found" in result.stderr and "Traceback" not in result.stderr

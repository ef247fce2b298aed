"""The first minutes: the banner's curl and Python lines run as printed against a live server (the Python line on
the standard library alone: the openai package is no dependency of the plain install), the demo model is said to
be random, and `mlxhost list` shows the demo model and what a running server serves."""

import json
import shlex
import shutil
import subprocess
import sys

import pytest

from mlxhost.config import EngineConfig, SecurityConfig, ServerConfig
from mlxhost.server import cli
from mlxhost.server.app import build_app
from mlxhost.server.banner import TRY_MAX_TOKENS, BannerModel, format_banner, is_demo_source, try_lines
from mlxhost.testing.needs import find
from tests.e2e.conftest import SERVED_NAME, start_app

_BOUND_S = 120  # a bound for each subprocess, not a timing check


def _banner_lines(url: str, needs_key: bool) -> tuple[str, str]:
    text = format_banner("0", url, [BannerModel(SERVED_NAME, "x", "loaded")], "m", needs_key=needs_key)
    curl = next(line.strip() for line in text.splitlines() if line.strip().startswith("curl "))
    python = next(line.strip() for line in text.splitlines() if line.strip().startswith("python3 -c "))
    return curl, python


def _run(line: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=_BOUND_S,
                          env={"PATH": "/usr/bin:/bin", **(env or {})})


def _plain_python(line: str) -> str:
    # -S: no site-packages at all, so the line proves it needs nothing beyond the standard library.
    assert line.startswith("python3 -c ")
    return f"{shlex.quote(sys.executable)} -S" + line[len("python3"):]


@pytest.mark.needs("curl")
def test_the_curl_line_runs_and_asks_for_a_few_tokens(server):
    curl, _ = _banner_lines(server.url, needs_key=False)
    result = _run(curl)
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert isinstance(reply["choices"][0]["message"]["content"], str)
    assert 1 <= reply["usage"]["completion_tokens"] <= TRY_MAX_TOKENS


def test_the_python_line_runs_on_the_standard_library(server):
    _, python = _banner_lines(server.url, needs_key=False)
    assert "openai" not in python
    result = _run(_plain_python(python))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def keyed_server(qwen3_model_dir):
    config = ServerConfig(model=str(qwen3_model_dir), served_model_name=SERVED_NAME,
                          engine=EngineConfig(max_num_seqs=2, prefill_step_size=64),
                          security=SecurityConfig(api_keys=("sk-first-contact",)))
    live = start_app(build_app(config))
    yield live
    live.stop()


def test_with_an_api_key_both_lines_read_it_from_the_environment(keyed_server):
    curl, python = _banner_lines(keyed_server.url, needs_key=True)
    env = {"MLXHOST_API_KEY": "sk-first-contact"}
    result = _run(_plain_python(python), env)
    assert result.returncode == 0, result.stderr
    if find("curl"):  # optional here: the python line above is checked on every machine
        result = _run(curl, env)
        assert "choices" in json.loads(result.stdout), result.stdout
    assert "401" in _run(_plain_python(python), {"MLXHOST_API_KEY": "wrong"}).stderr


def test_the_demo_model_is_said_to_be_random(tmp_path, monkeypatch):
    demo_dir = tmp_path / "demo-model"
    monkeypatch.setattr("mlxhost.testing.demo.default_demo_model_dir", lambda: demo_dir)
    assert is_demo_source(str(demo_dir)) and not is_demo_source(str(tmp_path / "other"))
    text = format_banner("0", "http://127.0.0.1:8000", [BannerModel("demo", str(demo_dir), "loaded")], "m",
                         needs_key=False, demo=True)
    assert "the demo model has random weights: its replies are gibberish by design" in text
    assert "mlxhost serve mlx-community/Qwen3-0.6B-4bit" in text
    plain = format_banner("0", "http://127.0.0.1:8000", [BannerModel("q", "q", "loaded")], "m", needs_key=False)
    assert "random weights" not in plain
    assert f'"max_tokens": {TRY_MAX_TOKENS}' in try_lines("http://h:1", "q", False)[0]


def test_list_shows_the_demo_model_and_what_a_server_serves(server, qwen3_model_dir, tmp_path, monkeypatch,
                                                            capsys):
    demo_dir = tmp_path / "demo-model"
    shutil.copytree(qwen3_model_dir, demo_dir)
    monkeypatch.setattr("mlxhost.testing.demo.default_demo_model_dir", lambda: demo_dir)
    monkeypatch.delenv("MLXHOST_API_KEY", raising=False)
    assert cli.main(["list", "--no-hf-cache", "--server", server.url]) == 0
    out = capsys.readouterr().out
    assert "Demo model (random weights: its replies are gibberish by design" in out
    assert str(demo_dir) in out
    assert f"Served at {server.url}: 1 model(s)" in out and f"  {SERVED_NAME}  (loaded)" in out


def test_list_says_when_no_server_answers(capsys):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert cli.main(["list", "--no-hf-cache", "--server", url]) == 0
    assert f"Served at {url}: no server answers" in capsys.readouterr().out

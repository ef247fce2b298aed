"""`mlxhost launch`: the environment and config files each agent gets, and the server's life around the agent
(fake agents and a fake /v1/models server: no agent CLI, no model)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from mlxhost.agents import AGENTS, Target, launch
from mlxhost.agents.base import default_max_output_tokens
from mlxhost.server import cli

TARGET = Target(url="http://127.0.0.1:8123", model="demo", api_key="k1", context_tokens=131072,
                max_output_tokens=512)


def test_registry_names_commands_and_packages():
    assert sorted(AGENTS) == ["claude", "codex", "opencode", "qwen"]
    assert AGENTS["claude"].install_command == "npm install -g @anthropic-ai/claude-code"
    assert AGENTS["codex"].npm_package == "@openai/codex"
    assert AGENTS["qwen"].command == "qwen"


def test_claude_code_env(tmp_path):
    env = AGENTS["claude"].configure(TARGET, tmp_path).env
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8123"  # the SDK adds /v1/messages itself
    assert env["ANTHROPIC_AUTH_TOKEN"] == "k1" and env["ANTHROPIC_API_KEY"] == ""
    for name in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                 "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        assert env[name] == "demo"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "131072"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "512"
    assert env["DISABLE_TELEMETRY"] == env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"


def test_codex_home_config(tmp_path):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setup = AGENTS["codex"].configure(TARGET, tmp_path / "codex")
    assert setup.env["CODEX_HOME"] == str(tmp_path / "codex")
    config = tomllib.loads((tmp_path / "codex" / "config.toml").read_text())
    assert config["model"] == "demo" and config["model_provider"] == "mlxhost"
    assert config["model_context_window"] == 131072
    assert config["model_auto_compact_token_limit"] < 131072
    assert config["analytics"] == {"enabled": False} and config["check_for_update_on_startup"] is False
    provider = config["model_providers"]["mlxhost"]
    assert provider["base_url"] == "http://127.0.0.1:8123/v1"
    assert provider["wire_api"] == "responses"
    assert setup.env[provider["env_key"]] == "k1"
    assert provider["env_key"] != "MLXHOST_API_KEY"  # a server the agent starts must not require it


def test_codex_config_quotes_names(tmp_path):
    tomllib = pytest.importorskip("tomllib")
    odd = Target(url="http://h:1", model='my "model"\\x', api_key="k", context_tokens=4096, max_output_tokens=1)
    AGENTS["codex"].configure(odd, tmp_path)
    assert tomllib.loads((tmp_path / "config.toml").read_text())["model"] == 'my "model"\\x'


def test_opencode_config_content(tmp_path):
    env = AGENTS["opencode"].configure(TARGET, tmp_path).env
    config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
    provider = config["provider"]["mlxhost"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": "http://127.0.0.1:8123/v1", "apiKey": "k1"}
    assert provider["models"]["demo"]["limit"] == {"context": 131072, "output": 512}
    assert config["model"] == config["small_model"] == "mlxhost/demo"
    assert env["OPENCODE_DISABLE_MODELS_FETCH"] == "1" and config["share"] == "disabled"


def test_qwen_code_env_and_settings(tmp_path):
    setup = AGENTS["qwen"].configure(TARGET, tmp_path / "qwen")
    env = setup.env
    assert (env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"], env["OPENAI_MODEL"]) == (
        "http://127.0.0.1:8123/v1", "k1", "demo")
    assert env["QWEN_CODE_MAX_OUTPUT_TOKENS"] == "512"
    settings = json.loads(open(env["QWEN_CODE_SYSTEM_SETTINGS_PATH"]).read())
    assert settings["model"]["generationConfig"]["contextWindowSize"] == 131072
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    assert setup.args == ("--auth-type", "openai")


def test_default_max_output_tokens():
    assert default_max_output_tokens(131072) == 32000
    assert default_max_output_tokens(4096) == 1024


@pytest.mark.parametrize("argv, expected", [
    (["launch", "codex", "--", "exec", "hi"], (["launch", "codex"], ["exec", "hi"])),
    (["--log-level", "debug", "launch", "claude", "m", "--", "-p", "x"],
     (["--log-level", "debug", "launch", "claude", "m"], ["-p", "x"])),
    (["launch", "qwen"], (["launch", "qwen"], [])),
    (["serve", "--", "x"], (["serve", "--", "x"], [])),  # only launch splits
])
def test_split_agent_args(argv, expected):
    assert launch.split_agent_args(argv) == expected


def _models_client(cards, status=200):
    return httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(status, json={"data": cards})))


def test_find_model_by_name_alias_or_first_loaded():
    cards = [{"id": "a", "status": "unloaded", "aliases": []},
             {"id": "b", "status": "loaded", "aliases": ["/models/b"], "max_model_len": 4096}]
    with _models_client(cards) as c:
        assert launch.find_model("http://x", None, "k", c)["id"] == "b"
        assert launch.find_model("http://x", "a", "k", c)["id"] == "a"
        assert launch.find_model("http://x", "/models/b", "k", c)["id"] == "b"
        with pytest.raises(launch.LaunchError, match="serves a, b, not c"):
            launch.find_model("http://x", "c", "k", c)
    with _models_client([], status=401) as c, pytest.raises(launch.LaunchError, match="API key"):
        launch.find_model("http://x", None, "k", c)


def test_find_model_when_nothing_answers():
    assert launch.find_model("http://127.0.0.1:1", None, "k") is None


def test_missing_cli_prints_the_install_command(monkeypatch, capsys):
    monkeypatch.setattr(launch, "find_command", lambda command: None)
    assert cli.main(["launch", "claude"]) == 127
    assert "npm install -g @anthropic-ai/claude-code" in capsys.readouterr().err


class _Models(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the stdlib's name)
        body = json.dumps({"data": [{"id": "fake", "status": "loaded", "aliases": [], "max_model_len": 8192}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_agent(tmp_path, monkeypatch):
    """`claude` as a script that records its argv and environment and exits with 3."""
    record = tmp_path / "agent.json"
    script = tmp_path / "agent.py"
    script.write_text("import json, os, sys\n"
                      f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(record)!r}, 'w'))\n"
                      "sys.exit(3)\n")
    monkeypatch.setattr(launch, "find_command", lambda command: None if command != "claude" else "agent")
    monkeypatch.setattr(launch, "agent_folder", lambda name: tmp_path / "agents" / name)
    real_call = subprocess.call
    monkeypatch.setattr(launch.subprocess, "call",
                        lambda cmd, env: real_call([sys.executable, str(script), *cmd[1:]], env=env))
    return record


def test_launch_reuses_a_running_server(fake_agent):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Models)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        port = httpd.server_address[1]
        assert cli.main(["launch", "claude", "--port", str(port), "--", "-p", "hello"]) == 3
    finally:
        httpd.shutdown()
    seen = json.loads(fake_agent.read_text())
    assert seen["argv"] == ["-p", "hello"]
    assert seen["env"]["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"
    assert seen["env"]["ANTHROPIC_MODEL"] == "fake"
    assert seen["env"]["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "8192"
    assert seen["env"]["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "2048"


def test_launch_stops_the_server_it_started(fake_agent, monkeypatch, tmp_path):
    started = []

    def start(args, log_path):  # a stand-in for `mlxhost serve` that answers /v1/models
        code = ("import sys; sys.path.insert(0, %r); from test_agent_launch import _Models; "
                "from http.server import HTTPServer; HTTPServer(('127.0.0.1', %d), _Models).serve_forever()"
                % (str(__import__("pathlib").Path(__file__).parent), args.port))
        started.append(subprocess.Popen([sys.executable, "-c", code]))
        return started[0]

    monkeypatch.setattr(launch, "start_server", start)
    import socket

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["launch", "claude", "--port", str(port), "--max-output-tokens", "77"]) == 3
    assert started[0].poll() is not None  # stopped when the agent exited
    assert json.loads(fake_agent.read_text())["env"]["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "77"


def test_started_server_lets_answers_run_long(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(launch.subprocess, "Popen", lambda cmd, **kwargs: seen.setdefault("cmd", cmd))
    args = cli.make_parser(with_bench=False).parse_args(
        ["launch", "codex", "m", "--port", "9", "--serve-arg=--max-num-seqs=4"])
    launch.start_server(args, tmp_path / "serve.log")
    cmd = seen["cmd"]
    assert cmd[cmd.index("serve") + 1] == "m" and cmd[cmd.index("--port") + 1] == "9"
    # Codex sends no limit: the server's default must not cut its answers at 2048 tokens.
    assert cmd[cmd.index("--default-max-tokens") + 1] == "32000"
    assert cmd[-1] == "--max-num-seqs=4"

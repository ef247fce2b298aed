"""Distributed servers for the tests: `mlxhost serve --tensor-parallel 2` (or pipeline) as a real
subprocess that starts its second rank itself over the ring backend on loopback.

A real process, not the in-process server of tests/e2e: the fault tests kill ranks and check that the
server process exits. Every wait is bounded."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

SERVED_NAME = "tiny"
_START_TIMEOUT_S = 150  # a bound for start-up on a shared 2-core machine, not a timing check
_SRC = str(Path(__file__).resolve().parents[2] / "src")


@dataclass
class DistServer:
    proc: subprocess.Popen
    url: str
    log_path: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rank_pids(self) -> list[int]:
        """The pids of the ranks rank 0 started (from its log line)."""
        m = re.search(r"started \d+ local rank\(s\) over \w+: pids ([\d, ]+)", self.log())
        assert m, self.log()
        return [int(p) for p in m.group(1).split(",")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_dist_server(model_dir, tmp_path: Path, *flags: str) -> DistServer:
    """The server process, started and not waited for."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log_path = tmp_path / f"server-{port}.log"
    env = {**os.environ, "PYTHONPATH": _SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "mlxhost.server.cli", "serve", str(model_dir), "--port", str(port),
           "--served-model-name", SERVED_NAME, "--memory-mode", "dedicated", "--no-web-ui", *flags]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return DistServer(proc, f"http://127.0.0.1:{port}", log_path)


def start_dist_server(model_dir, tmp_path: Path, *flags: str) -> DistServer:
    server = spawn_dist_server(model_dir, tmp_path, *flags)
    proc = server.proc
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise AssertionError(f"the server did not come up in {_START_TIMEOUT_S} s:\n{server.log()}")


@pytest.fixture(scope="session")
def qwen2_model_dir(tmp_path_factory):
    """A tiny random Qwen2 (a family mlx-lm pipelines), 4 layers so each of 2 stages holds 2."""
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer

    from mlxhost.testing.demo import EOS_TOKEN, PAD_TOKEN, build_tokenizer
    from mlxhost.testing.families import INIT_STD, _random_model

    out = tmp_path_factory.mktemp("qwen2")
    build_tokenizer(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    config = {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": True, "max_position_embeddings": 4096,
        "vocab_size": tokenizer.get_vocab_size(), "eos_token_id": tokenizer.token_to_id(EOS_TOKEN),
        "pad_token_id": tokenizer.token_to_id(PAD_TOKEN), "bos_token_id": None, "initializer_range": INIT_STD,
        "torch_dtype": "float32",
    }
    save_model(out, _random_model(config, seed=2))
    save_config(config, config_path=out / "config.json")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    return out


@pytest.fixture
def anyio_backend():
    return "asyncio"

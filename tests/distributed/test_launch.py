"""Ranks started the way `mlx.launch` starts them (each runs the same command with MLX_RANK and
MLX_HOSTFILE set): they serve, stop together on a graceful shutdown, and a rank holding another
model is named at start-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.distributed.conftest import _SRC, _free_port

_BOUND_S = 150  # start-up and exit bounds, not timing checks


def _launch(model_dirs, tmp_path):
    """The ranks, and the HTTP port: every port distinct (taken together, as mlxhost's own launch does)."""
    from mlxhost.distributed.launch import _free_ports

    port, *ring = _free_ports(len(model_dirs) + 1)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ring]))
    procs = []
    for rank, model_dir in enumerate(model_dirs):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile),
               "PYTHONPATH": _SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
        log = open(tmp_path / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mlxhost.server.cli", "serve", str(model_dir), "--tensor-parallel", str(len(model_dirs)),
             "--port", str(port), "--served-model-name", "tiny", "--memory-mode", "dedicated", "--no-web-ui"],
            stdout=log, stderr=subprocess.STDOUT, env=env))
    return procs, port


def _logs(tmp_path, n):
    return "\n".join((tmp_path / f"rank{r}.log").read_text(errors="replace") for r in range(n))


def _wait_all(procs, timeout_s):
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append("hung")
    return codes


def test_launched_ranks_serve_and_stop_together(qwen3_model_dir, tmp_path):
    procs, port = _launch([qwen3_model_dir, qwen3_model_dir], tmp_path)
    try:
        deadline = time.monotonic() + _BOUND_S
        while True:
            assert all(p.poll() is None for p in procs), _logs(tmp_path, 2)
            assert time.monotonic() < deadline, "not ready:\n" + _logs(tmp_path, 2)
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        procs[0].send_signal(signal.SIGINT)  # a graceful stop of rank 0 stops rank 1 too
        assert _wait_all(procs, 60) == [0, 0], _logs(tmp_path, 2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_a_rank_with_another_model_is_named(qwen3_model_dir, llama_model_dir, tmp_path):
    procs, _ = _launch([qwen3_model_dir, llama_model_dir], tmp_path)
    codes = _wait_all(procs, _BOUND_S)
    logs = _logs(tmp_path, 2)
    assert "hung" not in codes, logs
    assert all(c != 0 for c in codes), logs
    assert "rank 1" in logs and "has another model" in logs, logs


@pytest.mark.parametrize("flags", [["--tensor-parallel", "2", "--pipeline-parallel", "2"],
                                   ["--tensor-parallel", "3"]])
def test_bad_layouts_are_refused_before_loading(qwen3_model_dir, flags):
    env = {**os.environ, "PYTHONPATH": _SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "mlxhost.server.cli", "serve", str(qwen3_model_dir), "--port",
                        str(_free_port()), *flags], capture_output=True, text=True, env=env, timeout=_BOUND_S)
    assert r.returncode == 2, r.stderr
    assert "cannot be combined" in r.stderr or "does not divide" in r.stderr, r.stderr


def test_tensor_parallel_over_nccl_turns_cuda_graphs_off_unless_told():
    from mlxhost.distributed.config import DistributedConfig
    from mlxhost.distributed.launch import cuda_graphs_setting

    env: dict[str, str] = {}
    assert cuda_graphs_setting(DistributedConfig(tensor_parallel=2, backend="nccl"), env) == "0"
    assert env == {"MLX_USE_CUDA_GRAPHS": "0"}
    kept = {"MLX_USE_CUDA_GRAPHS": "1"}  # the user's choice stands
    assert cuda_graphs_setting(DistributedConfig(tensor_parallel=2, backend="nccl"), kept) is None
    assert kept == {"MLX_USE_CUDA_GRAPHS": "1"}
    for dist in (DistributedConfig(tensor_parallel=2, backend="ring"),
                 DistributedConfig(pipeline_parallel=2, backend="nccl")):
        env = {}
        assert cuda_graphs_setting(dist, env) is None and env == {}


def test_ranks_told_to_shut_down_get_to_close_by_themselves():
    """Rank 0 waits for ranks it told to shut down (they flush their SSD tier) before ending the rest."""
    from mlxhost.distributed.launch import LocalRanks

    closing = [sys.executable, "-c", "import time; time.sleep(1.5)"]  # a rank still flushing its blocks
    told = LocalRanks([subprocess.Popen(closing)])
    told.stop(grace_s=_BOUND_S)
    assert told.children[0].returncode == 0
    untold = LocalRanks([subprocess.Popen(closing)])
    untold.stop()  # a rank that was not told (a failed start, a lost rank) is ended at once
    assert untold.children[0].returncode == -signal.SIGTERM

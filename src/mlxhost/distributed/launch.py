"""Starting the ranks: under `mlx.launch` they exist already (MLX_RANK is set); on one host without a
launcher, mlxhost starts the other local ranks itself, as subprocesses, over loopback."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from mlxhost.distributed.config import DistributedConfig

log = logging.getLogger(__name__)

# Set in the ranks mlxhost starts itself: each exits when the process that started it is gone.
# (Not MLXHOST_*: those are read as serve flags.)
PARENT_ENV = "MLXSRV_PARENT_PID"
BACKEND_ENV = "MLXSRV_BACKEND"
WORLD_ENV = "MLXSRV_WORLD_SIZE"
LOG_LEVEL_ENV = "MLXSRV_LOG_LEVEL"
WORKER_MODULE = "mlxhost.distributed.worker"
CONTROL_ENV = "MLXSRV_CONTROL"  # rank 0's control address (host:port), for the ranks mlxhost starts
CONTROL_HOST_ENV = "MLXSRV_CONTROL_HOST"  # under a launcher: the address rank 0 listens on for the others


@dataclass
class LocalRanks:
    """The rank processes this process started (empty under a launcher)."""

    children: list[subprocess.Popen] = field(default_factory=list)
    hostfile: str | None = None

    def stop(self, timeout_s: float = 5.0, grace_s: float = 0.0) -> None:
        """Ends the ranks. `grace_s`: how long ranks that were told to shut down get to close by themselves
        first (their SSD tier flushes the blocks still queued; a terminated rank would lose them)."""
        end = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        for child in self.children:
            try:
                child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
        if self.hostfile is not None and os.path.exists(self.hostfile):
            os.unlink(self.hostfile)


CUDA_GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"


def cuda_graphs_setting(dist: DistributedConfig, environ=os.environ) -> str | None:
    """Tensor parallel over NCCL runs without MLX-CUDA's graphs unless MLX_USE_CUDA_GRAPHS says otherwise.
    MLX captures every collective into the step's graph (stream capture of the NCCL call): a decode step of a
    split model, two all-reduces a layer, spent more host time capturing than the graphs saved: on 2 GPUs a lone
    stream's step took 68-82 ms with graphs against 12.5 ms without (8B 4-bit shape), 49.2 against 26.4 ms (32B
    bf16; docs/distributed.md). MLX reads the
    variable once, at its first kernel, so this runs before any rank computes (the ranks mlxhost starts
    inherit it). Returns the value set, or None where nothing was changed."""
    if dist.backend != "nccl" or dist.tensor_parallel < 2 or CUDA_GRAPHS_ENV in environ:
        return None
    environ[CUDA_GRAPHS_ENV] = "0"
    return "0"


def under_launcher() -> bool:
    return "MLX_RANK" in os.environ


def spawn_local_ranks(dist: DistributedConfig, control: str, log_level: str = "info") -> LocalRanks:
    """Starts ranks 1..N-1 on this host and sets this process up as rank 0. Each rank connects to
    `control` (rank 0's control port) first. The ring backend gets a hosts file of loopback ports (the
    format mlx.launch writes); NCCL its rendezvous address. On a CUDA host each rank gets one GPU."""
    n = dist.world_size
    env = {PARENT_ENV: str(os.getpid()), BACKEND_ENV: dist.backend, WORLD_ENV: str(n), LOG_LEVEL_ENV: log_level.upper(),
           CONTROL_ENV: control}
    ranks = LocalRanks()
    if dist.backend == "ring":
        hosts = [[f"127.0.0.1:{port}"] for port in _free_ports(n)]
        fd, ranks.hostfile = tempfile.mkstemp(prefix="mlxhost-hosts-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(hosts, f)
        env["MLX_HOSTFILE"] = ranks.hostfile
    elif dist.backend == "nccl":
        env.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(_free_ports(1)[0]), MLX_WORLD_SIZE=str(n))
    else:
        raise ValueError(f"the {dist.backend} backend needs its ranks started by mlx.launch (a hosts file); "
                         "on one host mlxhost starts ranks itself with --backend ring or nccl")
    gpus = _gpus_per_rank(n, dist.backend)
    for rank in range(1, n):
        child_env = {**os.environ, **env, "MLX_RANK": str(rank)}
        if gpus is not None:
            child_env["CUDA_VISIBLE_DEVICES"] = gpus[rank]
        ranks.children.append(subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=child_env))
    # This process is rank 0: the variables mx.distributed.init reads (before any GPU is touched).
    os.environ.update({k: v for k, v in env.items() if not k.startswith("MLXSRV_")}, MLX_RANK="0")
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]
    log.info("started %d local rank(s) over %s: pids %s", n - 1, dist.backend,
             ", ".join(str(c.pid) for c in ranks.children))
    return ranks


def _gpus_per_rank(n: int, backend: str) -> list[str] | None:
    """One GPU per rank on a CUDA host (of CUDA_VISIBLE_DEVICES when set), for any backend: ring ranks
    on one GPU would share it. None elsewhere."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d for d in visible.split(",") if d.strip()] if visible else None
    if backend != "nccl" and not _cuda_build():
        return None
    if devices is None:
        return [str(r) for r in range(n)]
    if len(devices) < n:
        raise ValueError(f"{n} ranks need {n} GPUs; CUDA_VISIBLE_DEVICES names {len(devices)}")
    return devices[:n]


def init_group(backend: str, world_size: int) -> Any:
    import mlx.core as mx  # lazy: mlx only when used

    group = mx.distributed.init(strict=True, backend=backend)
    if group.size() != world_size:
        raise ValueError(f"the launcher started {group.size()} ranks but --tensor-parallel / --pipeline-parallel "
                         f"ask for {world_size}")
    return group


def _cuda_build() -> bool:
    """Whether MLX's CUDA build is installed, asked without starting CUDA here: rank 0's own
    CUDA_VISIBLE_DEVICES is set only after this, and CUDA reads it once, at its start."""
    from importlib.metadata import PackageNotFoundError, distributions  # lazy: importlib.metadata only when used

    try:
        return any((d.metadata["Name"] or "").lower().replace("_", "-").startswith("mlx-cuda") for d in distributions())
    except PackageNotFoundError:
        return False


def control_host() -> str:
    """The address the other ranks reach rank 0 at, under a launcher: MLXSRV_CONTROL_HOST, else the one
    NCCL's rendezvous or the ring hosts file names for rank 0, else this host's name."""
    if os.environ.get(CONTROL_HOST_ENV):
        return os.environ[CONTROL_HOST_ENV]
    if os.environ.get("NCCL_HOST_IP"):
        return os.environ["NCCL_HOST_IP"]
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and os.path.exists(hostfile):
        try:
            with open(hostfile) as f:
                first = json.load(f)[0]
            entry = first[0] if isinstance(first, list) else first.get("ips", [None])[0]
            if entry:
                return entry.rsplit(":", 1)[0] if entry.count(":") == 1 else entry
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            pass
    return socket.gethostname()


def share_control_address(group: Any, backend: str, address: str | None) -> str:
    """Under a launcher: rank 0's control address to every rank, in the one collective of start-up
    that is not the model's (the ranks know nothing else of each other)."""
    import mlx.core as mx  # lazy: mlx only when used
    import numpy as np  # lazy: numpy only when used

    buf = np.zeros(256, dtype=np.uint8)
    if group.rank() == 0:
        raw = address.encode()
        buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    out = mx.distributed.all_sum(mx.array(buf), group=group, stream=mx.gpu if backend == "nccl" else mx.cpu)
    return bytes(np.array(out)).rstrip(b"\0").decode()


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints every thread's Python stack to the rank's log: where a stuck rank waits."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)

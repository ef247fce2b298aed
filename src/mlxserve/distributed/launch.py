"""Starting the ranks: under `mlx.launch` they exist already (MLX_RANK is set); on one host without a
launcher, mlxserve starts the other local ranks itself, as subprocesses, over loopback."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from mlxserve.distributed.config import DistributedConfig

log = logging.getLogger(__name__)

# Set in the ranks mlxserve starts itself: each exits when the process that started it is gone.
# (Not MLXSERVE_*: those are read as serve flags.)
PARENT_ENV = "MLXSRV_PARENT_PID"
BACKEND_ENV = "MLXSRV_BACKEND"
WORLD_ENV = "MLXSRV_WORLD_SIZE"
LOG_LEVEL_ENV = "MLXSRV_LOG_LEVEL"
WORKER_MODULE = "mlxserve.distributed.worker"


@dataclass
class LocalRanks:
    """The rank processes this process started (empty under a launcher)."""

    children: list[subprocess.Popen] = field(default_factory=list)
    hostfile: str | None = None

    def stop(self, timeout_s: float = 5.0) -> None:
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


def under_launcher() -> bool:
    return "MLX_RANK" in os.environ


def spawn_local_ranks(dist: DistributedConfig, log_level: str = "info") -> LocalRanks:
    """Starts ranks 1..N-1 on this host and sets this process up as rank 0. The ring backend gets a
    hosts file of loopback ports (the format mlx.launch writes); NCCL its rendezvous address and one
    GPU per rank."""
    n = dist.world_size
    env = {PARENT_ENV: str(os.getpid()), BACKEND_ENV: dist.backend, WORLD_ENV: str(n), LOG_LEVEL_ENV: log_level.upper()}
    ranks = LocalRanks()
    if dist.backend in ("ring", "nccl"):
        # NCCL ranks get a ring hosts file too: their step plans travel over it (see plan_channel).
        hosts = [[f"127.0.0.1:{port}"] for port in _free_ports(n)]
        fd, ranks.hostfile = tempfile.mkstemp(prefix="mlxserve-hosts-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(hosts, f)
        env["MLX_HOSTFILE"] = ranks.hostfile
    if dist.backend == "nccl":
        env.update(NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(_free_ports(1)[0]), MLX_WORLD_SIZE=str(n))
    elif dist.backend != "ring":
        raise ValueError(f"the {dist.backend} backend needs its ranks started by mlx.launch (a hosts file); "
                         "on one host mlxserve starts ranks itself with --backend ring or nccl")
    for rank in range(1, n):
        child_env = {**os.environ, **env, "MLX_RANK": str(rank)}
        if dist.backend == "nccl":
            child_env["CUDA_VISIBLE_DEVICES"] = str(rank)
        ranks.children.append(subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=child_env))
    # This process is rank 0: the variables mx.distributed.init reads (before any GPU is touched).
    os.environ.update({k: v for k, v in env.items() if not k.startswith("MLXSRV_")}, MLX_RANK="0")
    if dist.backend == "nccl":
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    log.info("started %d local rank(s) over %s: pids %s", n - 1, dist.backend,
             ", ".join(str(c.pid) for c in ranks.children))
    return ranks


def init_group(backend: str, world_size: int) -> Any:
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend=backend)
    if group.size() != world_size:
        raise ValueError(f"the launcher started {group.size()} ranks but --tensor-parallel / --pipeline-parallel "
                         f"ask for {world_size}")
    return group


def plan_channel(group: Any, backend: str) -> Any:
    """The channel of the step plans. NCCL runs collectives on the GPU stream, queued behind the step's
    forward, so a plan sent there waits for it and the GPU idles while the next step is built. Where
    a ring hosts file is given too (the local ranks mlxserve starts), plans go over a second group,
    a CPU-side ring, while the GPU computes; the model's own collectives stay on NCCL."""
    import mlx.core as mx

    from mlxserve.distributed.channel import Channel

    if backend == "nccl" and os.environ.get("MLX_HOSTFILE"):
        try:
            ring = mx.distributed.init(strict=True, backend="ring")  # NCCL stays the default group
            if ring.size() == group.size() and ring.rank() == group.rank():
                return Channel(ring, mx.cpu)
        except RuntimeError as exc:
            log.warning("step plans go over NCCL (the ring side channel failed: %s)", exc)
    return Channel(group, mx.gpu if backend == "nccl" else mx.cpu)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()

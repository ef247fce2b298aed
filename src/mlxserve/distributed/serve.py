"""`mlxserve serve MODEL --tensor-parallel N`: the start-up of every rank.

1. The ranks exist (mlx.launch started them, or rank 0 starts its local ones) and join one group.
2. Rank 0 sends the setup (model, engine settings, seed); every rank reports its versions and model
   fingerprint; rank 0 names any rank that differs and all stop.
3. Each rank loads its shard; rank 0 serves HTTP, the others follow its steps until it shuts down.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import socket
from dataclasses import dataclass
from typing import Any

from mlxserve.server.config import EngineConfig, ServerConfig
from mlxserve.distributed.channel import Channel
from mlxserve.distributed.config import DistributedConfig
from mlxserve.distributed.launch import LocalRanks, init_group, plan_channel, spawn_local_ranks, under_launcher
from mlxserve.distributed.supervisor import Supervisor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setup:
    """What rank 0 tells the others before anything loads (its flags are the ones that count)."""

    source: str
    engine: EngineConfig
    dist: DistributedConfig
    seed: int


@dataclass(frozen=True)
class Identity:
    rank: int
    host: str
    versions: tuple[tuple[str, str], ...]
    model: str  # shard.fingerprint of this rank's model folder


def identity(rank: int, source: str) -> Identity:
    from importlib.metadata import PackageNotFoundError, version

    import mlx.core as mx

    from mlxserve import __version__
    from mlxserve.distributed.shard import fingerprint, local_folder

    try:
        mlx_lm = version("mlx-lm")
    except PackageNotFoundError:
        mlx_lm = "not installed"
    try:
        model = fingerprint(local_folder(source))
    except (OSError, ValueError) as exc:  # reported by rank 0 with the others
        model = f"unreadable ({exc})"
    versions = (("mlxserve", __version__), ("mlx", mx.__version__), ("mlx-lm", mlx_lm))
    return Identity(rank, socket.gethostname(), versions, model)


def differences(everyone: list[Identity]) -> str | None:
    """A sentence naming each rank that differs from rank 0, or None."""
    lead, problems = everyone[0], []
    for other in everyone[1:]:
        for (name, mine), (_, theirs) in zip(lead.versions, other.versions):
            if mine != theirs:
                problems.append(f"rank {other.rank} ({other.host}) has {name} {theirs}, rank 0 has {mine}")
        if other.model != lead.model:
            problems.append(f"rank {other.rank} ({other.host}) has another model (fingerprint {other.model}, "
                            f"rank 0 {lead.model}): same config.json and weight files needed")
    return "; ".join(problems) or None


def _check_ranks(channel: Channel, source: str) -> None:
    everyone = channel.gather(identity(channel.rank, source))
    verdict = channel.broadcast(differences(everyone) if channel.rank == 0 else None)
    if verdict is not None:
        raise ValueError(f"the ranks differ: {verdict}")


def serve_distributed(config: ServerConfig, dist: DistributedConfig) -> int:
    """Runs this process's rank: rank 0 serves until shut down, the others follow it."""
    from mlxserve.server import process

    if config.models:
        raise ValueError("--tensor-parallel / --pipeline-parallel serve one model: name it as MODEL")
    _check_local_model(config.model, dist)  # before any rank is started
    if config.engine.memory_mode == "desktop":
        log.warning("--memory-mode desktop follows rank 0's free memory only; with several machines use "
                    "--memory-mode dedicated (the KV budget then is the smallest rank's)")
    ranks = LocalRanks() if under_launcher() else spawn_local_ranks(dist, config.log_level)
    sock = supervisor = None
    try:
        group = init_group(dist.backend, dist.world_size)
        if group.rank() != 0:  # started by mlx.launch with the same command line
            run_follower(group, dist.backend, config.model)
            return 0
        sock = process.bind(config.host, config.port)  # a port in use is reported before the model loads
        supervisor = Supervisor(ranks, dist.step_timeout_s)
        try:
            app = _build_lead(config, dist, group, supervisor, sock.getsockname()[1])
        except RuntimeError as exc:  # e.g. the ring backend: a rank that failed during start-up closed its link
            raise ValueError(f"start-up failed: {exc} (the other ranks' logs say why)") from exc
        process.run(app, sock, config.log_level, config.shutdown_timeout_s, process.switch_interval_s())
        return 0
    finally:
        if supervisor is not None:
            supervisor.closing()  # ranks exiting from here on are expected
        if sock is not None:
            sock.close()
        ranks.stop()


def _check_local_model(source: str | None, dist: DistributedConfig) -> None:
    import json
    from pathlib import Path

    from mlxserve.distributed.shard import check_shardable

    if source is not None and (Path(source) / "config.json").is_file():
        check_shardable(json.loads((Path(source) / "config.json").read_text()), dist)


def _build_lead(config: ServerConfig, dist: DistributedConfig, group: Any, supervisor: Any, port: int):
    from mlxserve.server.banner import make_ready_hook
    from mlxserve.distributed.engine import DistributedEngineCore, RankContext
    from mlxserve.distributed.shard import load_sharded
    from mlxserve.server.app import build_app, model_specs

    source = model_specs(config)[0].source  # the demo model when none is named
    channel = plan_channel(group, dist.backend)
    setup = Setup(source, config.engine, dist, random.getrandbits(32))
    channel.broadcast(setup)
    _check_ranks(channel, source)
    loaded = load_sharded(source, group, dist)
    channel.barrier()  # every rank loaded: nobody waits on a collective during another's load
    supervisor.start()
    ctx = RankContext(dist, channel, setup.seed, supervisor)
    loaded.make_engine_core = functools.partial(DistributedEngineCore, ctx=ctx)
    app = build_app(config, loaded)
    ready = make_ready_hook(config, app.state.models, app.state.model_specs, port)

    async def on_ready() -> None:
        supervisor.attach(asyncio.get_running_loop(), app.state.end_streams)
        await ready()

    app.state.on_ready = on_ready
    log.info("serving over %d ranks (%s, %s backend)", dist.world_size, dist.layout, dist.backend)
    return app


def run_follower(group: Any, backend: str, own_source: str | None = None) -> None:
    """A rank > 0: takes rank 0's setup, loads its shard, follows rank 0's steps until shutdown.
    `own_source`: this host's path of the model (mlx.launch runs the same command everywhere); the
    ranks mlxserve starts itself use rank 0's."""
    from mlxserve.distributed.engine import DistributedEngineCore, RankContext, follow_until_shutdown
    from mlxserve.distributed.shard import fingerprint, load_sharded, local_folder
    from mlxserve.engine.runner.batch import make_buckets
    from mlxserve.server.app import resolve_max_model_len

    channel = plan_channel(group, backend)
    setup: Setup = channel.broadcast()
    source = own_source or setup.source
    _check_ranks(channel, source)
    loaded = load_sharded(source, group, setup.dist)
    channel.barrier()
    engine = setup.engine
    buckets = make_buckets(engine.max_num_seqs) if engine.decode_buckets == "on" else None
    ctx = RankContext(setup.dist, channel, setup.seed)
    core = DistributedEngineCore(loaded.model, loaded.tokenizer, engine, resolve_max_model_len(loaded, engine),
                                 buckets, fingerprint(local_folder(source)), ctx=ctx)
    log.info("rank %d/%d ready: following rank 0", channel.rank, channel.size)
    follow_until_shutdown(core)
    log.info("rank %d: rank 0 shut down", channel.rank)


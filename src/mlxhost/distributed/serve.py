"""`mlxhost serve MODEL --tensor-parallel N`: the start-up of every rank.

1. The ranks exist (mlx.launch started them, or rank 0 starts its local ones) and connect to rank 0's
   control port (channel.py: plain TCP). From then on rank 0 watches them: a rank that fails or dies
   ends the whole start-up within a second, with its reason.
2. Rank 0 sends the setup (model, engine settings, seed); every rank reports its versions and model
   fingerprint; rank 0 names any rank that differs and all stop.
3. The ranks join the mx.distributed group, load their shards and build their engines. On rank 0 all
   of this runs on the engine thread, the one thread that does MLX work there; the others do it on
   their main thread. Rank 0 serves HTTP, the others follow its steps until it shuts down.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxhost import __version__
from mlxhost.config import EngineConfig, ServerConfig
from mlxhost.distributed.channel import Channel, ControlServer, LostRank, connect
from mlxhost.distributed.config import DistributedConfig
from mlxhost.distributed.launch import (
    LocalRanks,
    control_host,
    cuda_graphs_setting,
    dump_stacks_on_sigusr1,
    init_group,
    share_control_address,
    spawn_local_ranks,
    under_launcher,
)
from mlxhost.distributed.shard import check_shardable, fingerprint, load_sharded, load_text_side, local_folder
from mlxhost.distributed.supervisor import Supervisor
from mlxhost.platform.kernel_cache import use_persistent_kernel_cache
from mlxhost.server.banner import make_ready_hook

# The ranks mlxhost starts connect within this (they import MLX first); a launcher's may take longer.
_CONNECT_S = 120.0
# Ranks told to shut down get this long to close by themselves (flush their SSD tier) before being ended.
_RANKS_CLOSE_S = 30.0

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
    from importlib.metadata import PackageNotFoundError, version  # lazy: importlib.metadata only when used

    import mlx.core as mx  # lazy: mlx only when used

    try:
        mlx_lm = version("mlx-lm")
    except PackageNotFoundError:
        mlx_lm = "not installed"
    try:
        model = fingerprint(local_folder(source))
    except (OSError, ValueError) as exc:  # reported by rank 0 with the others
        model = f"unreadable ({exc})"
    versions = (("mlxhost", __version__), ("mlx", mx.__version__), ("mlx-lm", mlx_lm))
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


def _check_ranks(channel: Channel, source: str) -> bool:
    """Stops every rank where they differ. Returns, on rank 0, whether all ranks run on its host."""
    everyone = channel.gather(identity(channel.rank, source))
    verdict = channel.broadcast(differences(everyone) if channel.rank == 0 else None)
    if verdict is not None:
        raise ValueError(f"the ranks differ: {verdict}")
    return everyone is not None and all(i.host == everyone[0].host for i in everyone)


def serve_distributed(config: ServerConfig, dist: DistributedConfig) -> int:
    """Runs this process's rank: rank 0 serves until shut down, the others follow it."""
    from mlxhost.server import process  # lazy: pulls in uvicorn

    if config.models:
        raise ValueError("--tensor-parallel / --pipeline-parallel serve one model: name it as MODEL")
    _check_local_model(config.model, dist)  # before any rank is started
    dump_stacks_on_sigusr1()
    if cuda_graphs_setting(dist) is not None:
        log.info("tensor parallel over NCCL: MLX-CUDA's graphs are off on every rank (MLX_USE_CUDA_GRAPHS=0; "
                 "set it to 1 to keep them)")
    if config.engine.memory_mode == "desktop":
        log.warning("--memory-mode desktop follows rank 0's free memory only; with several machines use "
                    "--memory-mode dedicated (the KV budget then is the smallest rank's)")
    group = control = None
    if under_launcher():  # started by mlx.launch with the same command line: the group tells who is who
        group = init_group(dist.backend, dist.world_size)
        if group.rank() != 0:
            address = share_control_address(group, dist.backend, None)
            return follower_main(address, group.rank(), group.size(), group, config.model)
        control = ControlServer("0.0.0.0", advertise=control_host())
    sock = process.bind(config.host, config.port)  # a port in use is reported before any rank starts
    supervisor = channel = None
    ranks = LocalRanks()
    try:
        if group is None:
            control = ControlServer()
            ranks = spawn_local_ranks(dist, control.address, config.log_level)
        else:
            share_control_address(group, dist.backend, control.address)
        supervisor = Supervisor(ranks, dist.step_timeout_s)
        try:
            channel = control.accept(dist.world_size, _CONNECT_S, supervisor.dead_rank)
        except LostRank as exc:
            raise ValueError(f"start-up failed: {exc} (its log says why)") from exc
        supervisor.start(channel)  # from here a rank lost ends the start-up, or the server, at once
        try:
            app = _build_lead(config, dist, channel, supervisor, sock.getsockname()[1], group)
        except LostRank as exc:
            raise ValueError(f"start-up failed: {exc}") from exc
        process.run(app, sock, config.log_level, config.shutdown_timeout_s, process.switch_interval_s())
        return 0
    finally:
        if supervisor is not None:
            supervisor.closing()  # ranks exiting from here on are expected
        if channel is not None:
            channel.close()
        sock.close()
        told = channel is not None and channel.last_sent
        ranks.stop(grace_s=_RANKS_CLOSE_S if told else 0.0)


def _check_local_model(source: str | None, dist: DistributedConfig) -> None:
    if source is not None and (Path(source) / "config.json").is_file():
        check_shardable(json.loads((Path(source) / "config.json").read_text()), dist)


def _build_lead(config: ServerConfig, dist: DistributedConfig, channel: Any, supervisor: Any, port: int,
                group: Any = None):
    """Rank 0's app: the model is loaded on the engine thread (`_lead_core`), tokenizer and config here."""
    from mlxhost.distributed.engine import RankContext  # lazy: pulls in mlx_lm
    from mlxhost.server.app import build_app, model_specs  # lazy: pulls in fastapi

    source = model_specs(config)[0].source  # the demo model when none is named
    setup = Setup(source, config.engine, dist, random.getrandbits(32))
    channel.broadcast(setup)
    one_host = _check_ranks(channel, source)
    loaded = load_text_side(source)
    ctx = RankContext(dist, channel, setup.seed, supervisor, one_host=one_host)
    loaded.make_engine_core = functools.partial(_lead_core, ctx=ctx, group=group, source=source)
    app = build_app(config, loaded)
    ready = make_ready_hook(config, app.state.models, app.state.model_specs, port)

    async def on_ready() -> None:
        supervisor.attach(asyncio.get_running_loop(), app.state.end_streams)
        await ready()

    app.state.on_ready = on_ready
    log.info("serving over %d ranks (%s, %s backend)", dist.world_size, dist.layout, dist.backend)
    return app


def _lead_core(model: Any, tokenizer: Any, engine: EngineConfig, max_model_len: int, buckets: Any, model_key: str,
               *, ctx: Any, group: Any, source: str):
    """Rank 0's engine core, built on its engine thread: the group, the shard and every forward after
    belong to that one thread (`model` is None: nothing was loaded on the main thread)."""
    from mlxhost.distributed.engine import DistributedEngineCore  # lazy: pulls in mlx_lm

    ctx.channel.broadcast("join")  # the others join the group now
    group = group if group is not None else init_group(ctx.dist.backend, ctx.dist.world_size)
    loaded = load_sharded(source, group, ctx.dist)
    ctx.channel.barrier()  # every rank loaded: nobody waits on a collective during another's load
    return DistributedEngineCore(loaded.model, tokenizer, engine, max_model_len, buckets, model_key, ctx=ctx)


def follower_main(address: str, rank: int, size: int, group: Any = None, own_source: str | None = None) -> int:
    """A rank > 0 from connecting to rank 0 to its exit; an error is reported to rank 0 (which ends the
    start-up, or the server, with it) before this rank exits."""
    def lost(reason: str) -> None:  # rank 0 is gone: this rank may be stuck in a collective, so exit now
        log.error("rank %d stops: %s", rank, reason)
        logging.shutdown()
        os._exit(1)

    channel = connect(address, rank, size, lost, timeout_s=_CONNECT_S)
    try:
        run_follower(channel, group, own_source)
    except Exception as exc:
        log.error("rank %d stops: %s", rank, exc, exc_info=not isinstance(exc, (ValueError, LostRank)))
        channel.report_error(f"{type(exc).__name__}: {exc}")
        channel.close()
        return 1
    channel.close()
    return 0


def run_follower(channel: Any, group: Any = None, own_source: str | None = None) -> None:
    """A rank > 0: takes rank 0's setup, loads its shard, follows rank 0's steps until shutdown.
    `own_source`: this host's path of the model (mlx.launch runs the same command everywhere); the
    ranks mlxhost starts itself use rank 0's. All of its MLX work runs on this (the main) thread."""
    # lazy: pulls in mlx_lm
    from mlxhost.distributed.engine import DistributedEngineCore, RankContext, follow_until_shutdown
    from mlxhost.engine.assemble import assemble_core  # lazy: pulls in mlx_lm
    from mlxhost.server.app import resolve_max_model_len  # lazy: pulls in fastapi

    channel.set_phase("waiting for the setup")
    setup: Setup = channel.broadcast()
    source = own_source or setup.source
    _check_ranks(channel, source)
    channel.set_phase("waiting for rank 0 to join the group")
    channel.broadcast()
    channel.set_phase("joining the group")

    use_persistent_kernel_cache()  # rank 0's folder (build_app points it there), before this rank compiles
    group = group if group is not None else init_group(setup.dist.backend, setup.dist.world_size)
    channel.set_phase("loading its shard")
    loaded = load_sharded(source, group, setup.dist)
    channel.barrier()
    channel.set_phase("building its engine (memory profile)")
    engine = setup.engine
    ctx = RankContext(setup.dist, channel, setup.seed)
    # Assembled as rank 0's core is: the core takes rank 0's decode buckets (every shape must match rank 0's),
    # and its warm-up is rank 0's steps, run below as they come.
    core = assemble_core(loaded.model, loaded.tokenizer, engine, resolve_max_model_len(loaded, engine),
                         model_key=fingerprint(local_folder(source)),
                         make_core=functools.partial(DistributedEngineCore, ctx=ctx)).core
    log.info("rank %d/%d ready: following rank 0", channel.rank, channel.size)
    follow_until_shutdown(core)
    log.info("rank %d: rank 0 shut down", channel.rank)

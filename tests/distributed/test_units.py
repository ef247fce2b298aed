"""The pieces of distributed serving that need no second process: the config, the start-up comparison,
the control channel (both ends in this process), the forward log, the prefix cache's call recording,
and the divergence check."""

from __future__ import annotations

import socket
import threading
import time

import mlx.core as mx
import pytest

import mlxhost.distributed.channel as channel_module
from mlxhost.config import EngineConfig
from mlxhost.distributed.channel import Channel, ControlServer, LostRank, connect
from mlxhost.distributed.config import DistributedConfig, choose_handoff
from mlxhost.distributed.engine import (
    DistributedRunner,
    DivergenceError,
    RankContext,
    StepPlan,
    fixed_speculation,
    step_digest,
)
from mlxhost.distributed.serve import Identity, differences
from mlxhost.engine.scheduler import SchedulerOutput
from mlxhost.kv.cache_ops import CacheResults, DropBlock, LoadBlock


def test_config_checks_and_layout():
    with pytest.raises(ValueError, match="cannot be combined"):
        DistributedConfig(tensor_parallel=2, pipeline_parallel=2)
    with pytest.raises(ValueError, match="backend"):
        DistributedConfig(tensor_parallel=2, backend="tcp")
    with pytest.raises(ValueError, match="send/recv"):  # MLX's NCCL backend has none
        DistributedConfig(pipeline_parallel=2, backend="nccl", pipeline_handoff="sendrecv")
    assert choose_handoff(DistributedConfig(pipeline_parallel=2, backend="nccl").pipeline_handoff, "nccl") == "gather"
    assert choose_handoff("auto", "ring") == "sendrecv" and choose_handoff("gather", "ring") == "gather"
    assert DistributedConfig(tensor_parallel=4).layout == "tp4"
    assert DistributedConfig(pipeline_parallel=2).layout == "pp2"
    assert not DistributedConfig().is_distributed


def test_stage_split_is_mlx_lms():
    """The last rank runs the first layers, the low ranks one more (mlx-lm's PipelineMixin split)."""
    from mlxhost.distributed.pipeline import split_layers

    assert split_layers(4, 2) == [(2, 4), (0, 2)]
    assert split_layers(5, 2) == [(2, 5), (0, 2)]
    assert split_layers(7, 3) == [(4, 7), (2, 4), (0, 2)]
    with pytest.raises(ValueError, match="cannot be split"):
        split_layers(1, 2)


def test_pipeline_refusals_before_loading():
    """Families outside our stage need mlx-lm's send/recv pipeline: refused over NCCL, named."""
    from mlxhost.distributed.shard import check_shardable

    check_shardable({"model_type": "qwen3", "num_attention_heads": 4}, DistributedConfig(pipeline_parallel=2,
                                                                                         backend="nccl"))
    with pytest.raises(ValueError, match="send/recv"):
        check_shardable({"model_type": "deepseek_v3"}, DistributedConfig(pipeline_parallel=2, backend="nccl"))
    with pytest.raises(ValueError, match="gather serves"):
        check_shardable({"model_type": "deepseek_v3"}, DistributedConfig(pipeline_parallel=2,
                                                                         pipeline_handoff="gather"))


def test_differences_name_the_rank_and_what_differs():
    versions = (("mlxhost", "0.1.0"), ("mlx", "0.32.4"), ("mlx-lm", "0.32.2"))
    lead = Identity(0, "mac-a", versions, "abc")
    same = Identity(1, "mac-b", versions, "abc")
    assert differences([lead, same]) is None
    old_mlx = Identity(2, "mac-c", (("mlxhost", "0.1.0"), ("mlx", "0.31.0"), ("mlx-lm", "0.32.2")), "abc")
    other_model = Identity(3, "mac-d", versions, "def")
    text = differences([lead, same, old_mlx, other_model])
    assert "rank 2 (mac-c) has mlx 0.31.0, rank 0 has 0.32.4" in text
    assert "rank 3 (mac-d) has another model" in text
    assert "rank 1" not in text


def _pair(size: int = 2):
    """A lead channel and its followers over loopback; `lost` collects what each side was told it lost."""
    server = ControlServer()
    lost = {"lead": [], **{r: [] for r in range(1, size)}}
    followers = {}
    threads = [threading.Thread(target=lambda r=r: followers.__setitem__(
        r, connect(server.address, r, size, lost[r].append, timeout_s=10))) for r in range(1, size)]
    for t in threads:
        t.start()
    lead = server.accept(size, timeout_s=10)
    for t in threads:
        t.join(10)
    lead.on_lost = lost["lead"].append
    return lead, followers, lost


def _wait_for(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_channel_broadcasts_gathers_and_reports_steps():
    lead, followers, lost = _pair(3)
    try:
        big = bytes(range(256)) * 1000
        assert lead.broadcast({"plan": big}) == {"plan": big}
        assert all(f.broadcast() == {"plan": big} for f in followers.values())
        for r, f in followers.items():
            assert f.gather(("rank", r)) is None
        assert lead.gather(("rank", 0)) == [("rank", 0), ("rank", 1), ("rank", 2)]
        followers[1].set_phase("running step 7")
        followers[2].report_step(7, 0.001, 0.02, [(8, 172), (16, 1)])
        _wait_for(lambda: lead.signatures[2].get(7) == [(8, 172), (16, 1)] and lead.peers[1].phase == "running step 7")
        assert "rank 1: running step 7 for" in lead.describe_peers()
        assert lead.peers[2].last_step == 7
        assert lost == {"lead": [], 1: [], 2: []}
    finally:
        lead.close()
        for f in followers.values():
            f.close()


def test_a_follower_error_or_exit_reaches_rank_0_at_once():
    lead, followers, lost = _pair(3)
    try:
        followers[1].report_error("ValueError: out of memory loading the shard")
        _wait_for(lambda: lost["lead"])
        assert lost["lead"] == ["rank 1 failed: ValueError: out of memory loading the shard"]
        with pytest.raises(LostRank, match="rank 1 failed"):
            lead.gather(None, timeout_s=5)
        followers[2]._sock.shutdown(socket.SHUT_RDWR)  # a rank that died: its connection closes
        _wait_for(lambda: len(lost["lead"]) == 2)
        assert lost["lead"][1].startswith("rank 2 closed its connection")
        lead.close()  # and rank 0 gone: the follower is told (it exits; here it only records it)
        _wait_for(lambda: lost[1])
        assert lost[1][0].startswith("rank 0 closed its connection")
    finally:
        lead.close()


def test_rank_0s_hang_up_after_its_last_broadcast_is_no_loss(monkeypatch):
    """A follower still closing its engine when rank 0 hangs up after the shutdown plan exits 0: rank 0's
    hang-up then is the end. Before that plan the same hang-up is a loss (the follower may be stuck)."""
    lead, followers, lost = _pair(3)
    try:
        lead.broadcast("step 0")
        lead.broadcast_last("shut down")
        lead.close()  # before either follower has read a thing: both are still "closing their engine"
        for f in followers.values():
            assert f.broadcast() == "step 0"
            for _ in range(3):  # reporting the step it ran to a rank 0 that hung up is no error either
                f.set_phase("running step 0")
                f.report_step(0, 0.0, 0.0, [])
                time.sleep(0.01)
            assert f.broadcast() == "shut down"
            with pytest.raises(LostRank):  # its reader saw the hang-up (and decided) before queueing this
                f.broadcast()
        assert lost == {"lead": [], 1: [], 2: []}
        # One that never finishes closing still ends (a launcher's ranks have nobody else to end them).
        monkeypatch.setattr(channel_module, "CLOSE_AFTER_LAST_S", 0.2)
        lead2, followers2, lost2 = _pair(2)
        lead2.broadcast_last("shut down")
        lead2.close()
        assert followers2[1].broadcast() == "shut down"
        _wait_for(lambda: lost2[1])
        assert "did not finish closing" in lost2[1][0]
        followers2[1].close()
    finally:
        lead.close()
        for f in followers.values():
            f.close()


def test_the_control_port_refuses_a_connection_without_the_token():
    server = ControlServer()
    host, port = server.address.split("/")[0].rsplit(":", 1)
    intruder = socket.create_connection((host, int(port)))
    intruder.sendall(b"\x01\x00\x00\x00" + b"0" * 32)  # rank 1, a wrong token
    good = {}
    t = threading.Thread(target=lambda: good.setdefault("f", connect(server.address, 1, 2, lambda r: None)))
    t.start()
    lead = server.accept(2, timeout_s=10)
    t.join(10)
    try:
        assert set(lead.peers) == {1}
        assert intruder.recv(1) == b""  # closed without a reply
    finally:
        intruder.close()
        lead.close()
        good["f"].close()


def test_a_rank_that_never_connects_fails_the_start_quickly():
    server = ControlServer()
    started = time.monotonic()
    with pytest.raises(LostRank, match="exited with code 1 before it connected"):
        server.accept(2, timeout_s=60, dead=lambda: "rank 1 (pid 123) exited with code 1")
    assert time.monotonic() - started < 30  # a bound, not a timing check: the dead rank is seen at once


def test_forward_log_records_shapes_and_wraps_once():
    from mlxhost.distributed.forward import RankForward, wrap

    calls = []
    model = lambda x, cache=None: calls.append(x.shape) or x  # noqa: E731
    wrapped = wrap(model, staged=False)
    assert wrap(wrapped, staged=False) is wrapped and isinstance(wrapped, RankForward)
    wrapped(mx.zeros((8, 172)))
    wrapped(mx.zeros((16, 1)), cache=None)
    assert wrapped.take_calls() == [(8, 172), (16, 1)]
    assert wrapped.take_calls() == []


@pytest.fixture(scope="module")
def tiny(qwen3_model_dir):
    from mlxhost.kv.kinds.probe import probe_kv
    from mlxhost.models.loader import load_model

    loaded = load_model(str(qwen3_model_dir))
    return loaded, probe_kv(loaded.model).layout


class _FakeChannel(Channel):
    def __init__(self, plans):
        self.rank, self.size, self._plans = 1, 2, list(plans)

    def broadcast(self, obj=None):
        return self._plans.pop(0)


def test_a_rank_that_sampled_other_tokens_stops(tiny):
    loaded, _ = tiny
    runner = DistributedRunner(loaded.model)
    plans = [StepPlan(0, SchedulerOutput(), digest=0), StepPlan(1, SchedulerOutput(), digest=12345)]
    runner.attach(RankContext(DistributedConfig(tensor_parallel=2), _FakeChannel(plans), seed=0))
    assert runner.follow()  # an empty step: digest of no tokens
    with pytest.raises(DivergenceError, match="diverged"):
        runner.follow()


def test_every_rank_runs_the_plans_cache_ops_and_their_results_are_checked(tiny):
    from mlxhost.engine.runner.model_runner import StepTokens
    from mlxhost.kv.store.kv_store import KVBlock, KVBlockStore

    loaded, layout = tiny
    store = KVBlockStore(layout, 16)
    for b in (1, 2):
        store.put(b, bytes([b]), KVBlock({"kv": mx.zeros((1, 1, 16, 1))}))
    # Rank 0's plan: block 2 evicted, block 3 loaded from disk (rank 0's load succeeded: its digest says so).
    ops = [DropBlock(2), LoadBlock(3, b"\x03", tuple(range(16)))]
    lead = step_digest(StepTokens(), CacheResults())
    plans = [StepPlan(0, SchedulerOutput(cache_ops=ops), digest=0), StepPlan(1, SchedulerOutput(), digest=lead)]
    runner = DistributedRunner(loaded.model, store=store, block_size=16)
    runner.attach(RankContext(DistributedConfig(tensor_parallel=2), _FakeChannel(plans), seed=0))
    assert runner.follow()
    assert store.stats()["memory"]["num_blocks"] == 1  # the same drop as rank 0's
    assert runner.cache_results == CacheResults(failed_loads=(3,))  # no SSD tier here: the load failed
    with pytest.raises(DivergenceError, match="loads"):
        runner.follow()


def test_shutdown_plan_ends_the_follower(tiny):
    loaded, _ = tiny
    runner = DistributedRunner(loaded.model)
    runner.attach(RankContext(DistributedConfig(tensor_parallel=2), _FakeChannel([StepPlan(0, None)]), seed=0))
    assert runner.follow() is False


def test_a_follower_takes_rank_0s_tiled_kernel_limit(qwen3_4bit_model_dir):
    """While rank 0's helpers compile the tiled kernels its quantized layers dequantize those rows; every
    rank must switch at the same step, or the layers all compute whole (the LM head) give other logits."""
    from mlxhost.distributed.engine import step_digest
    from mlxhost.engine.runner.model_runner import StepTokens
    from mlxhost.models.loader import load_model
    from mlxhost.platform.quantized_rows import ALL_TILED_ROWS, fold_quantized_rows, row_layers

    model = load_model(str(qwen3_4bit_model_dir)).model
    assert fold_quantized_rows(model) > 0
    runner = DistributedRunner(model)
    empty = step_digest(StepTokens())  # of each empty step before
    plans = [StepPlan(0, SchedulerOutput(), tiled_rows=7), StepPlan(1, SchedulerOutput(), digest=empty),
             StepPlan(2, SchedulerOutput(), digest=empty, tiled_rows=ALL_TILED_ROWS)]
    runner.attach(RankContext(DistributedConfig(tensor_parallel=2), _FakeChannel(plans), seed=0))
    seen = []  # the limit each step ran with: set before the step, not after
    run = runner._run
    runner._run = lambda *a: seen.append(row_layers(model)[0].tiled_rows) or run(*a)
    assert runner.follow()
    assert {layer.tiled_rows for layer in row_layers(model)} == {7} and seen == [7]
    assert runner.follow()  # a plan without a limit (a model without such layers on rank 0) changes nothing
    assert {layer.tiled_rows for layer in row_layers(model)} == {7}
    assert runner.follow()
    assert {layer.tiled_rows for layer in row_layers(model)} == {ALL_TILED_ROWS} and seen == [7, 7, ALL_TILED_ROWS]


class _ScriptedFollower(Channel):
    """A follower's channel whose first broadcast is rank 0's decode buckets; later ones echo (agree)."""

    def __init__(self, buckets):
        self.rank, self.size, self._first = 1, 2, [buckets]

    def broadcast(self, obj=None):
        return self._first.pop() if self._first else obj

    def gather(self, obj):
        return None


def test_every_rank_takes_rank_0s_decode_buckets(tiny):
    # Rank 0 picks buckets for its backend (on MLX-CUDA by default); a follower that padded its batch
    # otherwise would run decode forwards, and so collectives, of other sizes.
    from mlxhost.config import EngineConfig
    from mlxhost.distributed.engine import DistributedEngineCore

    loaded, _ = tiny
    ctx = RankContext(DistributedConfig(tensor_parallel=2), _ScriptedFollower([1, 2, 4]), seed=0)
    core = DistributedEngineCore(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=4, memory_mode="dedicated"),
                                 256, None, "key", ctx=ctx)
    assert core.runner.buckets == [1, 2, 4]


def test_sharded_input_layers_lose_the_gradient_hook_not_their_matmul():
    import mlx.nn as nn
    from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear, shard_linear

    from mlxhost.distributed.shard import drop_gradient_hooks

    group = mx.distributed.init()  # one process: a group of 1 shards nothing, the layer types are the same
    mx.random.seed(3)
    block = nn.Module()
    block.q = shard_linear(nn.Linear(8, 6, bias=True), "all-to-sharded", group=group)
    block.o = shard_linear(nn.Linear(6, 8, bias=False), "sharded-to-all", group=group)
    x = mx.random.normal((2, 3, 8))
    before = block.o(block.q(x))
    assert isinstance(block.q, AllToShardedLinear)
    assert drop_gradient_hooks(block) == 1
    assert type(block.q) is nn.Linear and isinstance(block.o, ShardedToAllLinear)
    assert mx.array_equal(block.o(block.q(x)), before).item()


def test_a_pipeline_hand_off_ties_plain_and_quantized_caches_alike():
    """Evaluating a cache must run the hand-off behind it: plain keys, and quantized KV's tuple, which
    stays a tuple of the same arrays (the quantized cache reads it as one)."""
    from types import SimpleNamespace

    import mlx.core as mx

    from mlxhost.distributed.pipeline import _tie

    h = mx.ones((1, 2))
    plain = SimpleNamespace(keys=mx.zeros((1, 2)))
    quantized = SimpleNamespace(keys=(mx.zeros((1, 2), dtype=mx.uint32), mx.ones((1, 1)), mx.ones((1, 1))))
    _tie(plain, h)
    _tie(quantized, h)
    _tie(None, h)  # a stage without a cache for that layer
    assert isinstance(plain.keys, mx.array) and mx.array_equal(plain.keys, mx.zeros((1, 2)))
    assert isinstance(quantized.keys, tuple) and len(quantized.keys) == 3
    assert quantized.keys[0].dtype == mx.uint32 and quantized.keys[2] is not None


def test_auto_speculation_is_fixed_over_ranks(caplog):
    """Each rank would time its own steps: `auto`'s choices could differ between ranks, and their collectives
    stop pairing up. Over ranks `auto` keeps its proposer and speculates wherever it can."""
    assert fixed_speculation(EngineConfig(speculative="auto")).speculative == "ngram"
    assert "over ranks" in caplog.text
    assert fixed_speculation(EngineConfig(speculative="auto", draft_model="/no/such/draft")).speculative == "draft"
    assert fixed_speculation(EngineConfig(speculative="off")).speculative == "off"

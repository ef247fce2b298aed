"""The pieces of distributed serving that need no second rank: the config, the start-up comparison,
the channel over a one-rank group, the prefix cache's call recording, and the divergence check."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxserve.distributed.channel import HEAD_BYTES, Channel
from mlxserve.distributed.config import DistributedConfig
from mlxserve.distributed.engine import DistributedRunner, DivergenceError, RankContext, RecordingStore, StepPlan
from mlxserve.distributed.serve import Identity, differences
from mlxserve.engine.scheduler import SchedulerOutput


def test_config_checks_and_layout():
    with pytest.raises(ValueError, match="cannot be combined"):
        DistributedConfig(tensor_parallel=2, pipeline_parallel=2)
    with pytest.raises(ValueError, match="backend"):
        DistributedConfig(tensor_parallel=2, backend="tcp")
    assert DistributedConfig(tensor_parallel=4).layout == "tp4"
    assert DistributedConfig(pipeline_parallel=2).layout == "pp2"
    assert not DistributedConfig().is_distributed


def test_differences_name_the_rank_and_what_differs():
    versions = (("mlxserve", "0.1.0"), ("mlx", "0.32.4"), ("mlx-lm", "0.32.2"))
    lead = Identity(0, "mac-a", versions, "abc")
    same = Identity(1, "mac-b", versions, "abc")
    assert differences([lead, same]) is None
    old_mlx = Identity(2, "mac-c", (("mlxserve", "0.1.0"), ("mlx", "0.31.0"), ("mlx-lm", "0.32.2")), "abc")
    other_model = Identity(3, "mac-d", versions, "def")
    text = differences([lead, same, old_mlx, other_model])
    assert "rank 2 (mac-c) has mlx 0.31.0, rank 0 has 0.32.4" in text
    assert "rank 3 (mac-d) has another model" in text
    assert "rank 1" not in text


def test_channel_on_one_rank_round_trips():
    channel = Channel(mx.distributed.init())  # a single-process group: the sums are the identity
    big = bytes(range(256)) * (3 * HEAD_BYTES // 256)  # past the first collective's buffer
    assert channel.broadcast_bytes(big) == big
    assert channel.broadcast({"a": [1, 2]}) == {"a": [1, 2]}
    assert channel.broadcast(b"") == b""
    assert channel.gather(("x", 1)) == [("x", 1)]


@pytest.fixture(scope="module")
def tiny(qwen3_model_dir):
    from mlxserve.kv.kinds.probe import probe_kv
    from mlxserve.models.loader import load_model

    loaded = load_model(str(qwen3_model_dir))
    return loaded, probe_kv(loaded.model).layout


def test_recording_store_replays_the_schedulers_calls(tiny):
    from mlxserve.kv.store.kv_store import KVBlock

    _, layout = tiny
    lead, other = RecordingStore(layout, 16), RecordingStore(layout, 16)
    for store in (lead, other):
        for b in (1, 2):
            store.put(b, bytes([b]), KVBlock(mx.zeros((1, 1, 16, 1)), None))
    lead.drop(1)  # not recording yet: a runner step's own call
    assert lead.take_calls() == []
    other.drop(1)
    lead.recording = True
    lead.drop(2)
    assert not lead.load_from_ssd(b"\x03", (1, 2), 3)  # no SSD tier: a miss, recorded with its result
    calls = lead.take_calls()
    assert [c[0] for c in calls] == ["drop", "load_from_ssd"]
    other.replay(calls)
    assert other.stats()["memory"]["num_blocks"] == lead.stats()["memory"]["num_blocks"] == 0
    with pytest.raises(DivergenceError, match="load_from_ssd"):
        other.replay([("load_from_ssd", (b"\x03", (1, 2), 3), True)])  # rank 0 had it, this rank not


class _FakeChannel:
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


def test_shutdown_plan_ends_the_follower(tiny):
    loaded, _ = tiny
    runner = DistributedRunner(loaded.model)
    runner.attach(RankContext(DistributedConfig(tensor_parallel=2), _FakeChannel([StepPlan(0, None)]), seed=0))
    assert runner.follow() is False

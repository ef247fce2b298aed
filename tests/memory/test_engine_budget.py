"""The budget wired through the CLI and the engine core on the tiny fixture: mode and utilization reach
the budget, the prefix cache is sized from its share unless --cache-memory says otherwise, pressure
reaches the live engine, and /v1/status's dict shows the numbers in force."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.memory.budget import compute_ceiling
from mlxhost.memory.device import read_memory
from mlxhost.models.loader import load_model
from mlxhost.server.cli import make_parser
from mlxhost.server.serve_command import _engine_config

BS = 16


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


def core_for(loaded, **kw) -> EngineCore:
    return EngineCore(loaded.model, loaded.tokenizer, EngineConfig(block_size=BS, **kw), max_model_len=4096)


def test_cli_flags_reach_the_engine_config():
    args = make_parser().parse_args(["serve", "--memory-mode", "dedicated", "--memory-utilization", "0.5",
                                     "--kv-prealloc", "4096"])
    config = _engine_config(args)
    assert (config.memory_mode, config.memory_utilization, config.kv_prealloc_tokens) == ("dedicated", 0.5, 4096)
    assert config.cache_memory_bytes is None  # no --cache-memory: the budget decides
    explicit = _engine_config(make_parser().parse_args(["serve", "--cache-memory", "512MiB"]))
    assert explicit.cache_memory_bytes == 512 << 20 and explicit.memory_mode == "desktop"
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--memory-mode", "laptop"])
    with pytest.raises(ValueError):
        EngineConfig(memory_utilization=0.0)


def test_prefix_cache_sized_from_the_budget_by_default(loaded):
    core = core_for(loaded)
    block_bytes = core.block_bytes
    assert core.budget.prefix_cache > 0
    assert core.prefix.pool.num_blocks == core.budget.prefix_cache // block_bytes
    status = core.status()
    assert status["memory_mode"] == "desktop" and status["budget"] == status["startup_budget"]
    assert status["prefix_cache"]["budget_bytes"] == core.prefix.pool.num_blocks * block_bytes
    assert status["kv_capacity_tokens"] == core.budget.kv // (block_bytes // BS)


def test_explicit_cache_memory_overrides_and_kv_gets_the_rest(loaded):
    default = core_for(loaded)
    fixed = core_for(loaded, cache_memory_bytes=8 << 20)
    assert fixed.budget.prefix_cache == 8 << 20 and fixed.prefix.pool.num_blocks == (8 << 20) // fixed.block_bytes
    rest = fixed.budget.ceiling - fixed.budget.weights - fixed.budget.activations
    assert fixed.budget.kv == rest - (8 << 20) - fixed.budget.vision_cache
    off = core_for(loaded, enable_prefix_cache=False)
    assert off.prefix is None and off.budget.prefix_cache == 0 and off.status()["prefix_cache"]["enabled"] is False
    assert default.budget.prefix_cache > 0


def test_dedicated_mode_takes_a_share_of_capacity(loaded):
    core = core_for(loaded, memory_mode="dedicated", memory_utilization=0.5)
    assert core.budget.mode == "dedicated"
    assert core.budget.ceiling == int(0.5 * read_memory().pool_total)
    assert core.governor.refresh_s == 0  # does not follow free memory


def test_pressure_reaches_the_running_engine(loaded):
    core = core_for(loaded, cache_memory_bytes=4 * BS * 1024 * 8)  # a few blocks of the fixture
    start = core.status()
    now = read_memory()
    # Free memory such that the ceiling leaves nothing past weights and activations: idle KV goes first,
    # then the (empty) prefix cache's room; KV is then 0, so only a lone request is admitted.
    target = core.budget.weights + core.budget.activations
    squeezed = replace(now, available_ram=now.available_ram - (compute_ceiling(now, core.budget.config) - target))
    assert core.governor.refresh(squeezed)
    status = core.status()
    assert status["budget"]["prefix_cache"] == 0 and status["prefix_cache"]["max_cached_blocks"] == 0
    assert status["kv_capacity_tokens"] == 0 < start["kv_capacity_tokens"]
    assert status["startup_budget"] == start["startup_budget"]
    assert status["budget"]["ceiling"] < start["budget"]["ceiling"]
    assert core.governor.refresh(replace(now, available_ram=now.available_ram + (4 << 30)))  # pressure passed
    assert core.status()["kv_capacity_tokens"] == start["kv_capacity_tokens"]

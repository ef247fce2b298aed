"""The budget formula on fake readings: no model, no GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxhost.memory.budget import (
    BudgetConfig,
    MemoryBudget,
    MemoryBudgetError,
    compute_budget,
    compute_ceiling,
    format_budget,
    kv_tokens,
    shrink_for_pressure,
)
from mlxhost.memory.device import MemoryReadings

GIB = 1 << 30
DESKTOP = BudgetConfig()
DEDICATED = BudgetConfig(mode="dedicated")


def gib(x: float) -> int:
    return int(x * GIB)


def mac(total, hint, available, rss=0.25, mlx_active=0.0) -> MemoryReadings:
    return MemoryReadings(
        total_ram=gib(total), available_ram=gib(available), process_rss=gib(rss),
        working_set_hint=gib(hint) if hint is not None else None,
        backend="metal" if hint is not None else "cpu",
        mlx_active=gib(mlx_active), mlx_peak=gib(mlx_active), mlx_cache=0,
    )


def parts_sum(b: MemoryBudget) -> int:
    return b.weights + b.activations + b.kv + b.prefix_cache + b.vision_cache


# name, readings, weights, activations, config, expected fields in GiB
CASES = [
    # 16 GB Mac, 6 GB free, 8B 4-bit model: reserve max(1 GiB, 5% of 16) = 1 GiB,
    # ceiling = min(10.67, 6 + 0.25 - 1) = 5.25; rest 0.5 -> prefix 1/4, vision capped at 1/4, KV the rest.
    ("16GB desktop", mac(16, 16 * 2 / 3, 6), 4.5, 0.25, DESKTOP,
     dict(ceiling=5.25, weights=4.5, activations=0.25, kv=0.25, prefix_cache=0.125,
          vision_cache=0.125, free_for_others=1.0)),
    # 48 GB Mac with apps open: reserve 2.4 GiB, ceiling = min(36, 12 + 0.5 - 2.4) = 10.1; rest 5.1.
    ("48GB desktop", mac(48, 36, 12, rss=0.5), 4.5, 0.5, DESKTOP,
     dict(ceiling=10.1, weights=4.5, activations=0.5, kv=3.325, prefix_cache=1.275,
          vision_cache=0.5, free_for_others=2.4)),
    # 192 GB server, hint 0.75 x RAM = 144: ceiling 0.9 x 144 = 129.6, 70B 4-bit weights; rest 87.6.
    ("192GB dedicated", mac(192, 144, 180, rss=1.0), 40.0, 2.0, DEDICATED,
     dict(ceiling=129.6, weights=40.0, activations=2.0, kv=65.2, prefix_cache=21.9,
          vision_cache=0.5, free_for_others=181 - 129.6)),
    # Linux CPU: no hint, the whole RAM is the capacity; lots free, so the reserve binds.
    ("64GB cpu desktop", mac(64, None, 60, rss=0.2), 1.0, 0.25, DESKTOP,
     dict(ceiling=60 + 0.2 - 3.2, weights=1.0, activations=0.25, kv=(55.75 * 0.75) - 0.5,
          prefix_cache=55.75 * 0.25, vision_cache=0.5, free_for_others=3.2)),
    # Lots free on a 16 GB Mac: the Metal working-set hint binds, not the reserve.
    ("16GB desktop idle", mac(16, 16 * 2 / 3, 14), 4.5, 0.25, DESKTOP,
     dict(ceiling=16 * 2 / 3, weights=4.5, activations=0.25, kv=(16 * 2 / 3 - 4.75) * 0.75 - 0.5,
          prefix_cache=(16 * 2 / 3 - 4.75) * 0.25, vision_cache=0.5,
          free_for_others=14.25 - 16 * 2 / 3)),
]


@pytest.mark.parametrize("name,readings,weights,activations,cfg,expected", CASES, ids=[c[0] for c in CASES])
def test_every_field(name, readings, weights, activations, cfg, expected):
    b = compute_budget(readings, gib(weights), gib(activations), cfg)
    for field_name, value in expected.items():
        # Each field is an int() of a GiB product: allow a few bytes of rounding.
        assert getattr(b, field_name) == pytest.approx(value * GIB, abs=8), field_name
    assert parts_sum(b) == b.ceiling  # exact: nothing counted twice, nothing lost
    assert b.mode == cfg.mode


def test_kv_tokens_for_an_8b_model_on_a_16gb_mac():
    b = compute_budget(mac(16, 16 * 2 / 3, 6), gib(4.5), gib(0.25), DESKTOP)
    # Llama-3-8B: 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes = 128 KiB per token.
    assert kv_tokens(b, 128 << 10) == 2048
    with pytest.raises(ValueError):
        kv_tokens(b, 0)


def test_desktop_follows_available_memory():
    roomy = compute_budget(mac(48, 36, 12), gib(4.5), gib(0.5), DESKTOP)
    tight = compute_budget(mac(48, 36, 8), gib(4.5), gib(0.5), DESKTOP)
    assert tight.ceiling == roomy.ceiling - gib(4)
    assert tight.kv < roomy.kv and tight.prefix_cache < roomy.prefix_cache
    assert tight.weights == roomy.weights and tight.activations == roomy.activations


def test_same_budget_before_and_after_loading_weights():
    # Loading moves 4.5 GiB from "available" to "held by this process": the ceiling must not move.
    before = compute_budget(mac(16, 16 * 2 / 3, 6, rss=0.25), gib(4.5), gib(0.25), DESKTOP)
    after = compute_budget(mac(16, 16 * 2 / 3, 1.5, rss=4.75), gib(4.5), gib(0.25), DESKTOP)
    assert after == before


def test_mlx_buffers_outside_rss_count_once():
    # Metal buffers may be missing from RSS: the larger of RSS and MLX's counters is what we hold.
    in_rss = mac(16, 16 * 2 / 3, 1.5, rss=4.75, mlx_active=4.5)
    not_in_rss = mac(16, 16 * 2 / 3, 1.5, rss=0.25, mlx_active=4.75)
    assert in_rss.held_by_process == not_in_rss.held_by_process == gib(4.75)


def test_dedicated_ignores_available_memory():
    a = compute_budget(mac(192, 144, 180), gib(40), gib(2), DEDICATED)
    b = compute_budget(mac(192, 144, 20), gib(40), gib(2), DEDICATED)
    assert (a.ceiling, a.kv, a.prefix_cache, a.vision_cache) == (b.ceiling, b.kv, b.prefix_cache, b.vision_cache)
    assert b.free_for_others < 0  # it claims memory others hold today, and says so
    assert "more than is free now" in format_budget(b)


def test_cuda_uses_device_memory_not_host_ram():
    readings = MemoryReadings(
        total_ram=gib(256), available_ram=gib(250), process_rss=gib(3), working_set_hint=gib(80),
        backend="cuda", device_free=gib(70), mlx_active=gib(0), mlx_peak=0, mlx_cache=0,
    )
    assert readings.obtainable == gib(70)
    desktop = compute_budget(readings, gib(16), gib(2), DESKTOP)
    assert desktop.ceiling == gib(70) - gib(4)  # reserve = 5% of the 80 GiB device
    dedicated = compute_budget(readings, gib(16), gib(2), DEDICATED)
    assert dedicated.ceiling == int(0.9 * gib(80))


@pytest.mark.parametrize("readings,cfg", [
    (mac(16, 16 * 2 / 3, 3), DESKTOP),   # ceiling 2.25 GiB
    (mac(8, 8 * 2 / 3, 7), DEDICATED),   # ceiling 0.9 x 5.33 = 4.8 GiB
])
def test_error_when_weights_do_not_fit(readings, cfg):
    with pytest.raises(MemoryBudgetError) as err:
        compute_budget(readings, gib(4.5), gib(0.5), cfg)
    msg = str(err.value)
    assert "weights 4.50 GiB" in msg and "activations 0.50 GiB" in msg and cfg.mode in msg


def test_weights_exactly_fitting_leave_zero_kv():
    r = mac(16, 16 * 2 / 3, 6)
    b = compute_budget(r, gib(5), gib(0.25), DESKTOP)
    assert (b.kv, b.prefix_cache, b.vision_cache) == (0, 0, 0)


def test_text_only_model_gets_no_vision_cache():
    b = compute_budget(mac(48, 36, 12), gib(4.5), gib(0.5), replace(DESKTOP, vision_cache_bytes=0))
    assert b.vision_cache == 0 and parts_sum(b) == b.ceiling


# ---------------------------------------------------------------- shrink_for_pressure


def start_budget() -> tuple[MemoryReadings, MemoryBudget]:
    readings = mac(48, 36, 12, rss=0.5)
    return readings, compute_budget(readings, gib(4.5), gib(0.5), DESKTOP)  # prefix 1.275, vision 0.5


def test_pressure_takes_prefix_cache_first():
    readings, start = start_budget()
    b = shrink_for_pressure(start, replace(readings, available_ram=gib(11)))  # another app took 1 GiB
    assert b.ceiling == start.ceiling - GIB
    assert b.prefix_cache == start.prefix_cache - GIB
    assert (b.kv, b.vision_cache) == (start.kv, start.vision_cache)
    assert parts_sum(b) == b.ceiling


def test_pressure_then_vision_then_kv():
    readings, start = start_budget()
    b = shrink_for_pressure(start, replace(readings, available_ram=gib(10)))  # 2 GiB taken
    assert b.prefix_cache == 0 and b.vision_cache == 0
    assert b.kv == start.kv - (gib(2) - start.prefix_cache - start.vision_cache)
    assert parts_sum(b) == b.ceiling


def test_severe_pressure_keeps_weights_and_never_raises():
    readings, start = start_budget()
    b = shrink_for_pressure(start, replace(readings, available_ram=gib(1)))
    assert (b.kv, b.prefix_cache, b.vision_cache) == (0, 0, 0)
    assert b.ceiling == b.weights + b.activations == start.weights + start.activations


def test_pressure_passes_and_more_memory_never_grows_past_start():
    readings, start = start_budget()
    assert shrink_for_pressure(start, readings) == start
    grown = shrink_for_pressure(start, replace(readings, available_ram=gib(30)))
    assert replace(grown, free_for_others=start.free_for_others) == start


def test_pressure_takes_idle_budget_before_anything_held():
    readings, start = start_budget()  # kv 3.325, prefix 1.275, vision 0.5
    two_gib_taken = replace(readings, available_ram=gib(10))
    roomy = shrink_for_pressure(start, two_gib_taken, prefix_in_use=GIB, kv_in_use=GIB)
    assert roomy.kv == start.kv - gib(2)  # idle KV headroom absorbs it all
    assert (roomy.prefix_cache, roomy.vision_cache) == (start.prefix_cache, start.vision_cache)
    # KV all committed, the cache holding 0.275 GiB: its empty room, then its blocks, then vision, then KV.
    busy = shrink_for_pressure(start, two_gib_taken, prefix_in_use=gib(0.275), kv_in_use=start.kv)
    assert (busy.prefix_cache, busy.vision_cache) == (0, 0)
    assert busy.kv == pytest.approx(start.kv - gib(0.225), abs=8)
    assert parts_sum(roomy) == roomy.ceiling == parts_sum(busy) == busy.ceiling


def test_pressure_leaves_dedicated_budgets_alone():
    readings = mac(192, 144, 180)
    start = compute_budget(readings, gib(40), gib(2), DEDICATED)
    b = shrink_for_pressure(start, replace(readings, available_ram=gib(10)))
    assert replace(b, free_for_others=start.free_for_others) == start
    assert b.free_for_others < start.free_for_others


# ---------------------------------------------------------------- log line and config


def test_format_budget():
    b = compute_budget(mac(16, 16 * 2 / 3, 6), gib(4.5), gib(0.25), DESKTOP)
    line = format_budget(b)
    assert line == (
        "memory budget (desktop): ceiling 5.25 GiB = weights 4.50 GiB + activations 0.25 GiB"
        " + KV 0.25 GiB + prefix cache 0.12 GiB + vision cache 0.12 GiB; 1.00 GiB stays free for other apps"
    )


@pytest.mark.parametrize("kwargs", [
    dict(mode="laptop"), dict(memory_utilization=0.0), dict(memory_utilization=1.5),
    dict(prefix_cache_fraction=1.0), dict(desktop_reserve_fraction=-0.1),
    dict(prefix_cache_fraction=0.8, vision_cache_max_fraction=0.2), dict(vision_cache_bytes=-1),
])
def test_config_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        BudgetConfig(**kwargs)


def test_two_models_in_one_process_never_budget_the_same_bytes():
    """Each of two models leaves out the other's weights and takes half of the rest: together they fit
    what one process may hold, at start-up and under pressure alike."""
    readings = mac(total=64, hint=None, available=60)
    w_a, w_b, act = gib(10), gib(6), gib(1)
    alone = compute_budget(readings, w_a, act, BudgetConfig(mode="dedicated"))
    a = compute_budget(readings, w_a, act, BudgetConfig(mode="dedicated", share=0.5, reserved_bytes=w_b))
    b = compute_budget(readings, w_b, act, BudgetConfig(mode="dedicated", share=0.5, reserved_bytes=w_a))
    assert parts_sum(a) == a.ceiling and parts_sum(b) == b.ceiling
    assert a.ceiling + b.ceiling <= alone.ceiling
    for mode in ("desktop",):
        a = compute_budget(readings, w_a, act, BudgetConfig(mode=mode, share=0.5, reserved_bytes=w_b))
        b = compute_budget(readings, w_b, act, BudgetConfig(mode=mode, share=0.5, reserved_bytes=w_a))
        squeezed = mac(total=64, hint=None, available=30)  # another app took 30 GB
        a2, b2 = shrink_for_pressure(a, squeezed), shrink_for_pressure(b, squeezed)
        process = compute_ceiling(squeezed, BudgetConfig(mode=mode))
        assert a2.ceiling + b2.ceiling <= process < a.ceiling + b.ceiling


def test_reserved_bytes_lower_the_ceiling_in_both_modes():
    readings = mac(total=16, hint=12, available=8)
    for mode in ("desktop", "dedicated"):
        base = compute_ceiling(readings, BudgetConfig(mode=mode))
        assert compute_ceiling(readings, BudgetConfig(mode=mode, reserved_bytes=gib(2))) == base - gib(2)

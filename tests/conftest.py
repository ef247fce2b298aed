"""Session-wide fixture models: tiny random-weight folders built offline once per test run, and the test
lanes: every test is marked by where it lives (README: Running the tests)."""

import functools
import itertools
import os
import re
import sys
import weakref
from pathlib import Path

import pytest

from mlxhost.testing.demo import DemoModelConfig, build_model_folder

_TESTS = Path(__file__).resolve().parent
# (where under tests/, marker): a folder, a file, or a file::test name prefix. A test gets every marker whose
# prefix matches (the web page test is both `e2e` and `browser`), and `fast` when it matches none: the fast
# lane is `-m fast`, a plain `python -m pytest -q` still runs every lane.
LANES = (
    ("e2e/", "e2e"),  # a live server in this process
    ("e2e/test_web_ui.py", "browser"),  # headless Chromium through selenium and chromedriver
    ("e2e/test_agent_clients.py", "external"),  # third-party agent SDKs and clients
    ("external/", "external"),  # third-party agent command-line clients
    ("distributed/", "distributed"),  # servers whose ranks are subprocesses
    ("export/", "export"),  # Core ML conversion through torch and coremltools
    ("realweights/", "real_weights"),  # small real models from a local cache
    # The model-family matrix: the same scenarios once per family fixture (mlxhost.testing.families, VLMs).
    # The fast lane keeps one plain-KV, sliding-window, recurrent and MLA fixture (test_prefix_engine.py).
    ("engine/test_families_engine.py", "families"),
    ("engine/test_prefix_layouts.py", "families"),
    ("engine/test_kv_quant_families.py", "families"),
    ("engine/test_batch_prefill.py", "families"),
    ("engine/test_embeddings.py", "families"),
    ("engine/test_mm_prefill.py", "families"),
    ("engine/test_mm_prefill_gemma3.py", "families"),
    ("engine/test_mm_prefix_sliding.py", "families"),
    ("testing/test_families.py", "families"),
    # Long scenarios: thousands of tokens, sampled distributions, fuzzing, benchmark runs, child processes.
    ("structured/test_random_schemas.py", "slow"),
    ("engine/test_kv_prealloc.py::test_prealloc_keeps_memory_flat_over_2k_tokens", "slow"),
    ("engine/test_speculative_sampling.py::test_engine_sampling_distribution", "slow"),
    ("engine/test_speculative_constrained.py::test_sampled_constrained_distribution", "slow"),
    ("engine/test_speculative.py::test_greedy_identity_16_concurrent", "slow"),
    ("engine/test_spec_heads.py::test_sampled_distribution", "slow"),
    ("engine/test_kv_quant.py", "slow"),  # every bit width and attention mode
    ("engine/test_kv_quant_vlm.py", "slow"),
    ("engine/test_warmup.py", "slow"),  # every warm-up piece, its helper processes
    ("audio/test_whisper_layouts.py::test_ct2_folder_transcribes", "slow"),
    ("bench/test_load_bench.py", "slow"),
    ("bench/test_memory_bench.py", "slow"),
    ("bench/test_prefix_bench.py", "slow"),
    ("bench/test_speculative_bench.py", "slow"),
    ("bench/test_kvquant_bench.py", "slow"),
    ("bench/test_prewarm_bench.py::test_the_bench_end_to_end", "slow"),
    ("models/test_pull.py", "slow"),
    ("models/test_source.py", "slow"),
    ("testing/test_real_models.py", "slow"),
)
FAST = "fast"
LANE_NAMES = frozenset(marker for _, marker in LANES) | {FAST}


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*names): something beyond the test extra (mlxhost.testing.needs); "
                                       "skipped with its install line when missing")


@pytest.hookimpl(tryfirst=True)  # before the fixtures: a server or a model built for a test that then skips
def pytest_runtest_setup(item):
    from mlxhost.testing.needs import need

    for mark in item.iter_markers("needs"):
        need(*mark.args)


def _lanes(where: str) -> set[str]:
    return {marker for prefix, marker in LANES if where.startswith(prefix)}


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            where = item.path.resolve().relative_to(_TESTS).as_posix()
        except ValueError:
            continue
        lanes = _lanes(f"{where}::{item.name}")
        for marker in sorted(lanes):
            item.add_marker(marker)
        if not lanes and not any(mark.name in LANE_NAMES for mark in item.iter_markers()):  # a module's own
            item.add_marker(FAST)


def pytest_ignore_collect(collection_path, config):
    """A folder or file none of whose tests a lane expression (`-m fast`, `-m "not e2e"`) can select is not
    imported at all: importing the browser, export and agent-client lanes' modules costs seconds."""
    expr = config.getoption("markexpr", "")
    try:
        where = collection_path.resolve().relative_to(_TESTS).as_posix()
    except ValueError:
        return None
    if not expr or where == ".":
        return None
    fixed = _lanes(where + ("/" if collection_path.is_dir() else ""))
    return True if not _can_match(expr, frozenset(fixed)) else None


@functools.lru_cache(maxsize=None)
def _can_match(expr: str, fixed: frozenset[str]) -> bool:
    """Whether a test under a path with the markers `fixed` may match, whatever lane markers it gets besides
    (from a file::test entry or its module's `pytestmark`). An expression naming anything else may match."""
    names = set(re.findall(r"[^\s()]+", expr)) - {"and", "or", "not"}
    if not names <= LANE_NAMES:
        return True
    try:
        from _pytest.mark.expression import Expression

        compiled = Expression.compile(expr)
    except Exception:  # pytest's own selection reports a bad expression
        return True
    others = sorted(LANE_NAMES - fixed - {FAST})
    for n in range(len(others) + 1):
        for extra in itertools.combinations(others, n):
            markers = fixed | set(extra) or {FAST}
            if compiled.evaluate(lambda name, **kwargs: not kwargs and name in markers):
                return True
    return False


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory):
    return build_model_folder(tmp_path_factory.mktemp("qwen3"), DemoModelConfig())


@pytest.fixture(scope="session")
def llama_model_dir(tmp_path_factory):
    # Another seed so tests that mix both models never see identical weights by accident.
    return build_model_folder(tmp_path_factory.mktemp("llama"), DemoModelConfig(arch="llama", seed=1))


@pytest.fixture(scope="session")
def qwen3_4bit_model_dir(tmp_path_factory):
    # hidden 128 / intermediate 256 are multiples of 64, so every linear layer gets quantized.
    config = DemoModelConfig(quantize_bits=4, group_size=64)
    return build_model_folder(tmp_path_factory.mktemp("qwen3-4bit"), config)


@pytest.fixture(scope="session")
def qwen25vl_dir(tmp_path_factory):
    from mlxhost.testing.vlm_demo import build_vlm_folder

    return build_vlm_folder(tmp_path_factory.mktemp("qwen2_5_vl"), family="qwen2_5_vl")


@pytest.fixture(scope="session")
def qwen3vl_dir(tmp_path_factory):
    from mlxhost.testing.vlm_demo import build_vlm_folder

    return build_vlm_folder(tmp_path_factory.mktemp("qwen3_vl"), family="qwen3_vl")


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory):
    from mlxhost.testing.vlm_demo import build_vlm_folder

    return build_vlm_folder(tmp_path_factory.mktemp("gemma3"), family="gemma3")


@pytest.fixture(autouse=True)
def _torch_stays_importable():
    """`mlxhost serve` run in-process for a text model hides PyTorch from the whole process
    (models/torch_free.py): after the test, it is importable again for the next ones (the export lane)."""
    from mlxhost.models.torch_free import TORCH_ENV

    hidden, env = "torch" in sys.modules and sys.modules["torch"] is None, os.environ.get(TORCH_ENV)
    yield
    if not hidden and "torch" in sys.modules and sys.modules["torch"] is None:
        del sys.modules["torch"]
    if env is None:
        os.environ.pop(TORCH_ENV, None)
    else:
        os.environ[TORCH_ENV] = env


# Activation peaks already measured, by (model, its weight bytes and layer types, chunk tokens, cache layout).
_PROFILED: dict[tuple, int] = {}


@pytest.fixture(autouse=True)
def _one_memory_profile_per_model(request, monkeypatch):
    """Every EngineCore measures its activation peak with a forward of a whole prefill chunk (512 tokens),
    about 40% of an engine test's time on a CPU: tests that start many cores over one model reuse the
    first measurement for that model (same weights, chunk and cache layout). tests/memory/ measures every
    time."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxhost.memory import profile

    if request.path.resolve().is_relative_to(_TESTS / "memory"):
        return
    measure = profile.activation_bytes

    def once(model, chunk_tokens, make_cache=None, agree=None):
        layout = _layout(make_cache, make_prompt_cache)
        # Ranks must run the same forwards; an unknown cache layout or a wrapper (the VLMs') is measured.
        if agree is not None or layout is None or not hasattr(model, "named_modules"):
            return measure(model, chunk_tokens, make_cache, agree)
        modules = tuple(type(m).__name__ for _, m in model.named_modules())  # LoRA, folded rows
        key = (id(model), profile.weights_bytes(model), modules, chunk_tokens, layout)
        if key not in _PROFILED:
            _PROFILED[key] = measure(model, chunk_tokens, make_cache, agree)
            weakref.finalize(model, _PROFILED.pop, key, None)  # an id is reused once its model is gone
        return _PROFILED[key]

    monkeypatch.setattr(profile, "activation_bytes", once)


def _layout(make_cache, plain):
    """What decides the caches a profile forward fills: mlx-lm's plain ones, or a method of a frozen plan
    (the --kv-bits one) whose fields say which; None when neither."""
    if make_cache is None or make_cache is plain:
        return "plain"
    plan = getattr(make_cache, "__self__", None)
    params = getattr(plan, "__dataclass_params__", None)
    if params is None or not params.frozen:
        return None
    return make_cache.__func__, plan

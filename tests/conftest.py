"""Session-wide fixture models: tiny random-weight folders built offline once per test run, and the test
lanes: every test is marked by where it lives (README: Running the tests)."""

from pathlib import Path

import pytest

from mlxserve.testing.demo import DemoModelConfig, build_model_folder

_TESTS = Path(__file__).resolve().parent
# (path prefix under tests/, marker). A test gets every marker whose prefix matches, so the web page test is
# both `e2e` and `browser`; the fast lane is `-m "not (e2e or browser or distributed or export or external
# or real_weights)"`, and a plain `python -m pytest -q` still runs every lane.
LANES = (
    ("e2e/", "e2e"),  # a live server in this process
    ("e2e/test_web_ui.py", "browser"),  # headless Chromium through selenium and chromedriver
    ("e2e/test_agent_clients.py", "external"),  # third-party agent SDKs and clients
    ("external/", "external"),  # third-party agent command-line clients
    ("distributed/", "distributed"),  # servers whose ranks are subprocesses
    ("export/", "export"),  # Core ML conversion through torch and coremltools
    ("realweights/", "real_weights"),  # small real models from a local cache
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            where = item.path.resolve().relative_to(_TESTS).as_posix()
        except ValueError:
            continue
        for prefix, marker in LANES:
            if where.startswith(prefix):
                item.add_marker(marker)


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
    from mlxserve.testing.vlm_demo import build_vlm_folder

    return build_vlm_folder(tmp_path_factory.mktemp("qwen2_5_vl"), family="qwen2_5_vl")


@pytest.fixture(scope="session")
def qwen3vl_dir(tmp_path_factory):
    from mlxserve.testing.vlm_demo import build_vlm_folder

    return build_vlm_folder(tmp_path_factory.mktemp("qwen3_vl"), family="qwen3_vl")


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory):
    from mlxserve.testing.vlm_demo import build_vlm_folder

    return build_vlm_folder(tmp_path_factory.mktemp("gemma3"), family="gemma3")

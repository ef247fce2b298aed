"""Session-wide fixture models: tiny random-weight folders built offline once per test run."""

import pytest

from mlxserve.models.demo import DemoModelConfig, build_model_folder


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
    from mlxserve.models.vlm_demo import build_vlm_folder

    return build_vlm_folder(tmp_path_factory.mktemp("qwen2_5_vl"), family="qwen2_5_vl")


@pytest.fixture(scope="session")
def qwen3vl_dir(tmp_path_factory):
    from mlxserve.models.vlm_demo import build_vlm_folder

    return build_vlm_folder(tmp_path_factory.mktemp("qwen3_vl"), family="qwen3_vl")


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory):
    from mlxserve.models.vlm_demo import build_vlm_folder

    return build_vlm_folder(tmp_path_factory.mktemp("gemma3"), family="gemma3")

"""Real small models for the real_weights lane (fetched by `python -m mlxhost.testing.real_models fetch`).

A missing model skips with that command as the reason (mlxhost.testing.needs); under CI=true it fails instead.
Each module marks the models it needs (`pytestmark`), so a missing one skips before any fixture is built.

Session fixtures: `smollm2_gguf`, `qwen25_coder_gguf`, `gemma3_gguf` (the GGUF files), `smollm2_dir`,
`qwen25_coder_dir`, `gemma3_dir` (their converted MLX folders, cached in the GGUF cache between runs),
`minilm_dir` (a sentence-transformers folder), and `smollm2_server` (SmolLM2 served straight from its .gguf
file).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlxhost.models.gguf import GGUFConvertConfig, prepare_gguf
from mlxhost.testing.needs import need

# Float32 weights everywhere: on a CPU with OpenBLAS preloaded a 32-token SmolLM2 prefill took 1.1 s
# this way and 16-17 s with the GGUF's 4-bit weights kept (float16 activations: minutes); docs/gguf.md.
TEST_CONFIG = GGUFConvertConfig(dtype="float32", dequantize=True)
_SERVE_ENV = {"MLXHOST_GGUF_DTYPE": "float32", "MLXHOST_GGUF_DEQUANTIZE": "1"}


@pytest.fixture(scope="session", autouse=True)
def _serve_gguf_as_tests_do():
    """Servers started from a .gguf use the same conversion as the folders below (one cache entry)."""
    old = {k: os.environ.get(k) for k in _SERVE_ENV}
    os.environ.update(_SERVE_ENV)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def smollm2_gguf():
    return Path(need("smollm2"))  # need() gives the path as text


@pytest.fixture(scope="session")
def qwen25_coder_gguf():
    return Path(need("qwen25-coder"))  # need() gives the path as text


@pytest.fixture(scope="session")
def gemma3_gguf():
    return Path(need("gemma3-270m"))  # need() gives the path as text


@pytest.fixture(scope="session")
def gemma3_dir(gemma3_gguf):
    return prepare_gguf(gemma3_gguf, TEST_CONFIG)


@pytest.fixture(scope="session")
def minilm_dir():
    return Path(need("minilm"))  # need() gives the path as text


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf):
    return prepare_gguf(smollm2_gguf, TEST_CONFIG)


@pytest.fixture(scope="session")
def qwen25_coder_dir(qwen25_coder_gguf):
    # K-quants: dequantized once (about a minute here), then read from the cache.
    return prepare_gguf(qwen25_coder_gguf, TEST_CONFIG)


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_dir):
    from mlxhost.models.loader import load_model

    return load_model(str(smollm2_dir))


@pytest.fixture(scope="session")
def smollm2_server(smollm2_gguf):
    """SmolLM2 served from the .gguf file itself, as `mlxhost serve FILE.gguf` does."""
    from tests.e2e.conftest import start_server

    # 16-token blocks: a short chat's first turn fills whole prefix-cache blocks.
    live = start_server(smollm2_gguf, max_num_seqs=4, prefill_step_size=256, block_size=16)
    yield live
    live.stop()

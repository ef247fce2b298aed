"""Adapters trained in the test run with mlx-lm's LoRA code on the tiny qwen3 fixture, and mlx-lm's own greedy
output with each loaded (`mlx_lm.load(path, adapter_path=...)`): the references mlxhost must match."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlxhost.testing.lora_fixtures import to_peft, train_adapter

MAX_NEW = 10


@pytest.fixture(scope="session")
def adapters(qwen3_model_dir, tmp_path_factory) -> dict[str, str]:
    """Three adapters unlike each other: every linear layer at rank 4, two attention projections at rank 8,
    and the last block only at rank 2."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "alpha": str(train_adapter(qwen3_model_dir, root / "alpha", seed=1, rank=4, scale=10.0)),
        "beta": str(train_adapter(qwen3_model_dir, root / "beta", seed=2, rank=8, scale=5.0,
                                  keys=("self_attn.q_proj", "self_attn.v_proj"))),
        "gamma": str(train_adapter(qwen3_model_dir, root / "gamma", seed=3, rank=2, scale=20.0, num_layers=1)),
    }


@pytest.fixture(scope="session")
def peft_adapter(adapters, tmp_path_factory) -> str:
    return str(to_peft(adapters["alpha"], tmp_path_factory.mktemp("peft") / "alpha"))


@pytest.fixture(scope="session")
def reference(qwen3_model_dir, adapters):
    """reference(adapter name or None, prompt ids, max_tokens) -> mlx-lm's greedy token ids, memoized."""
    memo: dict = {}
    models: dict = {}

    def ref(name: str | None, prompt: list[int], max_tokens: int = MAX_NEW) -> list[int]:
        key = (name, tuple(prompt), max_tokens)
        if key not in memo:
            if name not in models:
                models[name] = mlx_lm.load(str(qwen3_model_dir), adapter_path=adapters[name] if name else None)
            steps = generate_step(mx.array(prompt), models[name][0], max_tokens=max_tokens,
                                  sampler=make_sampler(temp=0.0))
            memo[key] = [int(t) for t, _ in steps]
        return memo[key]

    return ref

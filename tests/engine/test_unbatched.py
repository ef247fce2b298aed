"""A model whose cache kind has no batch version in mlx-lm is served one request at a time (with a
log line), token-identical to mlx-lm, instead of failing at start-up or on the second request."""

from __future__ import annotations

import logging

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_sampler

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model


class SoloKV(KVCache):
    merge = None  # like mlx-lm's quantized and chunked caches: no batch version


class SoloModel:
    def __init__(self, model) -> None:
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kw):
        return self._model(*args, **kw)

    def make_cache(self):
        return [SoloKV() for _ in self._model.layers]


def test_unbatchable_caches_serve_one_at_a_time(qwen3_model_dir, caplog):
    loaded = load_model(str(qwen3_model_dir))
    config = EngineConfig(max_num_seqs=8, block_size=16, cache_memory_bytes=32 << 20)
    with caplog.at_level(logging.WARNING):
        core = EngineCore(SoloModel(loaded.model), loaded.tokenizer, config, max_model_len=4096)
    assert "one request at a time" in caplog.text
    assert core.scheduler.config.max_num_seqs == 1 and core.prefix is None
    prompts = [[5 + i] * (10 + i) for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, params))
    got: dict[str, list[int]] = {}
    while core.has_work:
        for o in core.step():
            assert o.error is None
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    for i, p in enumerate(prompts):
        steps = generate_step(mx.array(p), loaded.model, max_tokens=6, sampler=make_sampler(temp=0.0))
        assert got[f"r{i}"] == [int(t) for t, _ in steps]

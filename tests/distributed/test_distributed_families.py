"""Tensor parallel over 2 ranks for the other cache layouts (house rule: plain KV is in
test_distributed_serve.py): sliding window (gpt_oss), hybrid with recurrent state (qwen3_5) and MLA
(deepseek_v3). Greedy tokens match a single process, and a repeated prompt is a prefix-cache hit whose
resume checks (window blocks, state snapshots) rank 0 made and rank 1 replayed on its own shards. And a family
pipelined by mlx-lm's own forward (send/recv between stages), not by distributed/pipeline.py."""

from __future__ import annotations

import mlx_lm
import openai
import pytest
from mlx_lm.sample_utils import make_sampler

from mlxhost.testing.families import build_family_folder
from tests.distributed.conftest import SERVED_NAME, start_dist_server

PROMPT = list(range(5, 41))  # 36 tokens: 2 full blocks of 16 before the last token
MAX_NEW = 8


def _greedy_tokens(model_dir) -> list[str]:
    """mlx-lm's greedy tokens for PROMPT in one process: what every layout must produce."""
    model, tokenizer = mlx_lm.load(str(model_dir))
    return [tokenizer.decode([r.token]) for r in mlx_lm.stream_generate(
        model, tokenizer, prompt=PROMPT, max_tokens=MAX_NEW, sampler=make_sampler(temp=0.0))]


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_5", "deepseek_v3"])
def test_family_tensor_parallel_matches_and_hits(family, tmp_path):
    model_dir = build_family_folder(tmp_path / family, family)
    ref = _greedy_tokens(model_dir)
    server = start_dist_server(model_dir, tmp_path / "server", "--tensor-parallel", "2", "--block-size", "16",
                               "--cache-memory", "64MB")
    try:
        with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
            runs = [client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0.0,
                                              logprobs=1) for _ in range(2)]
    finally:
        server.stop()
    assert [r.choices[0].logprobs.tokens for r in runs] == [ref, ref]
    assert runs[0].usage.prompt_tokens_details.cached_tokens == 0
    assert runs[1].usage.prompt_tokens_details.cached_tokens == 32
    assert server.proc.returncode == 0, server.log()


def test_mlx_lm_pipeline_family_over_send_recv(tmp_path):
    """A family outside mlxhost's own stage (qwen3_moe) pipelines through mlx-lm's forward, send/recv
    between the stages: greedy tokens match a single process."""
    model_dir = build_family_folder(tmp_path / "qwen3_moe", "qwen3_moe")
    ref = _greedy_tokens(model_dir)
    server = start_dist_server(model_dir, tmp_path / "server", "--pipeline-parallel", "2", "--block-size", "16",
                               "--cache-memory", "64MB")
    try:
        with openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
            run = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0.0,
                                            logprobs=1)
    finally:
        server.stop()
    assert run.choices[0].logprobs.tokens == ref
    assert "pp2" in server.log() and server.proc.returncode == 0, server.log()

"""`--peaked` targets (testing/demo.py make_peaked_weights): a random model whose greedy token wins by a wide
logit margin, so the oracle stays a ceiling where the verify forward rounds differently from the plain step.
Its folder loads, its margin is of the order of the logits (a normal random model's is not), and the oracle
replaying it accepts every draft while the output stays plain greedy's."""

import dataclasses
import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxhost.bench.speculative import make_prompts, run_wave
from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.spec.oracle import save_recording
from mlxhost.models.loader import load_model
from mlxhost.server.cli import make_parser
from mlxhost.testing.demo import SHAPES, DemoModelConfig, build_model_folder

PEAKED_TINY = dataclasses.replace(SHAPES["tiny"], peaked=True, tie_word_embeddings=False)


def _decode(model, prompt: list[int], num_tokens: int):
    """Greedy decode: per step (top-1 minus top-2 logit, top-1 logit) and the tokens."""
    cache = make_prompt_cache(model)
    feed, gaps, tops, tokens = mx.array([prompt]), [], [], []
    for _ in range(num_tokens):
        logits = model(feed, cache=cache)[0, -1].astype(mx.float32)
        top2 = sorted(mx.topk(logits, 2).tolist(), reverse=True)
        gaps.append(top2[0] - top2[1])
        tops.append(top2[0])
        tokens.append(int(mx.argmax(logits)))
        feed = mx.array([[tokens[-1]]])
    return gaps, tops, tokens


@pytest.mark.parametrize("bits", [None, 4])
def test_peaked_folder_loads_with_a_wide_margin(tmp_path, bits):
    normal = load_model(str(build_model_folder(tmp_path / "normal", SHAPES["tiny"])))
    config = dataclasses.replace(PEAKED_TINY, quantize_bits=bits, quantize_with_converter=False)
    peaked = load_model(str(build_model_folder(tmp_path / "peaked", config)))
    assert json.loads((tmp_path / "peaked" / "config.json").read_text())["tie_word_embeddings"] is False
    prompt = make_prompts("random", 1, 16, 2000, seed=0)[0]
    normal_gaps, _, _ = _decode(normal.model, prompt, 48)
    gaps, tops, tokens = _decode(peaked.model, prompt, 48)
    # The winner leads by a share of the logit itself (rounding noise is ~1e-3 of it in bfloat16), every step;
    # a normal random model's closest call is far closer.
    assert min(g / t for g, t in zip(gaps, tops)) > 0.3
    assert min(normal_gaps) < min(gaps) / 10
    # The next token depends on the fed token only, and walks one cycle: no token repeats this soon.
    assert len(set(tokens)) == len(tokens)
    other = make_prompts("random", 1, 16, 2000, seed=1)[0][:-1] + prompt[-1:]
    assert _decode(peaked.model, other, 8)[2] == tokens[:8]


def test_peaked_needs_an_untied_head():
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        DemoModelConfig(peaked=True)


def test_demo_model_command_builds_a_peaked_folder(tmp_path):
    args = make_parser(with_bench=False).parse_args(["demo-model", str(tmp_path / "m"), "--peaked"])
    assert args.func(args) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["hidden_size"] == SHAPES["tiny"].hidden_size
    assert load_model(str(tmp_path / "m")).model is not None


def test_oracle_on_a_peaked_target_accepts_everything_and_stays_greedy(tmp_path):
    loaded = load_model(str(build_model_folder(tmp_path / "peaked", PEAKED_TINY)))
    prompts = make_prompts("random", 3, 16, 2000, seed=2)

    def core(**spec):
        config = EngineConfig(max_num_seqs=4, enable_prefix_cache=False, num_draft_tokens=4, spec_max_batch=4, **spec)
        return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=128)

    plain, replayed = {}, {}
    run_wave(core(), prompts, 20, plain)
    oracle = core(speculative="oracle", draft_model=str(save_recording(tmp_path / "rec.json", plain)))
    run_wave(oracle, prompts, 20, replayed)
    assert replayed == plain
    stats = oracle.spec_stats()
    assert stats["num_drafted"] > 0 and stats["acceptance_rate"] == 1.0


def test_bench_peaked_oracle_reads_full_acceptance(tmp_path):
    out = tmp_path / "spec.json"
    args = make_parser().parse_args([
        "bench", "speculative", "--peaked", "--drafts", "oracle", "--workloads", "random", "--concurrency", "2",
        "--prompt-tokens", "16", "--max-tokens", "12", "--spec-max-batch", "2", "--output-json", str(out),
    ])
    assert args.func(args) == 0
    result = json.loads(out.read_text())
    assert result["config"]["peaked"] is True
    (row,) = [r for r in result["rows"] if r["mode"] == "oracle"]
    assert row["acceptance"] == 1.0 and row["tokens_per_step"] > 2 and row["tokens"] == 24

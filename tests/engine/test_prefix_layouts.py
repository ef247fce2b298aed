"""The prefix cache on every layout it stores besides plain KV: MLA (keys and values of different
widths), sliding windows (rotating caches restored from the blocks inside the window) and recurrent
state (snapshots at block boundaries). Greedy tokens are compared with the cache off, on tiny random
fixtures; hits are read from `num_cached_tokens`.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.testing.families import build_family_folder

BS = 16
FAMILIES = ["deepseek_v2", "gemma3_text", "gpt_oss", "qwen3_next", "nemotron_h", "lfm2"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    return name, load_model(str(build_family_folder(tmp_path_factory.mktemp(name), name)))


def make_core(loaded, **kw) -> EngineCore:
    config = EngineConfig(**{"max_num_seqs": 16, "block_size": BS, "cache_memory_bytes": 32 << 20, **kw})
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="layout-fixture")


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def run(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int = 8) -> dict[str, dict]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, prompt in prompts.items():
        core.add_request(Request(rid, prompt, params))
    out: dict[str, dict] = {}
    for _ in range(10_000):
        if not core.has_work:
            return out
        for o in core.step():
            assert o.error is None, o.error
            d = out.setdefault(o.request_id, {"ids": [], "cached": 0})
            d["ids"] += o.new_token_ids
            d["cached"] = o.num_cached_tokens
    raise AssertionError("the engine did not finish")


def one(core: EngineCore, prompt: list[int], max_tokens: int = 8) -> dict:
    return run(core, {"r": prompt}, max_tokens)["r"]


def test_multi_turn_and_a_repeated_prompt_hit_with_identical_output(family):
    name, loaded = family
    on, off = make_core(loaded), make_core(loaded, enable_prefix_cache=False)
    turn1 = tokens(1, 3 * BS + 13)
    first = one(on, turn1, 20)
    assert first["ids"] == one(off, turn1, 20)["ids"] and first["cached"] == 0, name
    turn2 = turn1 + first["ids"] + tokens(2, 9)
    second = one(on, turn2)
    assert second["ids"] == one(off, turn2)["ids"], name
    assert second["cached"] >= len(turn1) - BS, (name, second["cached"])
    # The same prompt again: resumed at its last block boundary (one token is always computed).
    again = one(on, turn1, 20)
    assert again == {"ids": first["ids"], "cached": (len(turn1) - 1) // BS * BS}, name
    # A short answer that completes no block while decoding: turn 2 still reaches the prompt's blocks.
    short1 = tokens(3, 4 * BS + 2)
    short = one(on, short1, 3)
    follow = short1 + short["ids"] + tokens(4, 5)
    out = one(on, follow)
    assert out["ids"] == one(off, follow)["ids"] and out["cached"] >= len(short1) - BS, name


def with_logprobs(core: EngineCore, prompt: list[int], max_tokens: int = 8) -> tuple[list[int], list[float], int]:
    """(greedy ids, their logprobs, cached tokens): a random model's greedy ids alone often repeat one token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    core.add_request(Request("r", prompt, params))
    ids, lps, cached = [], [], 0
    while core.has_work:
        for o in core.step():
            assert o.error is None, o.error
            ids += o.new_token_ids
            lps += [e.logprob for e in o.logprobs or ()]
            cached = o.num_cached_tokens
    return ids, lps, cached


def one_forward_matches_the_split(loaded, monkeypatch, name: str) -> None:
    """On CUDA a short last chunk runs as one forward instead of its body and its last token apart
    (the prefiller's one_forward_logits). Same tokens and logprobs, with chunks split over steps and a turn 2 that hits."""
    monkeypatch.setattr("mlxhost.engine.runner.model_runner.is_cuda", lambda: False)
    split = make_core(loaded, prefill_step_size=32)
    monkeypatch.setattr("mlxhost.engine.runner.model_runner.is_cuda", lambda: True)
    whole = make_core(loaded, prefill_step_size=32)
    assert split.runner.prefiller.one_forward_logits == 0 < whole.runner.prefiller.one_forward_logits
    turn1 = tokens(5, 3 * BS + 13)
    first = with_logprobs(split, turn1, 12)
    assert_same(first, with_logprobs(whole, turn1, 12), name)
    turn2 = turn1 + first[0] + tokens(6, 9)
    second = with_logprobs(split, turn2)
    assert second[2] > 0, name
    assert_same(second, with_logprobs(whole, turn2), name)


def assert_same(a: tuple, b: tuple, name: str) -> None:
    assert a[0] == b[0] and a[2] == b[2], name
    assert np.allclose(a[1], b[1], atol=1e-4), (name, a[1], b[1])


def test_a_last_chunk_in_one_forward_gives_the_same_tokens(family, monkeypatch):
    one_forward_matches_the_split(family[1], monkeypatch, family[0])


def test_a_last_chunk_in_one_forward_plain_kv(tmp_path, monkeypatch):
    for name in ("qwen3", "llama"):  # prompts prefilled alone take `_prefill` (a lone prompt, a burst's odd one)
        one_forward_matches_the_split(load_model(str(build_family_folder(tmp_path / name, name))), monkeypatch, name)


def test_concurrent_conversations_sharing_a_system_prompt(family):
    name, loaded = family
    on, off = make_core(loaded, prefill_step_size=24), make_core(loaded, enable_prefix_cache=False)
    system = tokens(5, 2 * BS + 7)
    prompts = {f"c{i}": system + tokens(10 + i, 3 + 4 * i) for i in range(8)}
    cold, reference = run(on, prompts), run(off, prompts)
    assert all(cold[r]["ids"] == reference[r]["ids"] for r in prompts), name
    # Second turns of all eight at once, each on its own first turn.
    turn2 = {r: p + cold[r]["ids"] + tokens(30 + i, 6) for i, (r, p) in enumerate(prompts.items())}
    warm, reference2 = run(on, turn2), run(off, turn2)
    for r, p in prompts.items():
        assert warm[r]["ids"] == reference2[r]["ids"], (name, r)
        assert warm[r]["cached"] >= len(p) - BS, (name, r, warm[r]["cached"])


def test_restart_from_the_ssd_tier(family, tmp_path):
    name, loaded = family
    turn1 = tokens(6, 4 * BS + 5)
    first = make_core(loaded, ssd_cache_dir=str(tmp_path))
    answer = one(first, turn1, 20)
    first.close()
    second = make_core(loaded, ssd_cache_dir=str(tmp_path))
    assert second.cache_stats()["num_cached_blocks"] == 0
    again = one(second, turn1, 20)
    assert again == {"ids": answer["ids"], "cached": (len(turn1) - 1) // BS * BS}, name
    turn2 = turn1 + answer["ids"] + tokens(7, 4)
    out = one(second, turn2)
    second.close()
    assert out["ids"] == one(make_core(loaded, enable_prefix_cache=False), turn2)["ids"], name
    assert out["cached"] >= len(turn1) - BS, name
    stats = second.cache_stats()
    assert stats["ssd"]["hits"] > 0
    if name in ("qwen3_next", "nemotron_h", "lfm2"):
        assert stats["ssd_snapshots"]["hits"] > 0 and stats["memory"]["num_snapshots"] > 0
    if name in ("gemma3_text", "gpt_oss"):
        # Sliding KV is read back only for the blocks inside the window where a hit resumes.
        assert 0 < stats["ssd_windows"]["hits"] < stats["ssd"]["hits"]


def test_cache_stats_count_blocks_and_snapshots_in_the_budget(family):
    name, loaded = family
    core = make_core(loaded)
    one(core, tokens(8, 3 * BS + 3), 2 * BS)
    stats = core.cache_stats()
    mem = stats["memory"]
    assert mem["num_blocks"] == stats["num_cached_blocks"] > 0
    assert stats["memory_bytes"] == mem["block_bytes"] + mem["snapshot_bytes"]
    if name in ("qwen3_next", "nemotron_h", "lfm2"):
        # The prompt's last boundary and the two reached while decoding.
        assert mem["num_snapshots"] == 3 and mem["snapshot_budget_bytes"] == (32 << 20) // 4
        assert stats["budget_bytes"] >= mem["snapshot_budget_bytes"]
    else:
        assert mem["num_snapshots"] == 0


def written_ssd(tmp_path, tmp_path_factory, family: str, seed: int, folder: str, what: str):
    """A fixture of `family` whose first core served one prompt and wrote its SSD tier: (model, prompt,
    greedy ids, the files in the tier's `folder`)."""
    loaded = load_model(str(build_family_folder(tmp_path_factory.mktemp(family), family)))
    prompt = tokens(seed, 3 * BS + 4)
    first = make_core(loaded, ssd_cache_dir=str(tmp_path))
    expected = one(first, prompt)["ids"]
    first.close()
    files = sorted((tmp_path / folder).iterdir())
    assert files, f"no {what} was written"
    return loaded, prompt, expected, files


@pytest.mark.parametrize("fault", ["truncated", "flipped", "foreign"])
def test_bad_snapshot_files_are_recomputed(tmp_path, tmp_path_factory, fault):
    loaded, prompt, expected, files = written_ssd(tmp_path, tmp_path_factory, "nemotron_h", 9, "states", "snapshot")
    states = tmp_path / "states"
    for path in files:
        data = bytearray(path.read_bytes())
        if fault == "truncated":
            data = data[: len(data) - 7]
        elif fault == "flipped":
            data[-3] ^= 0x40
        else:  # the same file name under another model's key
            key = b'"model_key":"layout-fixture"'
            assert key in data
            data = data.replace(key, b'"model_key":"layout-fixturX"')
        path.write_bytes(bytes(data))
    second = make_core(loaded, ssd_cache_dir=str(tmp_path))
    out = one(second, prompt)
    second.close()
    assert out["ids"] == expected
    assert out["cached"] == 0  # the blocks are there, but no snapshot to resume from
    assert not any(os.scandir(states))  # a bad file is removed (at the scan, or when read)
    assert second.cache_stats()["ssd_snapshots"]["corrupt_removed" if fault != "foreign" else "incompatible_removed"] == 1


def test_bad_window_files_are_recomputed(tmp_path, tmp_path_factory):
    loaded, prompt, expected, files = written_ssd(tmp_path, tmp_path_factory, "gemma3_text", 11, "windows",
                                                  "sliding window")
    for path in files:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))
    second = make_core(loaded, ssd_cache_dir=str(tmp_path))
    out = one(second, prompt)
    again = one(second, prompt)  # the recompute stored the blocks whole again
    second.close()
    assert out["ids"] == again["ids"] == expected
    assert out["cached"] == 0  # the blocks' full-attention KV is there, but no window to resume with
    assert again["cached"] > 0
    assert second.cache_stats()["ssd_windows"]["corrupt_removed"] >= 1


def test_missing_window_files_make_their_blocks_misses(tmp_path, tmp_path_factory):
    """Window files gone (a crash between the two writes, evicted on their own): their blocks are misses,
    recomputed and stored whole, so the next request hits again."""
    loaded, prompt, expected, files = written_ssd(tmp_path, tmp_path_factory, "gemma3_text", 11, "windows",
                                                  "sliding window")
    for path in files:
        path.unlink()
    second = make_core(loaded, ssd_cache_dir=str(tmp_path))
    out, again = one(second, prompt), one(second, prompt)
    second.close()
    assert out["ids"] == again["ids"] == expected
    assert out["cached"] == 0 < again["cached"]

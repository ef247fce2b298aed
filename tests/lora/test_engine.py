"""LoRA adapters inside the engine core, on the tiny qwen3 fixture: greedy tokens under an adapter are
mlx-lm's with that adapter loaded, alone and in batches that mix adapters and the base model (prefilled
together and one by one); the prefix cache keeps each adapter's blocks to itself; PEFT's format gives the
same tokens as mlx-lm's; unloading gives the model back as it was."""

from __future__ import annotations

import random

import mlx.nn as nn
import pytest

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.lora.adapters import AdapterError, adapter_id, read_adapter
from mlxhost.lora.fused import fused_ops
from mlxhost.lora.manager import AdapterSet
from mlxhost.models.loader import load_model

MAX_NEW = 10  # as conftest.py's references

BS = 16


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


@pytest.fixture
def make_core(loaded):
    """make_core(adapters, **config) -> (core, {name: adapter id}); its adapters are unloaded after the test,
    which gives the shared fixture model back unwrapped (one AdapterSet per model at a time)."""
    made = []

    def make(adapters: dict[str, str], **kw):
        core, ids = _make_core(loaded, adapters, **kw)
        made.append((core, ids))
        return core, ids

    yield make
    for core, ids in made:
        for aid in ids.values():
            core.runner.lora.unload(aid)


def _make_core(loaded, adapters: dict[str, str], fused=None, **kw) -> tuple[EngineCore, dict[str, str]]:
    """A core with `adapters` (name -> folder) loaded; returns it and each name's adapter id. `fused`: a
    kernel for the fused layout (its op twin here, where MLX-CUDA's cannot run)."""
    config = EngineConfig(**{"max_num_seqs": 16, "block_size": BS, "cache_memory_bytes": 64 << 20, **kw})
    core = EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=4096, model_key="qwen3-fixture")
    if fused is not None:
        core.runner.lora = AdapterSet(loaded.model, fused=fused)
    ids = {}
    for name, path in adapters.items():
        files = read_adapter(path)
        ids[name] = adapter_id(name, files)
        core.runner.lora.load(ids[name], files)
    return core, ids


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def run(core: EngineCore, jobs: dict[str, tuple[str, list[int]]], max_tokens: int = MAX_NEW) -> dict[str, dict]:
    """jobs: request id -> (adapter id, prompt), all added at once; returns {rid: {"ids", "cached"}}."""
    for rid, (adapter, prompt) in jobs.items():
        core.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                             ignore_eos=True), adapter=adapter))
    out: dict[str, dict] = {}
    for _ in range(10_000):
        if not core.has_work:
            break
        for o in core.step():
            assert o.error is None, o.error
            entry = out.setdefault(o.request_id, {"ids": [], "cached": 0})
            entry["ids"] += o.new_token_ids
            entry["cached"] = o.num_cached_tokens
    assert set(jobs) <= set(out)
    return out


@pytest.fixture
def core(make_core, adapters):
    return make_core(adapters)


def test_one_adapter_alone_matches_mlx_lm(core, reference):
    core, ids = core
    prompt = tokens(1, 23)
    for name in ("alpha", "beta", "gamma"):
        got = run(core, {name: (ids[name], prompt)})[name]["ids"]
        assert got == reference(name, prompt), name
    # The adapters do change the output, or this test would prove nothing.
    assert len({tuple(reference(n, prompt)) for n in (None, "alpha", "beta", "gamma")}) == 4


@pytest.mark.parametrize("prefill_rows, layout", [(8, "dense"), (1, "dense"), (8, "gather"), (8, "fused")])
def test_a_batch_mixing_three_adapters_and_the_base(make_core, adapters, reference, prefill_rows, layout,
                                                    monkeypatch):
    # The dense layout (CPU, Metal), the gathered one, and MLX-CUDA's fused one with its kernel's op twin.
    monkeypatch.setenv("MLXHOST_LORA_LAYOUT", layout)
    core, ids = make_core(adapters, max_num_prefill_rows=prefill_rows, enable_prefix_cache=False,
                          fused=fused_ops if layout == "fused" else None)
    assert core.runner.lora.layout == layout
    names = [None, "alpha", "beta", "gamma"] * 4
    prompts = [tokens(10 + i, 5 + 3 * i) for i in range(len(names))]
    jobs = {f"r{i}": (ids[n] if n else "", p) for i, (n, p) in enumerate(zip(names, prompts))}
    out = run(core, jobs)
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        assert out[f"r{i}"]["ids"] == reference(name, prompt), (i, name)


def test_rows_joining_a_decoding_batch_keep_their_adapters(core, reference):
    core, ids = core
    first = {f"a{i}": (ids[n], tokens(40 + i, 9)) for i, n in enumerate(("alpha", "beta"))}
    for rid, (adapter, prompt) in first.items():
        core.add_request(Request(rid, prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
                                 adapter=adapter))
    head = {}
    for _ in range(3):  # alpha and beta decode while gamma and the base join
        for o in core.step():
            head[o.request_id] = head.get(o.request_id, []) + o.new_token_ids
    later = {"g": (ids["gamma"], tokens(50, 12)), "b": ("", tokens(51, 7))}
    out = run(core, later)
    assert out["g"]["ids"] == reference("gamma", later["g"][1])
    assert out["b"]["ids"] == reference(None, later["b"][1])
    for rid, name in (("a0", "alpha"), ("a1", "beta")):
        assert head.get(rid, []) + out[rid]["ids"] == reference(name, first[rid][1]), rid


def test_prefix_cache_blocks_stay_with_their_adapter(core, reference):
    core, ids = core
    prompt = tokens(7, 3 * BS + 5)
    under_a = run(core, {"a1": (ids["alpha"], prompt)})["a1"]
    under_b = run(core, {"b1": (ids["beta"], prompt)})["b1"]
    base = run(core, {"n1": ("", prompt)})["n1"]
    again = run(core, {"a2": (ids["alpha"], prompt)})["a2"]
    assert under_a["cached"] == 0
    assert under_b["cached"] == 0, "beta was served blocks alpha computed"
    assert base["cached"] == 0, "the base model was served an adapter's blocks"
    assert again["cached"] == 3 * BS
    assert under_a["ids"] == again["ids"] == reference("alpha", prompt)
    assert under_b["ids"] == reference("beta", prompt)
    assert base["ids"] == reference(None, prompt)


def test_a_peft_adapter_gives_mlx_lm_s_tokens(make_core, peft_adapter, reference):
    files = read_adapter(peft_adapter)
    assert files.format == "peft" and files.transposed and files.scale == 10.0
    core, ids = make_core({"alpha": peft_adapter})
    prompt = tokens(3, 17)
    assert run(core, {"p": (ids["alpha"], prompt)})["p"]["ids"] == reference("alpha", prompt)


def test_a_request_for_an_adapter_not_loaded_fails_alone(make_core, adapters, reference):
    core, ids = make_core({"alpha": adapters["alpha"]})
    prompt = tokens(5, 9)
    for rid, adapter in (("ok", ids["alpha"]), ("gone", "beta@0123456789abcdef")):
        core.add_request(Request(rid, prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
                                 adapter=adapter))
    outs: dict[str, list] = {}
    errors = {}
    while core.has_work:
        for o in core.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.error:
                errors[o.request_id] = o.error
    assert "not loaded" in errors["gone"] and "ok" not in errors
    assert outs["ok"] == reference("alpha", prompt)


def test_unloading_every_adapter_gives_the_model_back(loaded, make_core, adapters, reference):
    core, ids = make_core(adapters)
    lora = core.runner.lora
    assert lora.nbytes > 0 and len(lora.layers) == 14  # alpha adapts all 7 linear layers of both blocks
    freed = [lora.unload(ids[n]) for n in ("beta", "alpha")]
    assert all(f > 0 for f in freed)
    assert set(lora.layers) == {p for p, _ in loaded.model.named_modules() if p.startswith("model.layers.1.")
                                and p.rsplit(".", 1)[-1].endswith("proj")}  # gamma: the last block only
    prompt = tokens(9, 11)
    assert run(core, {"g": (ids["gamma"], prompt)})["g"]["ids"] == reference("gamma", prompt)
    lora.unload(ids["gamma"])
    assert lora.nbytes == 0 and not lora.layers and len(lora) == 0
    assert all(type(m) in (nn.Linear,) for p, m in loaded.model.named_modules() if p.endswith("proj"))
    assert run(core, {"n": ("", prompt)})["n"]["ids"] == reference(None, prompt)


def test_an_adapter_for_another_model_is_refused_at_load(make_core, tmp_path, llama_model_dir):
    from mlxhost.testing.lora_fixtures import random_adapter

    files = read_adapter(random_adapter(llama_model_dir, tmp_path / "other", rank=4, keys=("mlp.down_proj",)))
    core, _ = make_core({})
    # The llama fixture has the same module names and sizes: make the shapes disagree on purpose.
    bad = files.modules[0].__class__(files.modules[0].path, "x", "y", 64, 128, 4)
    with pytest.raises(AdapterError, match="this model's is"):
        core.runner.lora.load("bad@0", files.__class__(**{**files.__dict__, "modules": (bad,)}))
    missing = files.modules[0].__class__("model.layers.9.mlp.down_proj", "x", "y", 256, 128, 4)
    with pytest.raises(AdapterError, match="does not have"):
        core.runner.lora.load("bad@1", files.__class__(**{**files.__dict__, "modules": (missing,)}))
    assert len(core.runner.lora) == 0 and not core.runner.lora.layers


@pytest.mark.parametrize("layout", ["dense", "fused"])  # fused: the verify forward's 5 positions a row
def test_ngram_speculation_under_adapters_keeps_the_tokens(make_core, adapters, reference, layout, monkeypatch):
    monkeypatch.setenv("MLXHOST_LORA_LAYOUT", layout)
    core, ids = make_core(adapters, speculative="ngram", num_draft_tokens=4,
                          fused=fused_ops if layout == "fused" else None)
    assert core.runner.lora.layout == layout
    assert core.spec is not None
    # Repeated phrases, so prompt lookup has drafts to verify; every row's output must stay its own.
    prompts = {f"s{i}": tokens(60 + i, 6) * 4 for i in range(4)}
    names = {"s0": None, "s1": "alpha", "s2": "beta", "s3": "gamma"}
    out = run(core, {rid: (ids[n] if n else "", p) for rid, (n, p) in zip(prompts, zip(names.values(),
                                                                                      prompts.values()))}, 16)
    for rid, prompt in prompts.items():
        assert out[rid]["ids"] == reference(names[rid], prompt, 16), rid
    assert core.spec.stats.num_drafted > 0


def test_structured_output_under_an_adapter(make_core, adapters, loaded):
    import json

    from mlxhost.structured.grammar import json_schema_constraint

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    core, ids = make_core(adapters)
    for i, name in enumerate(("alpha", "beta")):
        core.add_request(Request(f"j{i}", tokens(70 + i, 9), SamplingParams(
            max_tokens=60, temperature=0.0, constraint=json_schema_constraint(schema)),
            eos_token_ids=loaded.eos_token_ids, adapter=ids[name]))
    text: dict[str, str] = {}
    while core.has_work:
        for o in core.step():
            assert o.error is None, o.error
            text[o.request_id] = text.get(o.request_id, "") + o.text
    for rid in ("j0", "j1"):
        assert json.loads(text[rid]) in ({"ok": True}, {"ok": False}), text[rid]


def test_an_adapter_in_use_is_not_unloaded_and_its_memory_returns(make_core, adapters):
    import mlx.core as mx

    from mlxhost.lora.adapters import AdapterBusy
    from mlxhost.lora.manager import load_adapter, unload_adapter

    core, _ = make_core({})
    files = read_adapter(adapters["alpha"])
    aid = adapter_id("alpha", files)
    mx.synchronize()
    before = mx.get_active_memory()
    kv_before = core.scheduler.kv_capacity_tokens
    held = load_adapter(core, aid, files)
    assert held == core.runner.lora.nbytes > 0
    assert mx.get_active_memory() >= before + held
    assert core.governor is not None  # the fixture's engine has a memory budget: the adapter's bytes left it
    assert core.scheduler.kv_capacity_tokens < kv_before
    core.add_request(Request("busy", tokens(80, 9), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                             adapter=aid))
    with pytest.raises(AdapterBusy, match="serving 1 request"):
        unload_adapter(core, aid)
    while core.has_work:
        core.step()
    assert unload_adapter(core, aid) == held
    assert core.runner.lora.nbytes == 0 and core.scheduler.kv_capacity_tokens == kv_before
    mx.synchronize()
    assert mx.get_active_memory() <= before


def test_an_adapter_on_a_4bit_base_matches_mlx_lm(qwen3_4bit_model_dir, tmp_path):
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from mlxhost.testing.lora_fixtures import train_adapter

    path = str(train_adapter(qwen3_4bit_model_dir, tmp_path / "q", seed=5, rank=4, scale=10.0))
    model, _ = mlx_lm.load(str(qwen3_4bit_model_dir), adapter_path=path)
    prompt = tokens(90, 13)
    want = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_NEW,
                                             sampler=make_sampler(temp=0.0))]
    loaded = load_model(str(qwen3_4bit_model_dir))
    core, ids = _make_core(loaded, {"q": path})
    assert all(isinstance(layer.linear, nn.QuantizedLinear) for layer in core.runner.lora.layers.values())
    out = run(core, {"q": (ids["q"], prompt), "b": ("", prompt)})
    assert out["q"]["ids"] == want and out["q"]["ids"] != out["b"]["ids"]

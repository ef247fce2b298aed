"""Cache roles (kv/roles/): a role registered from here, with its own cache kind, goes through the whole prefix
cache (prefill capture, block copy, fill on a hit, spill to the SSD tier and load after a restart) with no other
change; and the three built-in roles keep the SSD tier's tensor names."""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.kv.kinds.plain import cat
from mlxhost.kv.kinds.registry import CacheKind, LayerSpec
from mlxhost.kv.roles import ROLES
from mlxhost.kv.roles.base import CacheRole, check_rows, from_bytes
from mlxhost.kv.store.ssd_format import FORMAT_VERSION, read_block
from mlxhost.models.loader import load_model
from mlxhost.testing.families import build_family_folder

BS = 16


# -- the toy role: attention layers kept apart, in a block array and an SSD tensor of their own --------------
class ToyKVCache(KVCache):
    """A plain KV cache under another class, so that its layers take the toy role."""


def _toy_spec(c: Any) -> LayerSpec | None:
    if c.keys is None:
        return None
    return LayerSpec("toy", (c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype))


TOY_KIND = CacheKind("toy", (ToyKVCache,), can_batch=True, can_store=True, spec=_toy_spec)


class ToyRole(CacheRole):
    name = "toy"
    kinds = (TOY_KIND,)
    captures = True  # copies each block a prefill forward completes (a plain cache would keep them anyway)

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def _block(self, cache, layout, row, pad, start, bs):
        layers = [cache[i] for i in self.layers(layout)]
        r = row or 0
        if row is not None and pad is None:
            padding = getattr(layers[0], "left_padding", None)
            pad = padding[row].item() if padding is not None else 0
        lo = (pad or 0) + start if row is not None else start
        return mx.stack([cat(c.keys[r, :, lo : lo + bs], c.values[r, :, lo : lo + bs]) for c in layers])

    def read_blocks(self, cache, layout, row, pad, starts, block_size):
        self._count("read")
        return [self._block(cache, layout, row, pad, s, block_size) for s in starts]

    def capture_blocks(self, cache, layout, start, stop, num_cached, block_size):
        self._count("capture")
        first = -(-max(start, num_cached) // block_size) * block_size
        return {b: self._block(cache, layout, None, 0, b, block_size)
                for b in range(first, stop - block_size + 1, block_size)}

    def fill(self, cache, layout, parts, num_tokens):
        self._count("fill")
        kv = mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
        d = layout.key_width
        for j, i in enumerate(self.layers(layout)):
            cache[i].state = (kv[j, :, :, :d][None], kv[j, :, :, d:][None], num_tokens)

    def to_tensors(self, part):
        self._count("spill")
        return {"toy": part}

    def from_tensors(self, tensors, layout, dtype):
        self._count("load")
        part = from_bytes(*tensors["toy"], dtype)
        check_rows(part, len(self.layers(layout)))
        return part


@pytest.fixture
def toy_role():
    role = ToyRole()
    ROLES.register(role)  # registers TOY_KIND with KINDS too
    yield role
    ROLES.unregister(role)


@pytest.fixture(scope="module")
def toy_model(qwen3_model_dir):
    """The qwen3 fixture with every other layer's cache a ToyKVCache (a fresh load: the model is changed)."""
    loaded = load_model(str(qwen3_model_dir))
    n = len(loaded.model.layers)
    loaded.model.make_cache = lambda: [ToyKVCache() if i % 2 else KVCache() for i in range(n)]
    return loaded


def make_core(loaded, **kw) -> EngineCore:
    config = EngineConfig(**{"max_num_seqs": 4, "block_size": BS, "cache_memory_bytes": 16 << 20, **kw})
    return EngineCore(loaded.model, loaded.tokenizer, config, max_model_len=1024, model_key="toy-fixture")


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def one(core: EngineCore, prompt: list[int], max_tokens: int = 8) -> dict:
    core.add_request(Request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    out = {"ids": [], "cached": 0}
    while core.has_work:
        for o in core.step():
            assert o.error is None, o.error
            out["ids"] += o.new_token_ids
            out["cached"] = o.num_cached_tokens
    return out


def test_a_toy_role_goes_through_capture_fill_spill_and_load(toy_role, toy_model, tmp_path):
    prompt = tokens(1, 4 * BS + 5)
    reference = one(make_core(toy_model, enable_prefix_cache=False), prompt, 12)["ids"]
    first = make_core(toy_model, ssd_cache_dir=str(tmp_path))
    layout = first.runner.store.layout
    assert [r.name for r in layout.roles] == ["kv", "toy"] and layout.kinds == ("kv", "toy")
    assert one(first, prompt, 12) == {"ids": reference, "cached": 0}
    assert toy_role.calls["capture"] > 0 and toy_role.calls["read"] > 0  # prefill blocks, then the decode's
    again = one(first, prompt, 12)  # a hit in memory
    assert again == {"ids": reference, "cached": (len(prompt) - 1) // BS * BS}
    assert toy_role.calls["fill"] == 1
    first.close()
    assert toy_role.calls["spill"] > 0
    files = sorted(tmp_path.glob("*.safetensors"))
    assert files
    meta = first.runner.store.ssd.meta
    block = read_block(files[0], meta, bytes.fromhex(files[0].name.split(".")[0]), _tokens_of(files[0]))
    assert set(block.tensors) == {"kv", "toy"}

    second = make_core(toy_model, ssd_cache_dir=str(tmp_path))  # a restart: the blocks come from disk
    out = one(second, prompt, 12)
    second.close()
    assert out == {"ids": reference, "cached": (len(prompt) - 1) // BS * BS}
    assert toy_role.calls["load"] >= 4 and second.cache_stats()["ssd"]["hits"] >= 4


def _tokens_of(path) -> tuple[int, ...]:
    import json

    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return tuple(json.loads(header["__metadata__"]["token_ids"]))


def test_the_toy_role_is_gone_once_unregistered(toy_model):
    """Without its role the toy kind is unknown again: the model's caches have no layout, no prefix cache."""
    core = make_core(toy_model)
    assert core.runner.store is None


# -- the built-in roles keep the SSD tier's format ----------------------------------------------------------
def test_the_ssd_tensor_names_and_format_version_are_unchanged():
    assert FORMAT_VERSION == 2
    assert [(r.name, r.per_block, r.ssd_folder, r.ssd_mark) for r in ROLES] == [
        ("state", False, "states", ""), ("swa", True, "windows", "window"), ("kv", True, "", "")]
    kv, swa, state = ROLES["kv"], ROLES["swa"], ROLES["state"]
    a = mx.zeros((2, 1, BS, 8))
    assert list(kv.to_tensors(a)) == ["kv"]
    assert list(kv.to_tensors((a, a, a))) == ["kv.data", "kv.scales", "kv.biases"]
    assert list(swa.to_tensors(a)) == ["swa"]
    snap = [[mx.zeros((1, 3), dtype=mx.bfloat16), mx.zeros((1, 2))], [mx.zeros((1, 4))]]
    assert list(state.to_tensors(snap)) == ["s0.0.bfloat16", "s0.1.float32", "s1.0.float32"]


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_next"])
def test_block_files_hold_the_same_tensors_as_before(family, tmp_path, tmp_path_factory):
    """Sliding and recurrent fixtures: block files hold "window" (their sliding KV in windows/) and "kv",
    snapshot files "s{layer}.{index}.{dtype}", window files "swa", as the tier's readers expect."""
    loaded = load_model(str(build_family_folder(tmp_path_factory.mktemp(family), family)))
    core = make_core(loaded, ssd_cache_dir=str(tmp_path))
    one(core, tokens(2, 3 * BS + 4))
    core.close()
    meta = core.runner.store.ssd.meta

    def names(folder):
        out = set()
        for path in folder.glob("*.safetensors"):
            out |= set(read_block(path, meta, bytes.fromhex(path.name.split(".")[0]), _tokens_of(path)).tensors)
        return out

    if family == "gemma3_text":
        assert names(tmp_path) == {"window", "kv"} and names(tmp_path / "windows") == {"swa"}
    else:
        assert names(tmp_path) == {"kv"}
        assert names(tmp_path / "states") and all(n.startswith("s") and n.count(".") == 2
                                                  for n in names(tmp_path / "states"))

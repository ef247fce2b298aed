"""The registry of cache kinds: its answers for every cache class the server meets, and a new kind added
by one registry entry."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from mlxhost.kv.kinds import KINDS
from mlxhost.kv.kinds.layout import KVLayout, read_layout
from mlxhost.kv.kinds.quantized import BatchQuantizedKVCache, QuantizedRowKVCache
from mlxhost.kv.kinds.registry import KV, OTHER, CacheKind, KindRegistry, LayerSpec

# class -> (kind, batches, can_pad, can_rewind, can_quantize, can_reserve once it holds keys)
ANSWERS = [
    (lambda: KVCache(), "plain", True, True, True, True, False),
    (lambda: BatchKVCache([0]), "plain", True, True, True, True, True),
    (lambda: QuantizedRowKVCache(), "quantized", True, False, True, False, False),
    (lambda: BatchQuantizedKVCache([0]), "quantized", True, False, True, False, True),
    (lambda: RotatingKVCache(8), "sliding", True, False, False, False, False),
    (lambda: BatchRotatingKVCache(8, [0]), "sliding", True, False, False, False, False),
    (lambda: ArraysCache(2), "recurrent", True, False, False, False, False),
    (lambda: CacheList(KVCache(), ArraysCache(1)), "list", True, False, False, False, False),
    # mlx-lm's own classes without a batch version: served one request at a time, never stored.
    (lambda: QuantizedKVCache(), "other", False, False, False, False, False),
    (lambda: ChunkedKVCache(16), "other", False, False, False, False, False),
    (lambda: ConcatenateKVCache(), "other", False, False, False, False, False),
]


@pytest.mark.parametrize("make, name, batches, pads, rewinds, quantizes, reserves", ANSWERS)
def test_each_cache_class_has_its_kinds_answers(make, name, batches, pads, rewinds, quantizes, reserves):
    c = make()
    assert KINDS.kind_of(c).name == name
    assert KINDS.can_batch([c]) is batches
    assert KINDS.can_pad([c]) is pads
    assert KINDS.can_rewind([c]) is rewinds
    assert KINDS.can_quantize(c) is quantizes
    if reserves:  # only a batch buffer that holds keys can be widened
        assert not KINDS.can_reserve(c)
        c.update_and_fetch(mx.zeros((1, 2, 1, 64)), mx.zeros((1, 2, 1, 64)))
    assert KINDS.can_reserve(c) is reserves


def test_whole_cache_answers_need_every_layer():
    assert KINDS.can_batch([KVCache(), RotatingKVCache(8), ArraysCache(2)])
    assert not KINDS.can_batch([KVCache(), ChunkedKVCache(16)])
    assert not KINDS.can_pad([KVCache(), RotatingKVCache(8)])
    assert not KINDS.can_rewind([KVCache(), ArraysCache(2)])
    assert not KINDS.can_pad([]) and not KINDS.can_rewind([])


def _fill(c, heads=2, key_width=8, value_width=8, n=1):
    c.update_and_fetch(mx.zeros((1, heads, n, key_width)), mx.zeros((1, heads, n, value_width)))
    return c


def test_layout_roles_come_from_each_layers_kind():
    layout = read_layout([_fill(KVCache()), _fill(RotatingKVCache(4)), ArraysCache(2), _fill(KVCache())])
    assert layout == KVLayout(("kv", "swa", "state", "kv"), key_width=8, window=4)
    # MLA: a plain KVCache whose keys and values differ in width.
    assert read_layout([_fill(KVCache(), key_width=16, value_width=8)]).key_width == 16
    assert read_layout([_fill(RotatingKVCache(4, keep=2))]) is None  # its first tokens cannot come from blocks
    assert read_layout([KVCache()]) is None  # no forward yet: shapes unknown
    assert read_layout([_fill(KVCache()), _fill(KVCache(), heads=4)]) is None  # one block array holds both
    assert read_layout([_fill(KVCache()), QuantizedKVCache()]) is None


class ToyCache:
    """A made-up kind: keys and values per position, a batch version of itself, no trim."""

    def __init__(self) -> None:
        self.keys = mx.zeros((1, 2, 4, 8))
        self.values = mx.zeros((1, 2, 4, 8))

    @classmethod
    def merge(cls, caches):
        return cls()


TOY = CacheKind("toy", (ToyCache,), can_batch=True, can_store=True,
                spec=lambda c: LayerSpec(KV, (c.keys.shape[1], 8, 8, c.keys.dtype), quant=(0, 0)))


@pytest.fixture
def toy_registered():
    KINDS.register(TOY)
    yield TOY
    KINDS.unregister(TOY)


def test_a_new_kind_is_one_registry_entry(toy_registered):
    toy = ToyCache()
    assert KINDS.kind_of(toy) is TOY
    assert KINDS.can_batch([toy, KVCache()]) and not KINDS.can_rewind([toy]) and not KINDS.can_pad([toy])
    assert not KINDS.can_quantize(toy) and not KINDS.can_reserve(toy)
    assert KINDS.layer_cost(toy) == (2 * 2 * 4 * 8 * 4 // 4, 0)  # float32 keys and values per position
    assert read_layout([toy, _fill(KVCache())]) == KVLayout(("kv", "kv"), key_width=8)


def test_an_unregistered_class_answers_no_except_batching_by_merge():
    toy = ToyCache()
    assert KINDS.kind_of(toy) is OTHER
    assert KINDS.can_batch([toy])  # it has mlx-lm's `merge`
    assert not KINDS.can_rewind([toy]) and read_layout([toy]) is None


def test_a_class_is_registered_once():
    registry = KindRegistry([TOY])
    with pytest.raises(ValueError, match="ToyCache"):
        registry.register(CacheKind("toy2", (ToyCache,)))

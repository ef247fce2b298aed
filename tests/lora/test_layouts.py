"""Which LoRA layout runs where, and the fused layout's grouping: MLX-CUDA's kernel cannot run here, so the
fused layout runs with `fused_ops` (the kernel's outputs with MLX ops) in its place, which exercises every
path around the kernel (groups, shared launches, decode vs prefill inputs, rows without an adapter)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxhost.lora import manager
from mlxhost.lora.adapters import adapter_id, read_adapter
from mlxhost.lora.fused import CudaFused, fused_ops, kernel_source
from mlxhost.lora.layers import MAX_FUSED_PER_ROW
from mlxhost.lora.manager import AdapterSet
from mlxhost.models.loader import load_model


class Counting:
    """fused_ops, counting launches and the members of each."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, x, ys, stacks, index, scales, rank):
        self.sizes.append(len(ys))
        return fused_ops(x, ys, stacks, index, scales, rank)


@pytest.fixture(scope="module")
def loaded(qwen3_model_dir):
    return load_model(str(qwen3_model_dir))


@pytest.fixture
def adapter_set(loaded, adapters):
    """make(layout, fused=None) -> (AdapterSet with the three adapters, their ids); unloaded after the test,
    which gives the shared model back unwrapped."""
    made = []

    def make(layout, fused=None):
        lora = AdapterSet(loaded.model, layout=layout, fused=fused)
        ids = []
        for name in ("alpha", "beta", "gamma"):
            files = read_adapter(adapters[name])
            ids.append(adapter_id(name, files))
            lora.load(ids[-1], files)
        made.append((lora, ids))
        return lora, ids

    yield make
    for lora, ids in made:
        for aid in ids:
            lora.unload(aid)


def test_layout_follows_the_backend_and_the_variable(monkeypatch):
    monkeypatch.delenv("MLXHOST_LORA_LAYOUT", raising=False)
    monkeypatch.setattr("mlxhost.platform.backend.is_cuda", lambda: False)
    assert manager._layout(None, None) == ("dense", None)
    # No CUDA: the fused layout has no kernel and falls back to the gathered ops, never calling CUDA.
    assert manager._layout("fused", None) == ("gather", None)
    monkeypatch.setenv("MLXHOST_LORA_LAYOUT", "gather")
    assert manager._layout(None, None) == ("gather", None)
    kernel = Counting()
    assert manager._layout("fused", kernel) == ("fused", kernel)
    monkeypatch.setattr("mlxhost.platform.backend.is_cuda", lambda: True)
    monkeypatch.delenv("MLXHOST_LORA_LAYOUT")
    layout, fused = manager._layout(None, None)
    assert layout == "fused" and isinstance(fused, CudaFused)
    monkeypatch.setenv("MLXHOST_LORA_LAYOUT", "dense")
    assert manager._layout(None, None) == ("dense", None)


def test_the_kernel_source_selects_each_member():
    one, three = kernel_source(1), kernel_source(3)
    assert "a = a1" not in one and "tile -= T0" not in one
    for g in (1, 2):
        assert f"tile -= T{g - 1}; a = a{g}; b = b{g}; y = y{g}; o = o{g}; out_dim = OUT{g};" in three
    assert three.count("{") == three.count("}")


def _forward(model, lora, ids_per_row, tokens):
    with lora.rows(ids_per_row):
        return model(tokens)


@pytest.mark.parametrize("positions, per_row, limit", [(1, None, None), (3, None, None), (12, None, None),
                                                     (12, 8, None), (12, None, 50)])
def test_fused_rows_match_the_gathered_layout(loaded, adapter_set, positions, per_row, limit, monkeypatch):
    """Rows of three adapters and the base in one forward: the fused layout's logits are the gathered
    layout's, one launch per input group for up to MAX_FUSED_PER_ROW positions a row (every length by
    default; `per_row` 8, as MLXHOST_LORA_FUSED_POSITIONS=8 sets it, sends a 12-position input to the
    gathered ops), none for one of more positions than a launch takes (`limit` lowers that: 8 rows x 12
    positions is over 50)."""
    if per_row is not None:
        monkeypatch.setattr("mlxhost.lora.layers.MAX_FUSED_PER_ROW", per_row)
    if limit is not None:
        monkeypatch.setattr("mlxhost.lora.layers.MAX_POSITIONS", limit)
    model = loaded.model
    tokens = mx.array([[(7 * r + 3 * i) % 500 + 3 for i in range(positions)] for r in range(8)])
    gathered, ids = adapter_set("gather")
    rows = [ids[r % 3] if r % 4 else "" for r in range(8)]
    want = _forward(model, gathered, rows, tokens)
    for aid in ids:
        gathered.unload(aid)
    kernel = Counting()
    fused, ids = adapter_set("fused", kernel)
    kernel.sizes.clear()  # the launches at load that compile the kernel
    assert fused.layout == "fused"
    got = _forward(model, fused, rows, tokens)
    assert mx.abs(got - want).max().item() < 1e-4
    blocks = len(model.layers)
    if positions <= (per_row or MAX_FUSED_PER_ROW) and limit is None:
        # q/k/v, o, gate/up, down: four launches a block, each for all its members.
        assert sorted(kernel.sizes) == sorted([3, 1, 2, 1] * blocks)
    else:
        assert kernel.sizes == []
    # A row without an adapter gets exactly the base model's logits for the same batch (a batch of
    # another size may take another BLAS blocking and round differently).
    base = model(tokens)
    assert mx.array_equal(got[0], base[0])


def test_a_member_called_with_another_input_computes_its_own(loaded, adapter_set):
    kernel = Counting()
    lora, ids = adapter_set("fused", kernel)
    kernel.sizes.clear()  # the launches at load that compile the kernel
    attn = loaded.model.layers[0].self_attn
    x = mx.random.normal((2, 1, attn.q_proj.in_dims))
    other = x + 1
    with lora.rows([ids[0], ""]):
        got = [attn.q_proj(x), attn.k_proj(other), attn.v_proj(x)]
    assert kernel.sizes == [3, 3, 3]  # each call on an input the group has not seen runs the group again
    for name in ("q_proj", "k_proj", "v_proj"):
        lora.layers[f"model.layers.0.self_attn.{name}"]._fused = None  # the gathered ops from here on
    with lora.rows([ids[0], ""]):
        want = [attn.q_proj(x), attn.k_proj(other), attn.v_proj(x)]
    for g, w in zip(got, want):
        assert mx.abs(g - w).max().item() < 1e-5


def test_loading_compiles_each_fused_group_shape_once(loaded, adapter_set, adapters):
    """The kernel runs at load on one row per group shape not compiled yet (so it compiles before the first
    decode step under an adapter), and not again for a shape already compiled."""
    kernel = Counting()
    lora, ids = adapter_set("fused", fused=kernel)
    shapes = {layer._fused.signature() for layer in lora.layers.values()}
    assert len(kernel.sizes) == len(lora._warmed) >= len(shapes) > 0
    assert shapes <= {shape for shape, _ in lora._warmed}
    # Unloading an adapter and loading it again brings back shapes compiled before: no launch.
    before = len(kernel.sizes)
    lora.unload(ids[2])
    lora.load(ids[2], read_adapter(adapters["gamma"]))
    assert len(kernel.sizes) == before


def test_the_kernel_runs_only_on_the_batch_rows(loaded, adapter_set):
    """The kernel maps positions to rows by count: an input with other rows than the forward's batch
    never reaches it (it would give rows the wrong adapter)."""
    kernel = Counting()
    lora, ids = adapter_set("fused", kernel)
    kernel.sizes.clear()  # the launches at load that compile the kernel
    q_proj = loaded.model.layers[0].self_attn.q_proj
    with lora.rows([ids[0], ids[1]]):
        mx.eval(q_proj(mx.random.normal((2, 1, q_proj.in_dims))))
        assert kernel.sizes == [3]
        mx.eval(q_proj(mx.random.normal((1, 1, q_proj.in_dims))))
    assert kernel.sizes == [3]


def test_the_fused_positions_setting_is_a_whole_number_of_at_least_one():
    from mlxhost.lora.layers import _fused_positions

    assert _fused_positions({"MLXHOST_LORA_FUSED_POSITIONS": "8"}) == 8
    assert _fused_positions({}) > 8  # prefill too by default
    for bad in ("0", "-3", "abc", ""):
        with pytest.raises(ValueError, match="MLXHOST_LORA_FUSED_POSITIONS"):
            _fused_positions({"MLXHOST_LORA_FUSED_POSITIONS": bad})

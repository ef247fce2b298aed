"""Compiled matchers, packed bitmasks and applying them to logits (MLX on this machine's CPU)."""

import time

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from mlxhost.structured.grammar import (
    Constraint,
    ConstraintError,
    json_schema_constraint,
    tool_call_constraint,
)
from mlxhost.structured.matcher import GrammarCompiler, allocate_bitmask, apply_bitmask
from mlxhost.testing.demo import ensure_demo_model

SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "string", "maxLength": 5},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
EXTRA_IDS = 7  # logits wider than the tokenizer, as for models padded to a round vocabulary


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    _, wrapper = mlx_lm.load(str(ensure_demo_model(tmp_path_factory.mktemp("matcher") / "m")))
    return wrapper


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer._tokenizer) + EXTRA_IDS, tokenizer.eos_token_ids)


def allowed_ids(bitmask: np.ndarray, row: int, width: int) -> np.ndarray:
    bits = np.unpackbits(bitmask[row : row + 1].view(np.uint8), axis=1, bitorder="little")[0, :width]
    return np.nonzero(bits)[0]


def test_compiler_sizes_and_eos(compiler, tokenizer):
    assert compiler.vocab_size == len(tokenizer._tokenizer) + EXTRA_IDS
    assert compiler.eos_token_ids == sorted(tokenizer.eos_token_ids)
    assert allocate_bitmask(3, compiler.vocab_size).shape == (3, (compiler.vocab_size + 31) // 32)


def test_row_matcher_walks_the_grammar(compiler, tokenizer):
    matcher = compiler.compile(json_schema_constraint(SCHEMA))
    assert matcher.kind == "json_schema" and not matcher.is_accepting and not matcher.is_stopped
    bitmask = allocate_bitmask(2, compiler.vocab_size)
    matcher.fill_mask(bitmask, 1)
    assert [tokenizer.decode([int(t)]) for t in allowed_ids(bitmask, 1, compiler.vocab_size)] == ["{"]
    assert (bitmask[0] == -1).all()  # other rows untouched
    for token in tokenizer.encode('{"a": 42, "b": "xy"}'):
        assert matcher.consume(token), matcher.error
    assert matcher.is_accepting and matcher.is_stopped and matcher.error == ""
    matcher.fill_mask(bitmask, 1)
    assert allowed_ids(bitmask, 1, compiler.vocab_size).tolist() == compiler.eos_token_ids


def test_rejected_token_sets_error_and_leaves_only_eos(compiler, tokenizer):
    matcher = compiler.compile(json_schema_constraint(SCHEMA))
    assert not matcher.consume(tokenizer.encode("x")[0])
    assert matcher.error and matcher.is_stopped
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_mask(bitmask, 0)
    assert allowed_ids(bitmask, 0, compiler.vocab_size).tolist() == compiler.eos_token_ids


def test_ids_past_the_tokenizer_are_never_allowed(compiler, tokenizer):
    free_text = Constraint(grammar="start: /(.|\\n)*/\n", kind="text")
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    compiler.compile(free_text).fill_mask(bitmask, 0)
    ids = allowed_ids(bitmask, 0, compiler.vocab_size)
    assert ids.max() < len(tokenizer._tokenizer) and len(ids) > 1000


def test_several_eos_ids_all_end_a_complete_grammar(tokenizer):
    eos_ids = [tokenizer.eos_token_id, tokenizer._tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    compiler = GrammarCompiler(tokenizer, len(tokenizer._tokenizer), eos_ids)
    matcher = compiler.compile(json_schema_constraint({"enum": [1]}))
    assert matcher.consume(tokenizer.encode("1")[0])
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_mask(bitmask, 0)
    assert allowed_ids(bitmask, 0, compiler.vocab_size).tolist() == sorted(eos_ids)


def test_compiled_grammars_are_cached_lru(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer._tokenizer), max_num_cached=2)
    constraints = [json_schema_constraint({"type": "integer", "maximum": i}) for i in range(3)]
    first, second = compiler.compile(constraints[0]), compiler.compile(constraints[0])
    assert compiler.num_cached == 1
    # Copies of one compiled grammar do not share state.
    assert first.consume(tokenizer.encode("0")[0]) and not second.is_accepting
    compiler.compile(constraints[1])
    compiler.compile(constraints[0])  # now the most recent
    compiler.compile(constraints[2])  # evicts constraints[1]
    assert compiler.num_cached == 2
    assert list(compiler._compiled) == [constraints[0], constraints[2]]


def test_compile_error_is_a_constraint_error(compiler):
    # Valid Lark, but the special token does not exist in this tokenizer: only the compiler can tell.
    with pytest.raises(ConstraintError, match="no_such_token"):
        compiler.compile(Constraint(grammar='start: "a" <|no_such_token|>\n', kind="lark"))


def test_fill_masks_in_parallel_matches_one_by_one(compiler, tokenizer):
    constraints = [json_schema_constraint(SCHEMA), tool_call_constraint(
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "auto")]
    matchers = [compiler.compile(c) for c in constraints * 2]
    for matcher, text in zip(matchers, ['{"a": 1', "hello", '{"a": 12, "b": "', "x <tool_call>"]):
        for token in tokenizer.encode(text):
            assert matcher.consume(token)
    one_by_one, parallel = (allocate_bitmask(6, compiler.vocab_size) for _ in range(2))
    rows = [(m, row) for m, row in zip(matchers, (0, 2, 3, 5))]
    for matcher, row in rows:
        matcher.fill_mask(one_by_one, row)
    compiler.fill_masks(parallel, rows)
    np.testing.assert_array_equal(one_by_one, parallel)


def numpy_reference(logits: np.ndarray, bitmask: np.ndarray, rows: list[int]) -> np.ndarray:
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    width = logits.shape[1]
    if bits.shape[1] < width:
        bits = np.pad(bits, ((0, 0), (0, width - bits.shape[1])))
    out = logits.copy()
    for row in rows:
        out[row, ~bits[row, :width]] = -np.inf
    return out


@pytest.mark.parametrize("mask_width, logits_width", [(2055, 2055), (2048, 2055), (2100, 2055), (64, 64)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_apply_bitmask_matches_numpy(mask_width, logits_width, dtype):
    rng = np.random.default_rng(0)
    bitmask = allocate_bitmask(4, mask_width)
    bitmask[:] = rng.integers(-(2**31), 2**31, size=bitmask.shape, dtype=np.int64).astype(np.int32)
    logits = mx.array(rng.normal(size=(4, logits_width)).astype(np.float32)).astype(dtype)
    rows = [1, 3]
    out = apply_bitmask(logits, bitmask, rows)
    assert out.dtype == dtype and out.shape == logits.shape
    expected = numpy_reference(np.array(logits.astype(mx.float32)), bitmask, rows)
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)), expected)
    for row in (0, 2):  # unconstrained rows: bit for bit the same
        assert mx.array_equal(out[row], logits[row]).item()
    if logits_width > mask_width:  # ids past the mask are masked in constrained rows
        assert mx.all(mx.isinf(out[1, mask_width:])).item()


def test_apply_bitmask_with_no_rows_is_a_no_op():
    logits = mx.zeros((2, 10))
    assert apply_bitmask(logits, allocate_bitmask(2, 10), []) is logits


def test_print_mask_timings(compiler, tokenizer):
    """Not asserted (tests never assert on time): run with -s to see the numbers."""
    matcher = compiler.compile(json_schema_constraint(SCHEMA))
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    tokens = tokenizer.encode('{"a": 42, "b": "xyz"}')
    start = time.perf_counter()
    for token in tokens:
        matcher.fill_mask(bitmask, 0)
        assert matcher.consume(token)
    fill_us = (time.perf_counter() - start) / len(tokens) * 1e6

    batch, vocab = 16, 151936
    logits = mx.random.normal((batch, vocab))
    big = allocate_bitmask(batch, vocab)
    big[:] = np.random.default_rng(0).integers(-(2**31), 2**31, size=big.shape, dtype=np.int64).astype(np.int32)
    mx.eval(logits, apply_bitmask(logits, big, list(range(batch))))  # warm-up
    start = time.perf_counter()
    for _ in range(10):
        mx.eval(apply_bitmask(logits, big, list(range(batch))))
    apply_ms = (time.perf_counter() - start) / 10 * 1e3
    print(f"\nfill_mask: {fill_us:.0f} us/row/step (demo tokenizer, vocab {compiler.vocab_size}); "
          f"apply_bitmask B={batch} V={vocab}: {apply_ms:.1f} ms ({mx.default_device()})")


def test_an_llguidance_that_takes_one_eos_id_gets_the_tokenizers_own(tokenizer, monkeypatch):
    """Several EOS ids (Qwen3's generation config) on an llguidance that takes a single id (1.6): the
    compiler still builds, with the tokenizer's own EOS, instead of failing every constrained request."""
    import llguidance.hf

    real, seen = llguidance.hf.from_tokenizer, []

    def one_id_only(hf_tokenizer, n_vocab=None, eos_token=None):
        seen.append(eos_token)
        if isinstance(eos_token, list):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
        return real(hf_tokenizer, n_vocab=n_vocab, eos_token=eos_token)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", one_id_only)
    main = tokenizer._tokenizer.eos_token_id
    compiler = GrammarCompiler(tokenizer, len(tokenizer._tokenizer) + EXTRA_IDS, [main, main + 1])
    assert seen == [[main, main + 1], main]
    assert compiler.eos_token_ids == [main, main + 1]
    compiler.compile(json_schema_constraint({"type": "object"}))

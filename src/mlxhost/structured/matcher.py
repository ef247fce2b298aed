"""Engine side of constrained decoding: compiled grammars, per-row token bitmasks, masking logits.

One `GrammarCompiler` per served model, owned by the engine thread. Each constrained request gets a
`RowMatcher`; every step the runner fills that row of a shared int32 bitmask (llguidance's layout: bit
`t % 32` of word `t // 32` allows token t), applies the mask to the logits, samples, then feeds the
sampled token back with `consume`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np
import transformers

from mlxhost.structured.grammar import Constraint, ConstraintError


class RowMatcher:
    """The grammar state of one request. Not thread-safe: the engine thread alone drives it."""

    __slots__ = ("_matcher", "kind")

    def __init__(self, matcher: llguidance.LLMatcher, kind: str):
        self._matcher = matcher
        self.kind = kind

    def consume(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and `error` set) when the grammar rejects it."""
        return self._matcher.consume_token(token_id)

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`; once stopped (or failed) only EOS is allowed."""
        llguidance.numpy.fill_next_token_bitmask(self._matcher, bitmask, row)

    def rollback(self, num_tokens: int) -> bool:
        return self._matcher.rollback(num_tokens)

    @property
    def is_stopped(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete, or the matcher failed)."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match: EOS is allowed now."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class GrammarCompiler:
    """Compiles `Constraint`s against one model's tokenizer, with a bounded LRU of compiled grammars.

    `tokenizer` is mlx-lm's TokenizerWrapper (or a fast Hugging Face tokenizer); `vocab_size` is the
    width of the model's logits, which may exceed the tokenizer's: ids without a token are never allowed.
    """

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int] | None = None,
        max_num_cached: int = 64,
        num_threads: int | None = None,
    ):
        # mlx-lm's wrapper keeps the Hugging Face tokenizer in `_tokenizer`; a Hugging Face one keeps its
        # Rust backend there, which llguidance cannot take.
        fast = isinstance(tokenizer, transformers.PreTrainedTokenizerFast)
        hf_tokenizer = tokenizer if fast else getattr(tokenizer, "_tokenizer", tokenizer)
        if eos_token_ids is None:
            eos_token_ids = getattr(tokenizer, "eos_token_ids", None) or [hf_tokenizer.eos_token_id]
        self.eos_token_ids = sorted(set(eos_token_ids))
        # Slow (~1 s for a 150k vocabulary): once per model. Sized to cover both the logits and the
        # tokenizer, so one mask row spans every id either side knows.
        n_vocab = max(vocab_size, len(hf_tokenizer))
        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab,
                                                             eos_token=self.eos_token_ids)
        except TypeError:
            if not self.eos_token_ids:
                raise
            # Older llguidance (1.6) takes one EOS id, not a list: the tokenizer's own is the one a finished grammar
            # allows (the engine still stops on any of them).
            main = hf_tokenizer.eos_token_id
            one = main if main in self.eos_token_ids else self.eos_token_ids[0]
            self.ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=one)
        self.logits_vocab_size = vocab_size
        self.max_num_cached = max_num_cached
        # Constraint -> an unused matcher; requests get deep copies (about a microsecond) instead of
        # recompiling the grammar (milliseconds to seconds for large schemas).
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor(num_threads)

    @property
    def vocab_size(self) -> int:
        """Tokens per bitmask row: pass this to `allocate_bitmask`."""
        return self.ll_tokenizer.vocab_size

    def compile(self, constraint: Constraint) -> RowMatcher:
        """A fresh matcher for one request; raises ConstraintError if the grammar does not compile."""
        pristine = self._compiled.get(constraint)
        if pristine is None:
            pristine = llguidance.LLMatcher(self.ll_tokenizer, constraint.grammar, log_level=0)
            if pristine.is_error():
                raise ConstraintError(f"cannot compile the {constraint.kind} grammar: {pristine.get_error()}")
            self._compiled[constraint] = pristine
            if len(self._compiled) > self.max_num_cached:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(constraint)
        return RowMatcher(pristine.deep_copy(), constraint.kind)

    def fill_masks(self, bitmask: np.ndarray, rows: list[tuple[RowMatcher, int]]) -> None:
        """`fill_mask` for many rows at once, spread over llguidance's threads (the GIL is released)."""
        pairs = [(matcher._matcher, row) for matcher, row in rows]
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, pairs, bitmask)

    @property
    def num_cached(self) -> int:
        return len(self._compiled)


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """An all-allowed int32 bitmask of `num_rows` rows, in llguidance's packed layout."""
    return llguidance.numpy.allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask(logits: mx.array, bitmask: np.ndarray, rows: list[int]) -> mx.array:
    """Set the disallowed tokens of `rows` to -inf; row r of `logits` reads row r of `bitmask`.

    Plain MLX ops (shift/and/where, no custom kernel), so it runs on CPU, CUDA and Metal alike. Other rows
    come back bit-identical. Logits wider than the mask get their extra ids masked out in listed rows.
    The whole [B, V] mask is built every time, so the shapes never depend on which rows are constrained.
    """
    if not rows:
        return logits
    batch, width = logits.shape
    num_words = (width + 31) // 32
    # Packed words for every row: all ones for unconstrained rows (where() then keeps their logits).
    words = np.full((batch, num_words), -1, dtype=np.int32)
    num_known = min(num_words, bitmask.shape[1])
    words[rows, :num_known] = bitmask[rows, :num_known]
    words[rows, num_known:] = 0
    bit_values = mx.left_shift(mx.array(1, dtype=mx.int32), mx.arange(32, dtype=mx.int32))
    allowed = (mx.array(words)[:, :, None] & bit_values) != 0
    allowed = allowed.reshape(batch, num_words * 32)[:, :width]
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))

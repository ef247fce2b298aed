"""Reasoning parser: streamed over every split == split_reasoning == expected; tags never leak."""

import random
from types import SimpleNamespace

import pytest

from mlxhost.structured.reasoning import (
    StreamingReasoningParser,
    partial_tag_len,
    reasoning_tags_for,
    split_reasoning,
)

# (text, starts_in_reasoning, expected (reasoning, content))
CASES = [
    ("<think>\nPlan: add.\n</think>\n\n2 + 2 = 4", False, ("Plan: add.", "2 + 2 = 4")),
    ("\n<think>a < b </thin k</think>ok", False, ("a < b </thin k", "ok")),
    ("<think>\n\n</think>\n\nJust the answer.", False, ("", "Just the answer.")),
    ("No thinking here. <think>x</think>", False, ("", "No thinking here. <think>x</think>")),
    ("  <thinking> is a word", False, ("", "  <thinking> is a word")),
    ("<thi", False, ("", "<thi")),
    ("<think>cut short by max_tokens </thi", False, ("cut short by max_tokens </thi", "")),
    ("<think>still thinking\n", False, ("still thinking\n", "")),
    ("Plan: add.\n</think>\n\n4", True, ("Plan: add.", "4")),
    ("<think>\nrepeated tag</think>4", True, ("repeated tag", "4")),
    ("never closed <think>", True, ("never closed <think>", "")),
    ("</think>Answer </think> again", True, ("", "Answer </think> again")),
    ("", True, ("", "")),
    ("   ", False, ("", "   ")),
]


def splits(text, rng):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for _ in range(30):
        if len(text) > 1:
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
            yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("text,starts_in,expected", CASES)
def test_streaming_equals_split_over_splits(text, starts_in, expected):
    assert split_reasoning(text, starts_in_reasoning=starts_in) == expected
    for pieces in splits(text, random.Random(text)):
        parser = StreamingReasoningParser(starts_in_reasoning=starts_in)
        outputs = [parser.feed(piece) for piece in pieces] + [parser.finish()]
        reasoning = "".join(r for r, _ in outputs)
        content = "".join(c for _, c in outputs)
        assert (reasoning, content) == expected, pieces


def test_streams_as_soon_as_certain():
    parser = StreamingReasoningParser()
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>\nStep one") == ("Step one", "")
    assert parser.feed(" and two </th") == (" and two", "")  # " </th" may become the tag: held
    assert parser.feed("ink>\n\nFour") == ("", "Four")
    assert parser.feed(" <think>") == ("", " <think>")
    assert parser.finish() == ("", "")


def test_other_tags():
    text = "<|think:start|>hmm<|think:end|>yes"
    expected = ("hmm", "yes")
    assert split_reasoning(text, "<|think:start|>", "<|think:end|>") == expected
    parser = StreamingReasoningParser("<|think:start|>", "<|think:end|>")
    outputs = [parser.feed(c) for c in text] + [parser.finish()]
    assert ("".join(r for r, _ in outputs), "".join(c for _, c in outputs)) == expected
    with pytest.raises(ValueError):
        StreamingReasoningParser("", "</think>")


def test_partial_tag_len():
    assert partial_tag_len("abc </th", "</think>") == 4
    assert partial_tag_len("abc <", "</think>") == 1
    assert partial_tag_len("abc </think>", "</think>") == 0  # whole tags are found, not held
    assert partial_tag_len("", "</think>") == 0


def test_reasoning_tags_for_wrapper_like_and_vocab():
    wrapper = SimpleNamespace(has_thinking=True, think_start="<think>", think_end="</think>")
    assert reasoning_tags_for(wrapper) == ("<think>", "</think>")
    assert reasoning_tags_for(SimpleNamespace(has_thinking=False, think_start=None, think_end=None)) is None
    vocab_only = SimpleNamespace(get_vocab=lambda: {"<longcat_think>": 5, "</longcat_think>": 6})
    assert reasoning_tags_for(vocab_only) == ("<longcat_think>", "</longcat_think>")
    assert reasoning_tags_for(SimpleNamespace(get_vocab=lambda: {"a": 1})) is None
    assert reasoning_tags_for(object()) is None


def test_reasoning_tags_for_real_tokenizers(tmp_path):
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import AutoTokenizer

    from mlxhost.testing.demo import build_tokenizer

    build_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert reasoning_tags_for(hf) is None
    assert reasoning_tags_for(TokenizerWrapper(hf)) is None
    hf.add_tokens(["<think>", "</think>"], special_tokens=True)
    assert reasoning_tags_for(hf) == ("<think>", "</think>")
    assert reasoning_tags_for(TokenizerWrapper(hf)) == ("<think>", "</think>")

"""Tool-call and reasoning grammars over a tokenizer whose tags are single added tokens: the tag may come as
its token (what the model was trained to write) or spelled out in text, in every tool_choice mode."""

import re

import llguidance
import llguidance.hf
import llguidance.numpy
import pytest

from mlxhost.structured.grammar import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    json_schema_constraint,
    tag_token_ids,
    tool_call_constraint,
    with_reasoning_prefix,
)
from mlxhost.testing.tag_tokens import SPECIAL_TAGS, TEXT_TAGS

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False,
}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TAGS = TEXT_TAGS + SPECIAL_TAGS


@pytest.fixture(scope="module")
def ll(tagged_tokenizer):
    return llguidance.hf.from_tokenizer(tagged_tokenizer)


@pytest.fixture(scope="module")
def ids(tagged_tokenizer):
    return tag_token_ids(tagged_tokenizer, TAGS)


def native(tok, text: str) -> list[int]:
    """The tokenizer's own encoding: every tag is its added token."""
    return tok.encode(text, add_special_tokens=False)


def spelled(tok, text: str) -> list[int]:
    """The same text with every tag written in ordinary tokens (as a tokenizer without the tag would)."""
    out = []
    for piece in re.split("(" + "|".join(map(re.escape, TAGS)) + ")", text):
        parts = (piece[:1], piece[1:]) if piece in TAGS else (piece,)
        out += [t for p in parts if p for t in native(tok, p)]
    return out


def walk(ll, constraint, tokens):
    matcher = llguidance.LLMatcher(ll, constraint.grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for token in tokens:
        if not matcher.consume_token(token):
            break
    return matcher


def accepts(ll, constraint, tokens) -> bool:
    matcher = walk(ll, constraint, tokens)
    return not matcher.is_error() and matcher.is_accepting()


def allows(ll, matcher, token: int) -> bool:
    mask = llguidance.numpy.allocate_token_bitmask(1, ll.vocab_size)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    return bool((int(mask[0, token >> 5]) >> (token & 31)) & 1)


def test_tag_token_ids_finds_only_exact_single_tokens(tagged_tokenizer, ids):
    assert set(ids) == set(TAGS)
    assert all(tagged_tokenizer.decode([i]) == tag for tag, i in ids.items())
    assert tag_token_ids(tagged_tokenizer, ["<function=", "<tool", "", "tool_call"]) == {}


def test_plain_tokenizer_has_no_tag_tokens(tmp_path):
    from transformers import AutoTokenizer

    from mlxhost.testing.demo import build_tokenizer

    build_tokenizer(tmp_path)
    assert tag_token_ids(AutoTokenizer.from_pretrained(str(tmp_path)), TAGS) == {}


@pytest.mark.parametrize("mode", ["required", "named", "auto"])
def test_hermes_call_as_token_or_text(ll, tagged_tokenizer, ids, mode):
    c = tool_call_constraint([WEATHER], mode, HERMES, name="get_weather", tag_ids=ids)
    start = walk(ll, c, [])
    assert allows(ll, start, ids["<tool_call>"])  # the model's own way to open a call is never masked
    assert accepts(ll, c, native(tagged_tokenizer, CALL))
    assert accepts(ll, c, spelled(tagged_tokenizer, CALL))
    twice = CALL + "\n" + CALL
    assert accepts(ll, c, native(tagged_tokenizer, twice)) == (mode != "named")
    bad = native(tagged_tokenizer, CALL.replace("Paris", "1").replace('"1"', "1"))
    assert not accepts(ll, c, bad)


def test_auto_opens_a_call_with_the_token_after_text(ll, tagged_tokenizer, ids):
    c = tool_call_constraint([WEATHER], "auto", HERMES, tag_ids=ids)
    after_text = walk(ll, c, native(tagged_tokenizer, "Let me check the weather.\n"))
    assert allows(ll, after_text, ids["<tool_call>"]) and allows(ll, after_text, ll.eos_token)
    assert accepts(ll, c, native(tagged_tokenizer, "Let me check.\n" + CALL))
    assert accepts(ll, c, native(tagged_tokenizer, "No call needed."))
    # Once opened (as the token), the call must follow the tool's schema.
    assert not accepts(ll, c, native(tagged_tokenizer, 'Hm <tool_call>\n{"name": "other"'))
    assert walk(ll, c, native(tagged_tokenizer, 'Hm <tool_call>\n{"name": "other"')).is_error()


def test_a_forced_call_cannot_be_closed_early_or_by_another_token(ll, tagged_tokenizer, ids):
    c = tool_call_constraint([WEATHER], "required", HERMES, tag_ids=ids)
    inside = walk(ll, c, native(tagged_tokenizer, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'))
    assert not allows(ll, inside, ids["</tool_call>"]) and not allows(ll, inside, ll.eos_token)
    assert not allows(ll, inside, ids["<think>"])


def test_mistral_special_tag(ll, tagged_tokenizer, ids):
    calls = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    for mode in ("required", "auto"):
        c = tool_call_constraint([WEATHER], mode, MISTRAL, tag_ids=ids)
        assert allows(ll, walk(ll, c, []), ids["[TOOL_CALLS]"]), mode
        assert accepts(ll, c, native(tagged_tokenizer, calls)) and accepts(ll, c, spelled(tagged_tokenizer, calls))
    auto = tool_call_constraint([WEATHER], "auto", MISTRAL, tag_ids=ids)
    assert accepts(ll, auto, native(tagged_tokenizer, "Sure. " + calls))


def test_llama3_python_tag_is_optional(ll, tagged_tokenizer, ids):
    call = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    for mode in ("required", "auto"):
        c = tool_call_constraint([WEATHER], mode, LLAMA3_JSON, tag_ids=ids)
        assert accepts(ll, c, native(tagged_tokenizer, call)), mode
        assert accepts(ll, c, native(tagged_tokenizer, "<|python_tag|>" + call)), mode
    plain = tool_call_constraint([WEATHER], "required", LLAMA3_JSON)  # a tokenizer without the token
    assert not allows(ll, walk(ll, plain, []), ids["<|python_tag|>"])


@pytest.mark.parametrize("starts_in", [False, True])
def test_reasoning_tags_as_tokens(ll, tagged_tokenizer, ids, starts_in):
    inner = json_schema_constraint({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    c = with_reasoning_prefix(inner, starts_in_reasoning=starts_in, tag_ids=ids)
    reply = ("" if starts_in else "<think>") + 'hmm {"a": "no"}</think>\n\n{"a": 1}'
    assert accepts(ll, c, native(tagged_tokenizer, reply))
    assert accepts(ll, c, spelled(tagged_tokenizer, reply))
    assert not accepts(ll, c, native(tagged_tokenizer, reply.replace('{"a": 1}', '{"a": "x"}')))
    if not starts_in:
        assert allows(ll, walk(ll, c, []), ids["<think>"])
        assert accepts(ll, c, native(tagged_tokenizer, '{"a": 2}'))  # no reasoning at all


def test_reasoning_then_tool_call_all_tokens(ll, tagged_tokenizer, ids):
    c = with_reasoning_prefix(tool_call_constraint([WEATHER], "required", HERMES, tag_ids=ids),
                              starts_in_reasoning=True, tag_ids=ids)
    assert accepts(ll, c, native(tagged_tokenizer, "Call it.</think>\n\n" + CALL))


def test_special_tool_tags_are_written_out_by_the_detokenizer(tagged_tokenizer):
    """`[TOOL_CALLS]` and `<|python_tag|>` are special tokens; the parsers need them in the text. Other
    special tokens (the end of turn) stay hidden."""
    from mlxhost.engine.detokenizer import make_detokenizer_factory

    text = 'a[TOOL_CALLS][{"name": "f"}]<|python_tag|>{}<|im_end|>'
    detok = make_detokenizer_factory(tagged_tokenizer)([])
    out = "".join(detok.add(t) for t in native(tagged_tokenizer, text)) + detok.flush()
    assert out == text.replace("<|im_end|>", "")

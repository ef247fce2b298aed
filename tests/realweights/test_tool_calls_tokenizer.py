"""Tool-call grammars and parsing over the real Qwen2.5 tokenizer (read from the Qwen2.5-Coder GGUF's
metadata; no weights are loaded). In it `<tool_call>` is one added token, 151657, not marked special: the
grammar must let the model open a call with it in every tool_choice mode, and the text that comes out of
the detokenizer must parse back into the call."""

from __future__ import annotations

import json

import pytest

from mlxhost.engine.detokenizer import make_detokenizer_factory
from mlxhost.serving.chat_output import OutputSpec, collect
from mlxhost.structured.grammar import HERMES, tag_token_ids, tool_call_constraint
from mlxhost.structured.matcher import GrammarCompiler, allocate_bitmask

pytestmark = pytest.mark.needs("qwen25-coder")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LOGITS_WIDTH = 151936  # Qwen2.5's embedding rows: wider than its 151,665 tokens


@pytest.fixture(scope="module")
def qwen25_tokenizer(qwen25_coder_gguf, tmp_path_factory):
    from transformers import AutoTokenizer

    from mlxhost.models.gguf.reader import read_header
    from mlxhost.models.gguf.tokenizer import write_tokenizer

    out = tmp_path_factory.mktemp("qwen25-tokenizer")
    write_tokenizer(read_header(qwen25_coder_gguf), out, 32768)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def compiler(qwen25_tokenizer):
    return GrammarCompiler(qwen25_tokenizer, LOGITS_WIDTH, [qwen25_tokenizer.convert_tokens_to_ids("<|im_end|>")])


def allowed(compiler, matcher, token: int) -> bool:
    mask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_mask(mask, 0)
    return bool((int(mask[0, token >> 5]) >> (token & 31)) & 1)


def walk(compiler, constraint, tokens):
    matcher = compiler.compile(constraint)
    for token in tokens:
        assert matcher.consume(token), matcher.error
    return matcher


def test_qwen_tags_are_single_added_tokens(qwen25_tokenizer):
    ids = tag_token_ids(qwen25_tokenizer, HERMES.tags)
    assert ids == {"<tool_call>": 151657, "</tool_call>": 151658}
    assert qwen25_tokenizer.encode(CALL)[0] == 151657 and qwen25_tokenizer.encode(CALL)[-1] == 151658


@pytest.mark.parametrize("mode", ["required", "named", "auto"])
def test_every_mode_opens_and_closes_a_call_with_the_tokens(qwen25_tokenizer, compiler, mode):
    ids = tag_token_ids(qwen25_tokenizer, HERMES.tags)
    c = tool_call_constraint(TOOLS, mode, HERMES, name="get_weather", parallel=False, tag_ids=ids)
    assert allowed(compiler, compiler.compile(c), 151657)
    done = walk(compiler, c, qwen25_tokenizer.encode(CALL))
    assert done.is_accepting and done.is_stopped and allowed(compiler, done, compiler.eos_token_ids[0])
    inside = walk(compiler, c, qwen25_tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "P'))
    assert not allowed(compiler, inside, 151658) and not allowed(compiler, inside, 151657)


def test_auto_lets_text_come_first_then_the_token(qwen25_tokenizer, compiler):
    ids = tag_token_ids(qwen25_tokenizer, HERMES.tags)
    c = tool_call_constraint(TOOLS, "auto", HERMES, tag_ids=ids)
    after = walk(compiler, c, qwen25_tokenizer.encode("I'll look that up.\n"))
    assert allowed(compiler, after, 151657) and allowed(compiler, after, compiler.eos_token_ids[0])
    assert walk(compiler, c, qwen25_tokenizer.encode("I'll look that up.\n" + CALL)).is_accepting


def test_parallel_calls_and_a_wrong_name_is_refused(qwen25_tokenizer, compiler):
    ids = tag_token_ids(qwen25_tokenizer, HERMES.tags)
    c = tool_call_constraint(TOOLS, "required", HERMES, tag_ids=ids)
    two = CALL + "\n" + '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
    assert walk(compiler, c, qwen25_tokenizer.encode(two)).is_accepting
    matcher = compiler.compile(c)
    bad = qwen25_tokenizer.encode('<tool_call>\n{"name": "get_news"')
    assert not all(matcher.consume(t) for t in bad) and matcher.error


def test_the_detokenized_tokens_parse_back_into_the_call(qwen25_tokenizer):
    """Ids as the model writes them -> the engine's detokenizer -> the reply parser every dialect uses."""
    ids = qwen25_tokenizer.encode("Checking.\n" + CALL)
    detok = make_detokenizer_factory(qwen25_tokenizer)(qwen25_tokenizer.encode("<|im_start|>assistant\n"))
    text = "".join(detok.add(t) for t in ids) + detok.flush()
    assert text == "Checking.\n" + CALL
    reply = collect(OutputSpec(tool_format="hermes", tools=TOOLS), text)
    assert reply.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]

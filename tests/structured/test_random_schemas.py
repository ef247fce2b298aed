"""Masks make a random model write valid output: 100 random JSON schemas and the tool-call modes.

A random-weight model never writes JSON by itself, so every parse and validation below is the masks'
doing. Schemas bound every string, array, object and number (a fraction step) so outputs finish well
within 256 tokens; a run that hits the cap fails the test.
"""

import json
import random
import re

import jsonschema
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxhost.structured.grammar import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    json_schema_constraint,
    tool_call_constraint,
)
from mlxhost.structured.matcher import GrammarCompiler, allocate_bitmask, apply_bitmask
from mlxhost.testing.demo import ensure_demo_model

MAX_TOKENS = 256
NUM_SCHEMAS = 100
WORDS = ("id", "name", "tags", "size", "kind", "city", "score", "items", "meta", "ok", "level", "note")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    model, tokenizer = mlx_lm.load(str(ensure_demo_model(tmp_path_factory.mktemp("structured") / "m")))
    compiler = GrammarCompiler(tokenizer, model.args.vocab_size, tokenizer.eos_token_ids)
    messages = [{"role": "user", "content": "Answer in JSON."}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return model, tokenizer, compiler, prompt


def generate(loaded, matcher, seed, forced_text=""):
    """Sample at temperature 1 under the mask until EOS; returns (text, hit_cap)."""
    model, tokenizer, compiler, prompt = loaded
    eos_ids = set(compiler.eos_token_ids)
    forced = tokenizer.encode(forced_text) if forced_text else []
    for token in forced:  # as if the model had written them
        assert matcher.consume(token), matcher.error
    cache = make_prompt_cache(model)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    key = mx.random.key(seed)
    logits = model(mx.array([prompt + forced]), cache=cache)[:, -1, :]
    out = list(forced)
    for _ in range(MAX_TOKENS):
        mx.async_eval(logits)  # the forward runs while llguidance computes this step's mask
        matcher.fill_mask(bitmask, 0)
        key, sub = mx.random.split(key)
        token = mx.random.categorical(apply_bitmask(logits, bitmask, [0]), key=sub).item()
        if token in eos_ids:
            return tokenizer.decode(out), False
        assert matcher.consume(token), matcher.error
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return tokenizer.decode(out), True


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "pattern", "enum", "integer", "number", "boolean", "anyOf"]
    if depth < 3:
        kinds += ["object", "object", "array"]
    # The top level is always a container, so every schema nests something.
    kind = rng.choice(kinds) if depth else rng.choice(["object", "object", "array"])
    if kind == "object":
        names = rng.sample(WORDS, rng.randint(1, 4))
        return {
            "type": "object",
            "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.6],
            "additionalProperties": False,
        }
    if kind == "array":
        lo = rng.randint(0, 2)
        items = random_schema(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    if kind == "string":
        bounds = {"maxLength": rng.randint(1, 8)} | ({"minLength": 1} if rng.random() < 0.5 else {})
        return {"type": "string", **bounds}
    if kind == "pattern":
        lo = rng.randint(1, 3)
        patterns = [f"^[a-z]{{{lo},{lo + 3}}}$", f"^[A-Z][0-9]{{{lo}}}$", "^(yes|no)-[0-9]{2}$"]
        return {"type": "string", "pattern": rng.choice(patterns)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True], rng.randint(1, 4))}
    if kind == "integer":
        lo = rng.randint(-100, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        # Without multipleOf a number may have any number of fraction digits, and a random model keeps
        # writing them; binary fractions keep the steps exact for jsonschema's float check too.
        lo = rng.choice([-10, 0, 0.5, 3])
        step = rng.choice([0.5, 0.25, 0.125])
        return {"type": "number", "minimum": lo, "maximum": lo + rng.choice([1, 10, 100]), "multipleOf": step}
    if kind == "boolean":
        return {"type": "boolean"}
    return {"anyOf": [random_schema(rng, 2), random_schema(rng, 2)]}


def test_random_schemas_parse_and_validate(loaded):
    rng = random.Random(1234)
    _, _, compiler, _ = loaded
    failures, lengths = [], []
    for i in range(NUM_SCHEMAS):
        schema = random_schema(rng)
        text, hit_cap = generate(loaded, compiler.compile(json_schema_constraint(schema)), seed=i)
        lengths.append(len(text))
        try:
            assert not hit_cap, f"hit the {MAX_TOKENS}-token cap"
            jsonschema.validate(json.loads(text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"#{i} {json.dumps(schema)}\n  -> {text!r}\n  {type(e).__name__}: {e}")
    print(f"\noutput chars: max {max(lengths)}, mean {sum(lengths) / len(lengths):.0f}")
    assert not failures, "\n".join(failures)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
        "additionalProperties": False,
    }}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1000}, "b": {"$ref": "#/$defs/small"}},
        "required": ["a", "b"],
        "additionalProperties": False,
        "$defs": {"small": {"type": "integer", "minimum": -50, "maximum": 50}},
    }}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def parse_calls(text: str, fmt) -> list[dict]:
    """Read calls back the way a tool parser would; raises if the text is not well-formed."""
    if fmt is HERMES:
        block = r"<tool_call>\n.*?\n</tool_call>"
        assert re.fullmatch(rf"{block}(?:\n{block})*", text, re.S), f"not Hermes tool calls: {text!r}"
        return [json.loads(body) for body in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)]
    if fmt is MISTRAL:
        assert text.startswith("[TOOL_CALLS]"), text
        return json.loads(text[len("[TOOL_CALLS]"):])
    calls, decoder, rest = [], json.JSONDecoder(), text
    while rest:
        call, end = decoder.raw_decode(rest)
        calls.append(call)
        rest = rest[end:].removeprefix("; ")
    return calls


def check_calls(calls: list[dict], key: str = "arguments") -> None:
    assert calls
    for call in calls:
        assert set(call) == {"name", key}
        jsonschema.validate(call[key], SCHEMAS[call["name"]])


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=["hermes", "llama3", "mistral"])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls(loaded, fmt, parallel):
    compiler = loaded[2]
    constraint = tool_call_constraint(TOOLS, "required", fmt, parallel=parallel)
    for seed in range(4):
        text, hit_cap = generate(loaded, compiler.compile(constraint), seed=seed)
        assert not hit_cap, text
        calls = parse_calls(text, fmt)
        check_calls(calls, fmt.arguments_key)
        if not parallel:
            assert len(calls) == 1


def test_named_tool_call(loaded):
    compiler = loaded[2]
    constraint = tool_call_constraint(TOOLS, "named", HERMES, "add")
    for seed in range(4):
        text, hit_cap = generate(loaded, compiler.compile(constraint), seed)
        assert not hit_cap, text
        calls = parse_calls(text, HERMES)
        check_calls(calls)
        assert [c["name"] for c in calls] == ["add"]


def test_auto_tool_call_once_the_tag_is_written(loaded):
    # The random model never writes the tag by itself: write it for it, then the grammar must hold.
    compiler = loaded[2]
    constraint = tool_call_constraint(TOOLS, "auto", HERMES)
    for seed in range(4):
        matcher = compiler.compile(constraint)
        text, hit_cap = generate(loaded, matcher, seed, forced_text="Let me look. <tool_call>")
        assert not hit_cap, text
        prefix, sep, calls_text = text.partition("<tool_call>")
        assert prefix == "Let me look. "
        check_calls(parse_calls(sep + calls_text, HERMES))

"""The HTTP layer without a server or a model: request schemas, request building, error and response shapes."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from mlxhost.engine.request import RequestOutput, TokenLogprob
from mlxhost.frontends.common.errors import APIError, error_body
from mlxhost.frontends.common.sse import SSE_DONE, sse
from mlxhost.frontends.openai.render import CompletionBuilder, completion_usage
from mlxhost.serving.model import ServedModel
from mlxhost.serving.prepare import make_request
from mlxhost.serving.schemas import MAX_STOP_STRINGS, ChatCompletionRequest, ChatMessage, CompletionRequest

VOCAB = 256


class ByteTokenizer:
    """One id per byte of the text; an optional chat template that just joins the contents."""

    def __init__(self, chat_template: str | None = None) -> None:
        self.chat_template = chat_template
        self.rendered: list = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, tools=None):
        self.rendered.append(messages)
        text = "|".join(m["content"] for m in messages) + ">"
        return self.encode(text) if tokenize else text


def served(tokenizer=None, max_model_len=64, default_max_tokens=16) -> ServedModel:
    return ServedModel(name="tiny", aliases=frozenset({"/models/tiny", "tiny-folder"}),
                       tokenizer=tokenizer or ByteTokenizer(), max_model_len=max_model_len, vocab_size=VOCAB,
                       eos_token_ids=frozenset({0}), default_max_tokens=default_max_tokens, created=0)


def chat_body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw})


def comp_body(**kw) -> CompletionRequest:
    return CompletionRequest(**{"model": "tiny", "prompt": "hello", **kw})


def api_error(fn) -> APIError:
    with pytest.raises(APIError) as exc:
        fn()
    return exc.value


# -- schemas -----------------------------------------------------------------------------------------


def test_chat_message_text():
    assert ChatMessage(role="user", content="a").text() == "a"
    assert ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]).text() == "ab"
    assert ChatMessage(role="assistant", content=None).text() == ""


@pytest.mark.parametrize("bad", [
    {"messages": []},
    {"messages": [{"role": "robot", "content": "x"}]},
    {"temperature": 2.5}, {"top_p": 0}, {"max_tokens": 0}, {"n": 0}, {"top_logprobs": 21},
    {"presence_penalty": -2.5}, {"logit_bias": {"1": 101}}, {"seed": 2**64}, {"seed": -(2**63) - 1},
    {"stop": ["s"] * (MAX_STOP_STRINGS + 1)},
])
def test_chat_schema_rejects(bad):
    with pytest.raises(ValidationError):
        chat_body(**bad)


def test_chat_schema_defaults_and_properties():
    body = chat_body()
    assert (body.temperature, body.top_p, body.n, body.stream) == (1.0, 1.0, 1, False)
    assert body.stop_list == () and body.include_usage is False
    assert body.requested_max_tokens is None and body.num_top_logprobs == 0
    assert chat_body(stop="x").stop_list == ("x",)
    assert chat_body(stop=["s"] * MAX_STOP_STRINGS).stop_list == ("s",) * MAX_STOP_STRINGS
    assert chat_body(stream_options={"include_usage": True}).include_usage
    assert chat_body(max_tokens=5, max_completion_tokens=7).requested_max_tokens == 7
    assert chat_body(max_tokens=5).requested_max_tokens == 5
    assert chat_body(top_logprobs=3).num_top_logprobs == 0  # only with logprobs=True
    assert chat_body(logprobs=True, top_logprobs=3).num_top_logprobs == 3


def test_completion_schema_prompt_forms():
    for prompt in ("text", ["text"], [1, 2, 3], [[1, 2, 3]]):
        assert comp_body(prompt=prompt).prompt == prompt
    with pytest.raises(ValidationError):
        comp_body(prompt=5)
    assert comp_body().num_top_logprobs == 0
    assert comp_body(logprobs=4).num_top_logprobs == 4


# -- make_request ------------------------------------------------------------------------------------


def test_completion_request_is_tokenized_and_limited():
    req = make_request(served(), comp_body(prompt="hello", max_tokens=5, stop=["a", "b"], seed=3))
    assert req.prompt_token_ids == list(b"hello")
    assert req.request_id.startswith("cmpl-")
    sp = req.sampling
    assert (sp.max_tokens, sp.stop, sp.seed, sp.logprobs, sp.top_logprobs) == (5, ("a", "b"), 3, False, 0)
    assert req.eos_token_ids == frozenset({0})


def test_prompt_forms_give_the_same_ids():
    model = served()
    ids = [make_request(model, comp_body(prompt=p, max_tokens=1)).prompt_token_ids
           for p in ("hi", ["hi"], [104, 105], [[104, 105]])]
    assert ids == [[104, 105]] * 4


def test_chat_without_template_is_a_plain_transcript():
    req = make_request(served(), chat_body(max_tokens=2))
    assert bytes(req.prompt_token_ids).decode() == "user: hi\nassistant:"
    assert req.request_id.startswith("chatcmpl-")


def test_chat_uses_the_template():
    tok = ByteTokenizer(chat_template="anything")
    body = chat_body(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "u"}]}],
                     max_tokens=2)
    req = make_request(served(tok), body)
    assert tok.rendered == [[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]]
    assert bytes(req.prompt_token_ids).decode() == "s|u>"


def test_chat_template_failure_is_a_400():
    class Rejecting(ByteTokenizer):
        def apply_chat_template(self, *a, **kw):
            raise ValueError("roles must alternate")

    err = api_error(lambda: make_request(served(Rejecting("t")), chat_body()))
    assert err.status == 400 and "roles must alternate" in err.message and err.param == "messages"


def test_default_max_tokens_is_capped_by_the_context():
    assert make_request(served(default_max_tokens=16), comp_body(prompt="hello")).sampling.max_tokens == 16
    # 64 - 60 = 4 positions left.
    assert make_request(served(default_max_tokens=16), comp_body(prompt="x" * 60)).sampling.max_tokens == 4


def test_context_errors_name_the_numbers():
    err = api_error(lambda: make_request(served(), comp_body(prompt="x" * 60, max_tokens=5)))
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "max_tokens")
    assert all(n in err.message for n in ("64", "60", "5", "65"))
    err = api_error(lambda: make_request(served(), comp_body(prompt="x" * 64)))
    assert err.code == "context_length_exceeded" and err.param == "prompt"
    err = api_error(lambda: make_request(served(), chat_body(messages=[{"role": "user", "content": "x" * 80}])))
    assert err.param == "messages"
    assert make_request(served(), comp_body(prompt="x" * 60, max_tokens=4)).sampling.max_tokens == 4


@pytest.mark.parametrize("body, status, param", [
    (comp_body(model="other"), 404, "model"),
    (comp_body(echo=True, suffix="}"), 400, "echo"),
    (comp_body(prompt=""), 400, "prompt"),
    (comp_body(prompt=[[1], [2]]), 400, "prompt"),
    (comp_body(prompt=[VOCAB]), 400, "prompt"),
    (comp_body(prompt=[-1]), 400, "prompt"),
    (comp_body(logit_bias={"x": 1}), 400, "logit_bias"),
    (comp_body(logit_bias={str(VOCAB): 1}), 400, "logit_bias"),
    (comp_body(prompt="a\ud800"), 400, "prompt"),
])
def test_make_request_errors(body, status, param):
    class Strict(ByteTokenizer):
        def encode(self, text):
            return list(text.encode("utf-8"))  # raises on a lone surrogate, like the Rust tokenizers

    err = api_error(lambda: make_request(served(Strict()), body))
    assert (err.status, err.param) == (status, param)


def test_aliases_are_accepted():
    for name in ("tiny", "/models/tiny", "tiny-folder"):
        make_request(served(), comp_body(model=name, max_tokens=1))


def test_sampling_fields_are_passed_through():
    body = comp_body(max_tokens=3, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, presence_penalty=0.5,
                     frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={"65": -100, "66": 5.5},
                     ignore_eos=True, logprobs=0)
    sp = make_request(served(), body).sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (0.5, 0.9, 7, 0.1)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.2)
    assert sp.logit_bias == ((65, -100.0), (66, 5.5))
    assert sp.ignore_eos and sp.needs_processors
    assert sp.logprobs is True and sp.top_logprobs == 0  # logprobs=0: the chosen token only


@pytest.mark.parametrize("value, expected", [(None, True), (True, True), ("on", True), ("auto", True),
                                             (False, False), ("off", False)])
def test_a_request_may_opt_out_of_speculation(value, expected):
    body = chat_body(max_tokens=1) if value is None else chat_body(max_tokens=1, speculative=value)
    assert make_request(served(), body).sampling.speculative is expected


def test_chat_logprob_settings():
    sp = make_request(served(), chat_body(max_tokens=1, logprobs=True, top_logprobs=4)).sampling
    assert (sp.logprobs, sp.top_logprobs) == (True, 4)
    sp = make_request(served(), chat_body(max_tokens=1, top_logprobs=4)).sampling
    assert (sp.logprobs, sp.top_logprobs) == (False, 0)


@pytest.mark.parametrize("top_k, expected", [(0, 0), (-1, 0), (1, 1), (VOCAB - 1, VOCAB - 1), (VOCAB, 0), (10**6, 0)])
def test_top_k_at_or_beyond_the_vocabulary_means_off(top_k, expected):
    assert make_request(served(), comp_body(max_tokens=1, top_k=top_k)).sampling.top_k == expected


@pytest.mark.parametrize("seed, expected", [(None, None), (0, 0), (5, 5), (-1, 2**64 - 1), (2**64 - 1, 2**64 - 1),
                                            (-(2**63), 2**63)])
def test_seed_maps_onto_uint64(seed, expected):
    assert make_request(served(), comp_body(max_tokens=1, seed=seed)).sampling.seed == expected


# -- errors and responses ----------------------------------------------------------------------------


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (404, "not_found_error"),
                                          (405, "invalid_request_error"), (429, "rate_limit_error"),
                                          (500, "server_error"), (503, "service_unavailable")])
def test_error_body_shape(status, kind):
    assert error_body(status, "m", "p", "c") == {"error": {"message": "m", "type": kind, "param": "p", "code": "c"}}


def out(text="", finish=None, lps=None, n_out=1) -> RequestOutput:
    return RequestOutput("id", [1], text, num_prompt_tokens=3, num_output_tokens=n_out, finish_reason=finish, logprobs=lps)


def parse(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event[6:])


def test_full_responses():
    chat = CompletionBuilder("id", "tiny", True, ByteTokenizer()).full("hi", "stop", 3, 2, None)
    assert chat["object"] == "chat.completion"
    assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
                                "logprobs": None}]
    assert chat["usage"] == completion_usage(3, 2) == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                            "prompt_tokens_details": {"cached_tokens": 0}}
    comp = CompletionBuilder("id", "tiny", False, ByteTokenizer()).full("hi", "length", 3, 2, None)
    assert comp["object"] == "text_completion" and comp["choices"][0]["text"] == "hi"


def test_stream_chunks():
    chat = CompletionBuilder("id", "tiny", True, ByteTokenizer())
    assert parse(chat.first_chunk())["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat.chunk(out("")) is None  # nothing to say: no event
    assert parse(chat.chunk(out("a")))["choices"][0]["delta"] == {"content": "a"}
    last = parse(chat.chunk(out("", finish="stop")))["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "stop"
    u = parse(chat.usage_chunk(3, 4))
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 7 and u["object"] == "chat.completion.chunk"
    comp = CompletionBuilder("id", "tiny", False, ByteTokenizer())
    assert parse(comp.first_chunk())["choices"][0]["text"] == ""  # at once: the first bytes clients count
    assert parse(chat.keep_alive())["choices"][0]["delta"] == {} and parse(comp.keep_alive())["choices"][0]["text"] == ""
    assert parse(comp.chunk(out("b")))["choices"][0]["text"] == "b"
    assert SSE_DONE == "data: [DONE]\n\n"
    assert parse(sse({"x": "é"})) == {"x": "é"}


@pytest.mark.parametrize("chat", [True, False])
def test_text_chunks_from_the_template_equal_the_whole_object(chat):
    from mlxhost.serving.chat_output import OutputSpec

    spec = OutputSpec(reasoning_tags=("<think>", "</think>"), starts_in_reasoning=True) if chat else None
    builder = CompletionBuilder("id", "tiny", chat, ByteTokenizer(), output=spec)
    texts = ['a "quoted" \\ line\n', "é ✓ 中", "\x00\t\u2028", "<"]
    for key in (["content", "reasoning_content"] if chat else [None]):
        for text in texts:
            whole = sse(builder._chunk({key: text} if chat else text, None))
            assert builder._text_sse(key, text) == whole
    if chat:  # through the reasoning parser: a reasoning delta, then content, each one templated chunk
        chunks = [builder.chunk(out(t)) for t in ("why", "</think>", "so")]
        assert chunks[1] is None  # the tag alone: nothing to say
        assert chunks[0] == sse(builder._chunk({"reasoning_content": "why"}, None))
        assert chunks[2] == sse(builder._chunk({"content": "so"}, None))


def test_logprob_shapes():
    entries = [TokenLogprob(65, -0.5, ((65, -0.5), (66, -1.5))), TokenLogprob(67, -0.25, ((67, -0.25), (68, -2.0)))]
    chat = CompletionBuilder("id", "tiny", True, ByteTokenizer()).logprobs(entries)
    first = chat["content"][0]
    assert first == {"token": "A", "logprob": -0.5, "bytes": [65],
                     "top_logprobs": [{"token": "A", "logprob": -0.5, "bytes": [65]},
                                      {"token": "B", "logprob": -1.5, "bytes": [66]}]}
    comp = CompletionBuilder("id", "tiny", False, ByteTokenizer()).logprobs(entries)
    assert comp["tokens"] == ["A", "C"]
    assert comp["token_logprobs"] == [-0.5, -0.25]
    assert comp["top_logprobs"] == [{"A": -0.5, "B": -1.5}, {"C": -0.25, "D": -2.0}]
    # A chunk that carries only logprobs (the token completed no character yet) is still sent.
    chunk = CompletionBuilder("id", "tiny", True, ByteTokenizer()).chunk(out("", lps=entries[:1]))
    assert parse(chunk)["choices"][0]["logprobs"]["content"][0]["token"] == "A"

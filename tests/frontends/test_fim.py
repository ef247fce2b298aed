"""Fill-in-the-middle without a model: the markers read off a vocabulary, and `suffix` on OpenAI's
/v1/completions and Ollama's /api/generate becoming one plain completion of the marked-up prompt that also
ends at the family's end tokens; models without the markers, token-id prompts, and raw prompts refused."""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from mlxhost.frontends.app import create_app
from mlxhost.serving.fim import FORMATS, fim_for
from tests.frontends.fake_models import NAME, FakeModels


class _Vocab:
    def __init__(self, tokens):
        self._vocab = {t: i for i, t in enumerate(tokens)}

    def get_vocab(self):
        return dict(self._vocab)


def test_the_markers_are_read_off_the_vocabulary():
    qwen = fim_for(_Vocab(["a", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|endoftext|>", "<|im_end|>"]))
    assert qwen.prompt("def f(", "):\n") == "<|fim_prefix|>def f(<|fim_suffix|>):\n<|fim_middle|>"
    assert qwen.stop_ids == {1, 2, 3, 4}  # the markers and the ends it has; not the chat turn's end
    star = fim_for(_Vocab(["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>"]))
    assert star.prompt("a", "b") == "<fim_prefix>a<fim_suffix>b<fim_middle>" and star.stop_ids == {0, 1, 2, 3}
    deepseek = fim_for(_Vocab(["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "<|EOT|>"]))
    assert deepseek.prompt("a", "b") == "<｜fim▁begin｜>a<｜fim▁hole｜>b<｜fim▁end｜>"
    assert fim_for(_Vocab(["<|fim_prefix|>", "<|fim_suffix|>"])) is None  # all three markers or none
    assert fim_for(object()) is None
    assert len({f.prefix for f in FORMATS}) == len(FORMATS)


def test_auto_takes_the_markers_only_from_a_model_named_as_a_code_model():
    # Every Qwen2.5/Qwen3 and Gemma tokenizer carries its code siblings' markers.
    vocab = _Vocab(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])
    assert fim_for(vocab, ["Qwen2.5-Coder-7B-Instruct", "qwen2"], "auto") is not None
    assert fim_for(vocab, ["starcoder2-3b"], "auto") is not None and fim_for(vocab, ["codegemma-7b"], "auto")
    assert fim_for(vocab, ["Qwen3-8B", "qwen3", "Qwen3ForCausalLM"], "auto") is None
    assert fim_for(vocab, ["all-MiniLM-L6-v2", "BertEncoder"], "auto") is None  # "encoder" is no code word
    assert fim_for(vocab, ["Qwen3-8B"], "on") is not None and fim_for(vocab, ["Qwen2.5-Coder"], "off") is None

    class Broken:
        def get_vocab(self):
            raise ValueError("no vocabulary here")

    assert fim_for(Broken(), ["coder"], "on") is None  # a model still loads, without fill-in-the-middle


class _FimTokenizer:
    """The fake's byte tokenizer, with the Qwen markers and <|endoftext|> as single ids above the bytes."""

    MARKERS = {"<|fim_prefix|>": 300, "<|fim_suffix|>": 301, "<|fim_middle|>": 302, "<|endoftext|>": 303}
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        while text:
            marker = next((m for m in self.MARKERS if text.startswith(m)), None)
            if marker:
                ids.append(self.MARKERS[marker])
                text = text[len(marker):]
            else:
                ids.extend(text[0].encode("utf-8"))
                text = text[1:]
        return ids

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def get_vocab(self) -> dict:
        return dict(self.MARKERS)


@pytest.fixture
def app():
    models = FakeModels()
    tokenizer = _FimTokenizer()
    models.tokenizer = tokenizer
    models.served = dataclasses.replace(models.served, tokenizer=tokenizer, vocab_size=304, fim=fim_for(tokenizer))
    return TestClient(create_app(models)), models


def _marked(prefix: str, suffix: str) -> list[int]:
    return [300, *prefix.encode(), 301, *suffix.encode(), 302]


def test_openai_suffix_is_a_completion_of_the_marked_prompt(app):
    client, models = app
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "def add(a, b):\n    ",
                                             "suffix": "\n\nprint(add(1, 2))", "max_tokens": 8})
    assert r.status_code == 200, r.text
    request = models.engine.requests[-1]
    assert request.prompt_token_ids == _marked("def add(a, b):\n    ", "\n\nprint(add(1, 2))")
    assert request.eos_token_ids == {0, 300, 301, 302, 303}  # the model's own end, and the middle's
    plain = client.post("/v1/completions", json={"model": NAME, "prompt": "x = ", "suffix": "", "max_tokens": 8})
    assert plain.status_code == 200  # an empty suffix: a plain completion
    assert models.engine.requests[-1].prompt_token_ids == list(b"x = ")
    assert models.engine.requests[-1].eos_token_ids == {0}
    ids = client.post("/v1/completions", json={"model": NAME, "prompt": [1, 2], "suffix": ")", "max_tokens": 8})
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "suffix"


def test_ollama_suffix_is_the_same_completion(app):
    client, models = app
    r = client.post("/api/generate", json={"model": NAME, "prompt": "def add(a, b):\n    ", "system": "be terse",
                                           "suffix": "\n\nprint(add(1, 2))", "stream": False})
    assert r.status_code == 200, r.text
    request = models.engine.requests[-1]
    assert request.prompt_token_ids == _marked("def add(a, b):\n    ", "\n\nprint(add(1, 2))")
    assert 303 in request.eos_token_ids
    start = client.post("/api/generate", json={"model": NAME, "prompt": "", "suffix": "\nmain()", "stream": False})
    assert start.status_code == 200  # the cursor at the file's start: no prefix
    assert models.engine.requests[-1].prompt_token_ids == _marked("", "\nmain()")
    bad = client.post("/api/generate", json={"model": NAME, "prompt": "a", "suffix": "b", "stream": False,
                                             "context": [1, 2]})
    assert bad.status_code == 400 and "context" in bad.json()["error"]
    # raw: the client marked the prompt up itself; as Ollama does, it is sent as it is.
    raw = client.post("/api/generate", json={"model": NAME, "prompt": "<|fim_prefix|>a", "suffix": "b", "raw": True,
                                             "stream": False})
    assert raw.status_code == 200 and models.engine.requests[-1].prompt_token_ids == [300, *b"a"]


def test_a_model_without_the_markers_refuses_a_suffix_in_both_dialects():
    client = TestClient(create_app(FakeModels()))  # its byte vocabulary has no markers
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "def f(", "suffix": ")", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "fill-in-the-middle" in r.json()["error"]["message"]
    r = client.post("/api/generate", json={"model": NAME, "prompt": "def f(", "suffix": ")", "stream": False})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]


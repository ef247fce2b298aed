import json

import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler
from tokenizers import Tokenizer

from mlxhost.testing import demo
from mlxhost.testing.demo import (
    AGENT_CHAT_TEMPLATE,
    DemoModelConfig,
    build_model_folder,
    build_tokenizer,
    default_demo_model_dir,
    ensure_demo_model,
)

MODEL_FIXTURES = ["qwen3_model_dir", "llama_model_dir", "qwen3_4bit_model_dir"]
UTF8_SAMPLES = [
    "héllo naïve café Ångström",
    "你好，世界！日本語のテキスト 한국어",
    "emoji 😀🚀 flag 🇯🇵 family 👨‍👩‍👧 heart ❤️",
    "tabs\tnewlines\n\n  double  spaces . , don't",
    "nul \x00 and control \x07 bytes",
]


@pytest.mark.parametrize("fixture", MODEL_FIXTURES)
def test_folder_loads_and_generates(fixture, request):
    path = request.getfixturevalue(fixture)
    names = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
    for name in names:
        assert (path / name).is_file(), name
    model, tokenizer = mlx_lm.load(str(path))
    text = mlx_lm.generate(model, tokenizer, "Hello world", max_tokens=8, sampler=make_sampler(temp=0.0))
    assert isinstance(text, str) and text


@pytest.mark.parametrize("fixture", MODEL_FIXTURES)
def test_config_fields(fixture, request):
    path = request.getfixturevalue(fixture)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] in ("qwen3", "llama")
    assert config["rope_theta"] == 1_000_000.0
    eos_id = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id("<|im_end|>")
    assert config["eos_token_id"] == eos_id
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == eos_id


def test_quantized_folder(qwen3_4bit_model_dir):
    config = json.loads((qwen3_4bit_model_dir / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    model, _ = mlx_lm.load(str(qwen3_4bit_model_dir))
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(layer.mlp.down_proj, nn.QuantizedLinear)


def test_quantized_folder_keeps_our_tokenizer_files(qwen3_model_dir, qwen3_4bit_model_dir):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (qwen3_4bit_model_dir / name).read_bytes() == (qwen3_model_dir / name).read_bytes()


@pytest.mark.parametrize("text", UTF8_SAMPLES)
def test_utf8_round_trip(qwen3_model_dir, text):
    raw = Tokenizer.from_file(str(qwen3_model_dir / "tokenizer.json"))
    assert raw.decode(raw.encode(text).ids) == text


def test_utf8_round_trip_through_mlx_lm(qwen3_model_dir):
    _, tokenizer = mlx_lm.load(str(qwen3_model_dir))
    for text in UTF8_SAMPLES:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_token_ids_are_pinned(qwen3_model_dir):
    # Ids must match on every machine and Python version; a change here means old caches are invalid.
    raw = Tokenizer.from_file(str(qwen3_model_dir / "tokenizer.json"))
    assert raw.get_vocab_size() == 2048
    assert [raw.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    hello_ids = [42, 288, 337, 570, 3, 599, 1664, 518, 1037, 85, 765, 20, 16]
    assert raw.encode("Hello world! The model says 42.").ids == hello_ids
    assert raw.encode(" def generate(self):").ids == [554, 833, 10, 279, 78, 72, 11, 28]


def test_tokenizer_build_is_deterministic(tmp_path):
    build_tokenizer(tmp_path / "a")
    build_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_chat_template(qwen3_model_dir):
    _, tokenizer = mlx_lm.load(str(qwen3_model_dir))
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "image"}, {"type": "text", "text": "there"}],
        },
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nHow are you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False, tokenize=False)
    assert without == "<|im_start|>system\nBe brief.<|im_end|>\n"
    # The special markers must encode as single ids, not as their characters.
    ids = tokenizer.encode(prompt)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tokenizer.eos_token_id) == 4
    assert tokenizer.chat_template == AGENT_CHAT_TEMPLATE


def test_same_config_gives_same_weights(qwen3_model_dir, tmp_path):
    path = build_model_folder(tmp_path / "again", DemoModelConfig())
    assert (path / "model.safetensors").read_bytes() == (qwen3_model_dir / "model.safetensors").read_bytes()


def test_ensure_demo_model_is_idempotent(tmp_path, monkeypatch):
    target = tmp_path / "cache" / "demo"
    assert ensure_demo_model(target) == target
    assert (target / "config.json").is_file()
    before = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}

    def fail(*args, **kwargs):
        raise AssertionError("second call must not rebuild")

    monkeypatch.setattr(demo, "build_model_folder", fail)
    assert ensure_demo_model(target) == target
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == before
    # The temporary build folder was renamed away, not left behind.
    assert sorted(p.name for p in target.parent.iterdir()) == ["demo"]


def test_default_demo_model_dir():
    path = default_demo_model_dir()
    assert path.name == "demo-model-v3"
    assert "mlxhost" in str(path)


def test_config_validation():
    with pytest.raises(ValueError):
        DemoModelConfig(arch="gpt2")
    with pytest.raises(ValueError):
        DemoModelConfig(dtype="int8")
    with pytest.raises(ValueError):
        DemoModelConfig(quantize_bits=4, group_size=96)

"""Adapter folders read without the model (mlx-lm's and PEFT's formats, what is refused and why), the
--lora flag and models-file entries, and the block hashes an adapter keys."""

from __future__ import annotations

import json
import struct

import pytest

from mlxhost.config import EngineConfig, LoraSpec, ModelSpec
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.kv.hashing import block_hashes
from mlxhost.lora.adapters import AdapterError, read_adapter
from mlxhost.lora.registry import with_flag_loras
from mlxhost.models.specs import load_models_file, parse_lora_flag


def write_safetensors(path, tensors: dict[str, tuple[list[int], str]]) -> None:
    """A safetensors file with zero-filled tensors of these shapes and dtypes."""
    header, offset = {}, 0
    for name, (shape, dtype) in tensors.items():
        size = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4}[dtype]
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x00" * offset)


def mlx_folder(tmp_path, tensors=None, params=None, kind="lora"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": kind, "num_layers": 2, "lora_parameters": params or {"rank": 4, "scale": 10.0}}))
    write_safetensors(tmp_path / "adapters.safetensors", tensors or {
        "model.layers.1.self_attn.q_proj.lora_a": ([128, 4], "F32"),
        "model.layers.1.self_attn.q_proj.lora_b": ([4, 128], "F32")})
    return tmp_path


def test_an_mlx_lm_folder(tmp_path):
    files = read_adapter(mlx_folder(tmp_path))
    assert files.format == "mlx-lm" and files.scale == 10.0 and files.rank == 4 and not files.transposed
    (m,) = files.modules
    assert (m.path, m.in_dims, m.out_dims, m.rank) == ("model.layers.1.self_attn.q_proj", 128, 128, 4)
    assert files.nbytes == 2 * 128 * 4 * 4 and len(files.digest) == 32


def test_a_peft_folder_and_its_scale(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["v_proj"], "bias": "none"}))
    write_safetensors(tmp_path / "adapter_model.safetensors", {
        "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight": ([8, 128], "BF16"),
        "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight": ([64, 8], "BF16")})
    files = read_adapter(tmp_path)
    assert files.format == "peft" and files.transposed and files.scale == 2.0
    assert [(m.path, m.in_dims, m.out_dims) for m in files.modules] == [("model.layers.0.self_attn.v_proj", 128, 64)]
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    assert read_adapter(tmp_path).scale == pytest.approx(16 / 8 ** 0.5)


@pytest.mark.parametrize("change, message", [
    (lambda d: (d / "adapter_config.json").unlink(), "no adapter_config.json"),
    (lambda d: (d / "adapter_config.json").write_text("{nope"), "not valid JSON"),
    (lambda d: (d / "adapters.safetensors").unlink(), "no adapters.safetensors"),
    (lambda d: (d / "adapters.safetensors").write_bytes(b"\x10\x00"), "not a safetensors file"),
    (lambda d: (d / "adapters.safetensors").write_bytes(struct.pack("<Q", 999) + b"{}"), "bad header length"),
    (lambda d: mlx_folder(d, kind="dora"), "dora"),
    (lambda d: mlx_folder(d, params={"rank": 4, "alpha": 16}), "scale, not alpha"),
    (lambda d: mlx_folder(d, params={"rank": 0, "scale": 1}), "positive integer"),
    (lambda d: mlx_folder(d, {"model.layers.0.mlp.up_proj.lora_a": ([128, 4], "F32")}), "not its pair"),
    (lambda d: mlx_folder(d, {"model.embed_tokens.weight": ([10, 4], "F32")}), "not a LoRA weight"),
    (lambda d: mlx_folder(d, {"x.lora_a": ([128, 4], "F32"), "x.lora_b": ([8, 128], "F32")}), "disagree on the rank"),
    (lambda d: mlx_folder(d, {"x.lora_a": ([128, 8], "F32"), "x.lora_b": ([8, 128], "F32")}), "config says 4"),
    (lambda d: mlx_folder(d, {"x.lora_a": ([128, 4], "I32"), "x.lora_b": ([4, 128], "F32")}), "dtype"),
])
def test_malformed_folders_say_what_is_wrong(tmp_path, change, message):
    folder = mlx_folder(tmp_path / "a")
    change(folder)
    with pytest.raises(AdapterError, match=message):
        read_adapter(folder)


def test_peft_options_that_are_not_served(tmp_path):
    write_safetensors(tmp_path / "adapter_model.safetensors", {})
    for extra, message in (({"use_dora": True}, "DoRA"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                           ({"bias": "all"}, "biases"), ({"peft_type": "IA3"}, "IA3")):
        (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, **extra}))
        with pytest.raises(AdapterError, match=message):
            read_adapter(tmp_path)


def test_lora_flags_and_models_file(tmp_path):
    assert parse_lora_flag("sql=/a/b") == LoraSpec("sql", "/a/b")
    assert parse_lora_flag("qwen:sql=/a/b") == LoraSpec("sql", "/a/b", base="qwen")
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_lora_flag("/a/b")
    one = (ModelSpec("qwen", "/m/qwen"),)
    assert with_flag_loras(one, [LoraSpec("sql", "/a")])[0].loras == (LoraSpec("sql", "/a", "qwen"),)
    two = one + (ModelSpec("llama", "/m/llama", aliases=("l3",)),)
    with pytest.raises(ValueError, match="name the base model"):
        with_flag_loras(two, [LoraSpec("sql", "/a")])
    assert with_flag_loras(two, [LoraSpec("sql", "/a", "l3")])[1].loras == (LoraSpec("sql", "/a", "llama"),)
    (tmp_path / "chat").mkdir()
    (tmp_path / "models.yaml").write_text(
        "models:\n  - name: qwen\n    path: /m/qwen\n    loras: {sql: /adapters/sql, chat: ./chat}\n"
        "  - name: llama\n    path: /m/llama\n    loras: [{name: x, path: /x}, 'y=/y']\n")
    specs = load_models_file(tmp_path / "models.yaml", EngineConfig()).models
    assert specs[0].loras == (LoraSpec("sql", "/adapters/sql", "qwen"),
                              LoraSpec("chat", str(tmp_path / "chat"), "qwen"))
    assert specs[1].loras == (LoraSpec("x", "/x", "llama"), LoraSpec("y", "/y", "llama"))


def test_an_adapter_keys_every_block_and_the_base_keeps_its_hashes():
    ids = list(range(100))
    params = SamplingParams(max_tokens=1)
    base = Request("b", ids, params)
    alpha, beta = Request("a", ids, params, adapter="alpha@1"), Request("c", ids, params, adapter="beta@2")
    assert base.block_key_spans == ()  # the base model's hashes are the ones stored before adapters existed
    hashes = {r.request_id: block_hashes(ids, 16, model_key="m", media_spans=r.block_key_spans)
              for r in (base, alpha, beta)}
    assert hashes["b"] == block_hashes(ids, 16, model_key="m")
    assert len(hashes["a"]) == 6 and all(len({hashes[k][i] for k in hashes}) == 3 for i in range(6))
    assert hashes["a"] == block_hashes(ids, 16, model_key="m", media_spans=Request("z", ids, params,
                                                                                   adapter="alpha@1").block_key_spans)

"""Offline builder of tiny random-weight Hugging Face-style model folders.

Used by `mlxhost demo-model`, by `mlxhost serve` with no model, and by tests as fixtures. Everything is
made here (tokenizer, weights, configs) so it works without network access and gives the same token ids
on every machine.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass

import platformdirs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from mlxhost.structured.templates import AGENT_CHAT_TEMPLATE
from mlxhost.testing.tokenizer_corpus import make_corpus

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
TOKENIZER_VOCAB_SIZE = 2048
DEMO_MODEL_DIRNAME = "demo-model-v3"  # v2: the chat template takes tools; v3: a 128k context

# ChatML. Content is a string, a list of OpenAI-style parts (text parts are concatenated), or none.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
_DTYPES = ("float32", "bfloat16", "float16")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class DemoModelConfig:
    arch: str = "qwen3"  # "qwen3" or "llama"
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    init_std: float = 0.1  # std 0.1 gives varied output (std 0.02 repeats one token)
    seed: int = 0
    quantize_bits: int | None = None  # e.g. 4: quantized through mlx-lm's converter
    group_size: int = 64
    tie_word_embeddings: bool = True
    # None: the tokenizer's size. Benchmarks set a real model's (151936 for Qwen3) so the LM head
    # costs what it costs in production; ids past the tokenizer decode to nothing.
    vocab_size: int | None = None
    # The converter round-trips through a float checkpoint on disk; for multi-GB benchmark models we
    # quantize in memory with mlx's nn.quantize instead (same layers, same config entry).
    quantize_with_converter: bool = True
    # A benchmark target whose greedy next token wins by a wide logit margin (make_peaked_weights):
    # same shapes and cost, but a verify forward's rounding cannot flip its argmax.
    peaked: bool = False

    def __post_init__(self):
        if self.arch not in _ARCHITECTURES:
            raise ValueError(f"arch must be one of {sorted(_ARCHITECTURES)}, got {self.arch!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.peaked and self.tie_word_embeddings:
            raise ValueError("peaked needs tie_word_embeddings=False (its LM head is a permuted embedding)")
        if self.quantize_bits is not None:
            # mlx-lm skips layers whose input width is not a multiple of the group: catch it here
            # instead of shipping a half-quantized model.
            for width in (self.hidden_size, self.intermediate_size, self.num_attention_heads * self.head_dim):
                if width % self.group_size != 0:
                    raise ValueError(f"width {width} is not a multiple of group_size {self.group_size}")


# ---------------------------------------------------------------------------------------------------
# Tokenizer


def _train_tokenizer():
    tokenizer = Tokenizer(models.BPE())
    # Byte-level with no normalizer: any UTF-8 string survives encode -> decode unchanged.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(make_corpus(), trainer)
    return tokenizer


def build_tokenizer(out_dir) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))

    added_tokens_decoder = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        # The default (True) would rewrite " ." as "." and break the round trip.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        # Tools, tool results and thinking (Qwen3's conventions); plain chats render as CHAT_TEMPLATE.
        "chat_template": AGENT_CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    special_tokens_map = {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": tokenizer_config["additional_special_tokens"],
    }
    _write_json(out / "special_tokens_map.json", special_tokens_map)


def _token_id(out_dir: pathlib.Path, token: str) -> int:
    token_id = Tokenizer.from_file(str(out_dir / "tokenizer.json")).token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"{token} missing from the demo tokenizer")
    return token_id


# ---------------------------------------------------------------------------------------------------
# Model folder


def text_shape(config) -> dict:
    """The transformer's shape as config.json spells it (shared by the text and the VLM fixtures)."""
    return {
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
    }


def _hf_config(config: DemoModelConfig, vocab_size: int, eos_token_id: int, pad_token_id: int) -> dict:
    return {
        "architectures": [_ARCHITECTURES[config.arch]],
        "model_type": config.arch,
        **text_shape(config),
        "max_position_embeddings": config.max_position_embeddings,
        # Top level on purpose: mlx-lm's Llama ignores transformers 5's nested rope_parameters.
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": config.init_std,
        "vocab_size": vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "use_cache": True,
        # Both names: transformers 5 reads "dtype", mlx-lm's converter reads "torch_dtype".
        "dtype": config.dtype,
        "torch_dtype": config.dtype,
    }


def _random_model(config: DemoModelConfig, hf_config: dict):
    import mlx.core as mx  # lazy: mlx only when used
    from mlx.utils import tree_flatten, tree_unflatten  # lazy: mlx only when used

    arch = importlib.import_module(f"mlx_lm.models.{config.arch}")
    model = arch.Model(arch.ModelArgs.from_dict(hf_config))
    params = tree_flatten(model.parameters())
    # One key per parameter, in the model's own (stable) order, so a given seed always gives the same weights.
    keys = mx.random.split(mx.random.key(config.seed), len(params))
    dtype = getattr(mx, config.dtype)
    new_params = []
    for i, (name, value) in enumerate(params):
        if name.endswith("norm.weight"):
            # RMSNorm gains stay at 1: random gains near 0 would flatten the activations.
            new_value = mx.ones(value.shape)
        else:
            new_value = config.init_std * mx.random.normal(value.shape, key=keys[i])
        new_params.append((name, new_value.astype(dtype)))
    if config.peaked:
        new_params = make_peaked_weights(dict(new_params), config.seed)
    model.update(tree_unflatten(new_params))
    mx.eval(model.parameters())
    return model


# Residual branches (attention and MLP outputs) this much smaller than the default init in a peaked model: on the
# Qwen3-8B shape each is then ~1% of the token's embedding (35-115x it at full scale).
PEAKED_BRANCH_SCALE = 1e-4


def make_peaked_weights(params: dict, seed: int) -> list:
    """A random model's weights made into a peaked one: the residual stream stays the fed token's embedding
    (branches scaled by PEAKED_BRANCH_SCALE) and the LM head's row for token `next(x)` is x's embedding, where
    `next` walks one random cycle through the whole vocabulary. The winning logit is then the normed stream's
    full length times the row's (cosine ~1) against ~5/sqrt(hidden) of it for the best other row: a gap of
    the order of the logits themselves, where rounding noise is a small fraction of them."""
    import mlx.core as mx  # lazy: mlx only when used

    embed = params["model.embed_tokens.weight"]
    vocab = embed.shape[0]
    order = mx.random.permutation(vocab, key=mx.random.key(seed + 1))  # the cycle's visiting order
    position = mx.argsort(order)
    # Token j's row is its predecessor's embedding: the stream of x scores highest at the token after x.
    params["lm_head.weight"] = embed[order[(position - 1) % vocab]]
    for name, value in params.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            params[name] = (value * PEAKED_BRANCH_SCALE).astype(value.dtype)
    return list(params.items())


def _write_float_folder(out: pathlib.Path, config: DemoModelConfig, progress=None) -> None:
    from mlx_lm.utils import save_config, save_model  # lazy: mlx_lm only when used

    stage = progress or (lambda _: None)
    stage("training the tokenizer")
    build_tokenizer(out)
    with open(out / "tokenizer.json", encoding="utf-8") as f:
        tokenizer_json = json.load(f)
    vocab_size = _vocab_size(tokenizer_json)
    if config.vocab_size and config.vocab_size > vocab_size:
        _pad_vocab(out, tokenizer_json, vocab_size, config.vocab_size)
    eos_token_id = _token_id(out, EOS_TOKEN)
    pad_token_id = _token_id(out, PAD_TOKEN)
    hf_config = _hf_config(config, config.vocab_size or vocab_size, eos_token_id, pad_token_id)
    stage("making random weights")
    model = _random_model(config, hf_config)
    if config.quantize_bits is not None and not config.quantize_with_converter:
        import mlx.nn as nn  # lazy: mlx only when used

        nn.quantize(model, group_size=config.group_size, bits=config.quantize_bits)
        hf_config["quantization"] = {"group_size": config.group_size, "bits": config.quantize_bits}
    stage("writing weights")
    save_model(out, model)
    save_config(hf_config, config_path=out / "config.json")
    generation_config = {
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "do_sample": False,
    }
    _write_json(out / "generation_config.json", generation_config)


def _pad_vocab(out: pathlib.Path, tokenizer_json: dict, start: int, stop: int) -> None:
    """Gives every id of a benchmark-sized vocabulary a text (" v2048", ...), so a random model's output
    streams as text like a real model's. Encoding never produces them: they have no merges."""
    vocab = tokenizer_json["model"]["vocab"]
    for i in range(start, stop):
        vocab[f"\u0120v{i}"] = i  # U+0120 is the byte-level alphabet's space
    _write_json(out / "tokenizer.json", tokenizer_json)


def _vocab_size(tokenizer_json: dict) -> int:
    ids = list(tokenizer_json["model"]["vocab"].values())
    ids += [t["id"] for t in tokenizer_json.get("added_tokens", [])]
    return max(ids) + 1


def _quantize_folder(src: pathlib.Path, out: pathlib.Path, config: DemoModelConfig) -> None:
    from mlx_lm.convert import convert  # lazy: mlx_lm only when used

    # The converter prints progress lines; a fixture builder should stay quiet.
    with contextlib.redirect_stdout(io.StringIO()):
        convert(
            str(src),
            str(out),
            quantize=True,
            q_bits=config.quantize_bits,
            q_group_size=config.group_size,
        )
    # The converter re-saves the tokenizer through transformers, which may rename or drop files:
    # put back our own so the quantized folder tokenizes exactly like the float one.
    for name in _TOKENIZER_FILES + ("generation_config.json",):
        shutil.copyfile(src / name, out / name)
    (out / "chat_template.jinja").unlink(missing_ok=True)


def build_model_folder(out_dir, config: DemoModelConfig = DemoModelConfig(), progress=None) -> pathlib.Path:
    """Build a tiny random-weight model folder at out_dir (created if missing) and return its path.
    `progress(stage)` is called as each stage starts (mlxhost.server.progress.StageLog prints them)."""
    out = pathlib.Path(out_dir)
    if config.quantize_bits is None or not config.quantize_with_converter:
        out.mkdir(parents=True, exist_ok=True)
        _write_float_folder(out, config, progress)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".demo-float-") as tmp:
        float_dir = pathlib.Path(tmp) / "float"
        float_dir.mkdir()
        _write_float_folder(float_dir, config, progress)
        if progress is not None:
            progress(f"quantizing to {config.quantize_bits} bits")
        if out.exists():
            # The converter refuses existing paths; an empty one (e.g. from mkdtemp) is safe to drop.
            out.rmdir()
        _quantize_folder(float_dir, out, config)
    return out


# The served demo (`mlxhost serve` with no model) gets a context that fits coding agents: Claude Code's system
# prompt and tools alone are ~54k tokens. Rope positions cost nothing in weights, only KV memory (1 KiB a
# token here); test fixtures keep DemoModelConfig's 4096.
SERVED_DEMO_CONFIG = DemoModelConfig(max_position_embeddings=131072)


def default_demo_model_dir() -> pathlib.Path:
    return pathlib.Path(platformdirs.user_cache_dir("mlxhost")) / DEMO_MODEL_DIRNAME


def ensure_demo_model(path=None, progress=None) -> pathlib.Path:
    """Return the demo model folder, building it first if it is not there yet (`progress`: as in
    build_model_folder, called only when it builds)."""
    target = pathlib.Path(path) if path is not None else default_demo_model_dir()
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename, so a crash or a concurrent builder never leaves half a folder.
    tmp = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        build_model_folder(tmp, SERVED_DEMO_CONFIG, progress=progress)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process finished first (the target is now a non-empty folder): keep theirs.
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_json(path: pathlib.Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# Real models' shapes with random weights, for benchmarks (`mlxhost demo-model PATH --shape qwen3-8b --bits 4`).
SHAPES = {
    "tiny": DemoModelConfig(),
    "qwen3-0.6b": DemoModelConfig(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                  num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                  max_position_embeddings=40960, vocab_size=151936, dtype="bfloat16",
                                  init_std=0.02),
    "qwen3-8b": DemoModelConfig(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                                num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                                max_position_embeddings=40960, vocab_size=151936, dtype="bfloat16",
                                init_std=0.02, tie_word_embeddings=False),
}

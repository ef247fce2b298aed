"""A Hugging Face causal LM in PyTorch whose KV cache is registered state, for Core ML conversion.

The recipe Core ML wants (coremltools' stateful models, Apple's "Llama 3.1 with Core ML"): the keys and
values of every layer live in two buffers of shape (layers, batch, kv_heads, context, head_dim) that the
forward updates in place by slice assignment, so the converter turns them into `read_state` /
`slice_update` / `coreml_update_state` instead of model inputs and outputs that are copied every step.
Positions come from the shapes: `causal_mask` is (1, 1, new tokens, past + new tokens), so one traced
program serves the prompt and each extend step.

The decoder layers are transformers' own modules (q/k norms, biases, rope scaling included); only the
attention kernel is ours, registered through transformers' public AttentionInterface: plain
`scaled_dot_product_attention` over the cache prefix with the given mask, which the converter keeps as
one fused op for macOS 15 / iOS 18.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mlxhost.export import UnsupportedModelError

ATTENTION_NAME = "mlxhost_coreml_sdpa"
# Families whose decoder layers are Llama-shaped (norm, attention with rope, norm, MLP) and whose
# attention calls `cache.update(...)`: the ones this wrapper is tested on, plus Mistral and Qwen2.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
LOGITS_CHOICES = ("all", "last")
# Rope variants whose frequencies do not depend on the sequence length (dynamic / longrope do).
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _sdpa(module, query, key, value, attention_mask, scaling=None, **_):
    """Grouped-query attention as one SDPA call: keys/values repeated to the query heads (the converter
    has no `enable_gqa`), the caller's additive mask, no is_causal (the mask already says it)."""
    groups = module.num_key_value_groups  # a Python int, so the trace holds no shape arithmetic for it
    if groups > 1:
        # Head h reads kv head h // groups (transformers' repeat_kv), as expand + flatten: one `tile`.
        batch, kv_heads, length, head_dim = key.shape
        shape = (batch, kv_heads * groups, length, head_dim)
        key = key[:, :, None].expand(batch, kv_heads, groups, length, head_dim).reshape(shape)
        value = value[:, :, None].expand(batch, kv_heads, groups, length, head_dim).reshape(shape)
    # SDPA's default scale is head_dim ** -0.5; pass another one only when the model asks for it.
    head_dim = module.head_dim  # not query.shape[-1]: a traced shape is a tensor, not a number
    scale = None if scaling is None or abs(scaling - head_dim ** -0.5) < 1e-9 else scaling
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface  # lazy: transformers only when used

    AttentionInterface.register(ATTENTION_NAME, _sdpa)


def check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported by the Core ML export "
                                    f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _STATIC_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {rope_type!r} changes with the sequence length; the export "
                                    f"supports {', '.join(_STATIC_ROPE_TYPES)}")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise UnsupportedModelError("sliding-window attention needs a rotating cache, which this export "
                                    "does not build (config.sliding_window is set)")


def load_hf_model(source: str | Path):
    """The model in float32 through transformers (a folder or a hub id), with our attention kernel."""
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: transformers only when used

    text = str(source)
    if not Path(text).is_dir() and (text.startswith(("/", ".", "~")) or text.count("/") > 1):
        raise FileNotFoundError(f"no model folder at {text}")  # a path, not a hub id: say so plainly
    config = AutoConfig.from_pretrained(text)
    if getattr(config, "quantization", None) or getattr(config, "quantization_config", None):
        raise UnsupportedModelError(f"{source} holds quantized weights; export from the float checkpoint "
                                    "(the Hugging Face folder it was converted from) and quantize with --quantize")
    check_supported(config)
    _register_attention()
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    model.set_attn_implementation(ATTENTION_NAME)
    return model.eval()


class _CacheView:
    """What transformers' attention calls as `cache.update(...)`: writes the new keys/values at
    [past, end) of the owner's buffers and returns the prefix [0, end). Not a module, so the buffers
    stay registered (and named) on the wrapper alone."""

    def __init__(self, owner: "StatefulCausalLM") -> None:
        self.owner = owner
        self.past = self.end = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.owner.key_cache, self.owner.value_cache
        keys[layer_idx, :, :, self.past:self.end, :] = key_states
        values[layer_idx, :, :, self.past:self.end, :] = value_states
        return keys[layer_idx, :, :, :self.end, :], values[layer_idx, :, :, :self.end, :]


class StatefulCausalLM(nn.Module):
    """forward(input_ids (1, new), causal_mask (1, 1, new, past + new)) -> logits (1, new, vocab), or
    (1, 1, vocab) with logits="last": generation needs only the last position, and the LM head over a
    2k-token prompt of a 128k vocabulary is half a gigabyte of float16 output."""

    def __init__(self, model, context: int, logits: str = "all") -> None:
        super().__init__()
        config = model.config
        check_supported(config)
        if context > getattr(config, "max_position_embeddings", context):
            raise ValueError(f"context {context} is longer than the model's max_position_embeddings "
                             f"({config.max_position_embeddings})")
        if logits not in LOGITS_CHOICES:
            raise ValueError(f"logits must be one of {LOGITS_CHOICES}, got {logits!r}")
        self.model = model
        self.last_logits_only = logits == "last"
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # Batch 1: one sequence per app session, like the recipe (input_ids is (1, new) too).
        self.state_shape = (config.num_hidden_layers, 1, config.num_key_value_heads, context, head_dim)
        # Names become the Core ML state names.
        self.register_buffer("key_cache", torch.zeros(self.state_shape, dtype=torch.float32))
        self.register_buffer("value_cache", torch.zeros(self.state_shape, dtype=torch.float32))
        self._cache = _CacheView(self)
        # transformers 5 renamed the layers' `past_key_values` argument to `cache` (the old name warns).
        params = inspect.signature(model.model.layers[0].forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def context(self) -> int:
        return self.state_shape[3]

    def reset(self) -> None:
        self.key_cache.zero_()
        self.value_cache.zero_()

    def forward(self, input_ids: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        new, end = input_ids.shape[-1], causal_mask.shape[-1]
        past = end - new
        self._cache.past, self._cache.end = past, end
        inner = self.model.model
        hidden = inner.embed_tokens(input_ids)
        position_ids = torch.arange(past, end).unsqueeze(0)
        position_embeddings = inner.rotary_emb(hidden, position_ids)
        mask = causal_mask.to(hidden.dtype)
        for layer in inner.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           position_ids=position_ids, **{self._cache_arg: self._cache})
        if self.last_logits_only:
            hidden = hidden[:, -1:]
        return self.model.lm_head(inner.norm(hidden))


def make_causal_mask(new: int, end: int, dtype=np.float32) -> np.ndarray:
    """(1, 1, new, end): 0 where query i (at position end - new + i) may see key j, -inf after it."""
    past = end - new
    allowed = np.arange(end)[None, :] <= (past + np.arange(new))[:, None]
    return np.where(allowed, 0.0, -np.inf).astype(dtype)[None, None]


@torch.no_grad()
def stateful_logits(wrapper: StatefulCausalLM, token_ids, prompt_len: int) -> np.ndarray:
    """Logits from the prompt in one call, then each further token as its own extend step through the
    state (what an app on the exported model does): (len(token_ids), vocab) rows, or with logits="last"
    one row per call (1 + extend steps)."""
    wrapper.reset()
    ids = torch.tensor([list(token_ids)], dtype=torch.int64)
    rows = [wrapper(ids[:, :prompt_len], torch.from_numpy(make_causal_mask(prompt_len, prompt_len)))[0]]
    for end in range(prompt_len + 1, ids.shape[1] + 1):
        rows.append(wrapper(ids[:, end - 1:end], torch.from_numpy(make_causal_mask(1, end)))[0])
    return torch.cat(rows).float().numpy()

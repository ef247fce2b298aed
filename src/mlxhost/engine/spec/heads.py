"""Draft heads fed the target's hidden states: EAGLE-3 and MTP, loaded from a checkpoint folder.

Both take pairs (hidden state at position t, token t + 1), run a layer or two over a KV cache of their
own, and give a hidden state `g` whose logits guess token t + 2; later drafts feed `g` back with the
token just drafted. They differ in what they are fed and in their layers:

- EAGLE-3 (`model_type` "eagle3", the Speculators/SGLang layout): three target layers' outputs,
  concatenated and projected by `fc`; its layers and LM head are mlx-vlm's `Eagle3DraftModel`, driven
  here through its modules (its own round loop keeps one batch-wide state, which a continuous batch
  cannot use). The token embedding is the target's when the shapes match.
- MTP (`model_type` "mtp"): the DeepSeek-V3 / Qwen3.5 layout, `fc` over [norm(embed(token)),
  norm(hidden)], then decoder layers and a norm; fed the target's final hidden state, and it shares
  the target's embedding and LM head. mlx-vlm's MTP drafters build their layers from their own
  families' classes (Qwen3.5's gated attention, DeepSeek's MLA), so the layers here are the target
  family's own mlx-lm `TransformerBlock`s. Weights may carry an `mtp.` prefix (a checkpoint whose MTP
  layers sit beside the model's).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlxhost.engine.spec.hidden import FINAL


class Eagle3Head:
    kind = "eagle3"

    def __init__(self, config: dict, target: Any) -> None:
        # mlx-vlm's drafter only where an EAGLE-3 head is loaded: a heavy import kept off start-up.
        from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config
        from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

        self.module = Eagle3DraftModel(Eagle3Config.from_dict(config)).bind(target.model)
        # Outputs of these target layers (mlx-vlm's `capture_layer_ids`: layer i's input is layer i-1's output).
        self.layer_ids = tuple(self.module.config.capture_layer_ids)
        self.width = self.module.hidden_size
        self.dtype = _activation_dtype(target)

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.module.layers]

    def forward(self, tokens: mx.array, hidden: mx.array, cache: list[Any], from_target: bool) -> mx.array:
        m = self.module
        if from_target:  # the target's layers, concatenated: projected to the head's width
            if m.input_norm is not None:
                hidden = m.input_norm(hidden)
            hidden = m.fc(hidden)
        embeds = m.embed_tokens(tokens)
        mask = create_attention_mask(hidden, cache[0])
        h = m.layers[0](embeds, hidden, mask, cache[0], None)  # None: positions from the cache's offsets
        for layer, c in zip(m.layers[1:], cache[1:]):
            h = layer(h, mask, c, None)
        return h

    def draft(self, g: mx.array) -> mx.array:
        m = self.module
        h = m.norm(g)
        logits = m.embed_tokens.as_linear(h) if m.lm_head is None else m.lm_head(h)
        ids = mx.argmax(logits, axis=-1).astype(mx.int32)
        return ids + m.d2t[ids] if m.d2t is not None else ids  # a reduced draft vocabulary's ids -> target's

    def parameters(self):
        return self.module.parameters()


class MTPModule(nn.Module):
    def __init__(self, target: Any, num_layers: int) -> None:
        super().__init__()
        args = target.args
        d, eps = args.hidden_size, args.rms_norm_eps
        block = type(target.model.layers[0])  # the target family's own decoder layer
        self.pre_fc_norm_embedding = nn.RMSNorm(d, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(d, eps=eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = [block(args) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(d, eps=eps)


class MTPHead:
    kind = "mtp"
    layer_ids = (FINAL,)

    def __init__(self, config: dict, target: Any) -> None:
        self.module = MTPModule(target, int(config.get("num_layers", 1)))
        inner = target.model
        self.embed = inner.embed_tokens
        tied = bool(getattr(target.args, "tie_word_embeddings", False)) or not hasattr(target, "lm_head")
        self.lm_head = inner.embed_tokens.as_linear if tied else target.lm_head
        self.width = target.args.hidden_size
        self.dtype = _activation_dtype(target)

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.module.layers]

    def forward(self, tokens: mx.array, hidden: mx.array, cache: list[Any], from_target: bool) -> mx.array:
        m = self.module
        h = m.fc(mx.concatenate([m.pre_fc_norm_embedding(self.embed(tokens)), m.pre_fc_norm_hidden(hidden)], -1))
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(m.layers, cache):
            h = layer(h, mask, c)
        return m.norm(h)

    def draft(self, g: mx.array) -> mx.array:
        return mx.argmax(self.lm_head(g), axis=-1).astype(mx.int32)

    def parameters(self):
        return self.module.parameters()


HEADS = {"eagle3": Eagle3Head, "mtp": MTPHead}


def head_kind(path: str | pathlib.Path) -> str | None:
    """The head kind a checkpoint folder holds, from its config.json (None: not a head)."""
    try:
        config = json.loads((pathlib.Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if "DFlashDraftModel" in (config.get("architectures") or []):  # z-lab's layout: model_type is the backbone's
        return "dflash"
    kind = config.get("model_type") or config.get("speculators_model_type")
    return kind if kind in HEADS else None


def load_head(path: str | pathlib.Path, target: Any, kind: str) -> Eagle3Head | MTPHead:
    folder = pathlib.Path(path)
    config = json.loads((folder / "config.json").read_text())
    found = config.get("model_type") or config.get("speculators_model_type")
    if found != kind:
        raise ValueError(f"{folder} holds a {found!r} checkpoint, not {kind!r}")
    head = HEADS[kind](config, target)
    weights: dict[str, mx.array] = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    if kind == "mtp":
        weights = {k.removeprefix("mtp."): v for k, v in weights.items() if not k.startswith("model.")}
    else:
        weights = head.module.sanitize(weights)
        weights = {k: v for k, v in weights.items() if not (k.startswith("embed_tokens.")
                                                            and head.module.embed_tokens is target.model.embed_tokens)}
    head.module.load_weights(list(weights.items()), strict=False)
    missing = _missing(head.module, weights, kind, target)
    if missing:
        raise ValueError(f"{folder}: weights missing for {', '.join(missing[:5])}")
    head.module.eval()
    mx.eval(head.module.parameters())
    return head


def save_head(head: Eagle3Head | MTPHead, config: dict, out: str | pathlib.Path) -> pathlib.Path:
    """A head as a checkpoint folder (config.json + model.safetensors); shared target weights are left out."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    skip = ("embed_tokens.",) if head.kind == "eagle3" else ()
    weights = {k: v for k, v in tree_flatten(head.module.parameters()) if not k.startswith(skip)}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _missing(module: nn.Module, weights: dict, kind: str, target: Any) -> list[str]:
    have = set(weights)
    shared = ("embed_tokens.",) if kind == "eagle3" and module.embed_tokens is target.model.embed_tokens else ()
    return [k for k, _ in tree_flatten(module.parameters()) if k not in have and not k.startswith(shared)
            and k != "d2t"]


def _activation_dtype(target: Any) -> mx.Dtype:
    embed = target.model.embed_tokens
    return getattr(embed, "scales", embed.weight).dtype  # a quantized embedding's weight is packed uint32

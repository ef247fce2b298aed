"""DFlash: a block-diffusion drafter that proposes a row's whole draft in one forward.

The drafter (mlx-vlm's `DFlashDraftModel`, the z-lab checkpoint layout: `architectures` holds
"DFlashDraftModel", `dflash_config` names `mask_token_id` and `target_layer_ids`) keeps a KV cache of
*context*: each layer's keys and values projected from `hidden_norm(fc(target hidden states))` of the
tokens the row emitted. A draft is one forward over the block `[last, mask, ..., mask]`: its queries
attend to the whole context and to the block itself (no causal mask), and the logits at the mask
positions are the K drafts. The block's own keys are not kept (trimmed after the forward).

Its per-row cache rides in the decode batch's `draft_cache`, so joins, fillers and drops move it with
the row. The context grows like an EAGLE head's KV: a plain step through the tap appends the fed
token's hidden states (`observe`), a speculative one appends all 1 + K and the same per-row rewind
drops what the target rejected (`accept`). mlx-vlm's own round loop keeps one batch-wide state, which a
continuous batch cannot use, so the forwards here are driven through the drafter's modules.
Positions the drafter missed (the prompt, steps without the tap) are absent from its context: drafts
may then be worse, never wrong: the target verifies every one.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from mlxhost.engine.request import Request
from mlxhost.engine.spec.hidden import HiddenTap, why_no_tap
from mlxhost.engine.spec.proposer import DraftStep, Proposer
from mlxhost.engine.spec.verify import rewind

ARCHITECTURE = "DFlashDraftModel"


def is_dflash(config: dict) -> bool:
    return ARCHITECTURE in (config.get("architectures") or []) or config.get("model_type") == "dflash"


class DFlashDrafter:
    """mlx-vlm's drafter bound to the target (its embedding and LM head are the target's)."""

    def __init__(self, config: dict, target: Any) -> None:
        # mlx-vlm's drafter only where a DFlash drafter is loaded: a heavy import kept off start-up.
        from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel, ModelConfig as DFlashConfig

        self.config = DFlashConfig.from_dict(config)
        self.module = DFlashDraftModel(self.config).bind(target)
        self.layer_ids = tuple(self.config.target_layer_ids)  # outputs of these target layers (0-based)
        self.block_size = int(self.config.block_size)

    def why_not(self, target: Any) -> str | None:
        """What in the checkpoint this proposer cannot run (None: all of it)."""
        c = self.config
        if c.hidden_size != target.args.hidden_size:
            return f"the drafter's hidden size {c.hidden_size} is not the target's {target.args.hidden_size}"
        if c.num_target_layers != len(target.model.layers):
            return f"the drafter was trained on a target of {c.num_target_layers} layers"
        if any(t != "full_attention" for t in c.layer_types) or c.is_causal or c.attention_sink_bias:
            return "sliding-window, causal or attention-sink drafter layers are not supported here"
        if c.draft_window_size:
            return "a drafter with a context window (draft_window_size) is not supported here"
        return None

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.module.layers]

    def add_context(self, hidden: mx.array, cache: list[Any]) -> None:
        """Appends the context keys and values of target hidden states [B, S, n * D] to every layer."""
        m = self.module
        ctx = m.hidden_norm(m.fc(hidden))
        B, S, _ = ctx.shape
        for layer, c in zip(m.layers, cache):
            attn = layer.self_attn
            keys = attn.k_norm(attn.k_proj(ctx).reshape(B, S, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            values = attn.v_proj(ctx).reshape(B, S, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            c.update_and_fetch(m.rope(keys, offset=c.offset), values)

    def draft(self, last: mx.array, num_k: int, cache: list[Any], vocab_width: int = 0) -> mx.array:
        """One forward over [last, mask x num_k] against each row's context: the drafts [B, num_k]."""
        logits = self.block_logits(last, num_k, cache)
        return mx.argmax(logits[..., : vocab_width or None], axis=-1).astype(mx.int32)

    def block_logits(self, last: mx.array, num_k: int, cache: list[Any]) -> mx.array:
        """The logits [B, num_k, V] at the block's mask positions; the caches end as they began."""
        m, L = self.module, num_k + 1
        block = mx.concatenate([last[:, None].astype(mx.int32),
                                mx.full((last.shape[0], num_k), int(self.config.mask_token_id), mx.int32)], axis=1)
        h = m.embed_tokens(block) * m.embed_scale
        for layer, c in zip(m.layers, cache):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            B = x.shape[0]
            q = attn.q_norm(attn.q_proj(x).reshape(B, L, attn.n_heads, -1)).transpose(0, 2, 1, 3)
            k = attn.k_norm(attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
            v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            q, k = m.rope(q, offset=c.offset), m.rope(k, offset=c.offset)
            keys, values = c.update_and_fetch(k, v)  # context + block; the block is trimmed below
            mask = None
            padding = getattr(c, "left_padding", None)  # a batch cache's rows are left-padded
            if padding is not None:
                mask = (mx.arange(keys.shape[2])[None, :] >= padding[:, None])[:, None, None, :]
            o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
            h = h + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            c.trim(L)
        logits = m.lm_head(m.norm(h[:, 1:]))
        if self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            logits = mx.tanh(logits / cap) * cap
        return logits

    def parameters(self):
        return self.module.parameters()


def load_drafter(path: str | pathlib.Path, target: Any) -> DFlashDrafter:
    folder = pathlib.Path(path)
    config = json.loads((folder / "config.json").read_text())
    if not is_dflash(config):
        raise ValueError(f"{folder} holds no DFlash drafter (architectures: {config.get('architectures')})")
    drafter = DFlashDrafter(config, target)
    weights: dict[str, mx.array] = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    # The embedding and LM head are the target's (bound); a checkpoint's own copies are left out.
    weights = {k: v for k, v in drafter.module.sanitize(weights).items()
               if not k.startswith(("embed_tokens.", "lm_head."))}
    drafter.module.load_weights(list(weights.items()), strict=False)
    shared = ("embed_tokens.", "lm_head.")
    missing = [k for k, _ in tree_flatten(drafter.module.parameters()) if k not in weights and not k.startswith(shared)]
    if missing:
        raise ValueError(f"{folder}: weights missing for {', '.join(missing[:5])}")
    drafter.module.eval()
    mx.eval(drafter.module.parameters())
    return drafter


def save_drafter(drafter: DFlashDrafter, config: dict, out: str | pathlib.Path) -> pathlib.Path:
    """A drafter as a checkpoint folder (config.json + model.safetensors), without the target's weights."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v for k, v in tree_flatten(drafter.module.parameters())
               if not k.startswith(("embed_tokens.", "lm_head."))}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


class DFlashProposer(Proposer):
    """`--speculative dflash --speculative-model DRAFTER`: a whole draft per row in one drafter forward."""

    name = "dflash"
    keeps_cache = True
    wants_hidden = True

    def __init__(self, config: Any, vocab_width: int = 0) -> None:
        self.source = config.draft_model
        self.vocab_width = vocab_width
        self.drafter: DFlashDrafter | None = None

    def bind(self, target: Any) -> str | None:
        if not self.source:
            return "--speculative dflash needs the drafter's folder (--speculative-model PATH)"
        why = why_no_tap(target, ())
        if why is not None:
            return why
        self.drafter = load_drafter(self.source, target)
        why = self.drafter.why_not(target) or why_no_tap(target, self.drafter.layer_ids)
        if why is not None:
            return why
        self.tap = HiddenTap(target, self.drafter.layer_ids)
        return None

    def held(self) -> Any:
        return self.drafter.module if self.drafter is not None else None

    def describe(self) -> str:
        return f"DFlash drafter {self.source} (blocks of {self.drafter.block_size})"

    def join(self, row: Any, request: Request) -> list[Any]:
        return self.drafter.make_cache()

    def propose(self, step: DraftStep):
        lengths = [min(step.budget.get(i, 0), self.drafter.block_size - 1) for i in range(len(step.rids))]
        num_k = max(lengths)
        if num_k == 0:
            return None
        last = step.batch.tokens
        drafts = self.drafter.draft(last, num_k, step.batch.draft_cache, self.vocab_width)
        return mx.concatenate([last[:, None].astype(mx.int32), drafts], axis=1).astype(last.dtype), lengths

    def accept(self, step: DraftStep, num_accepted: list[int], num_drop: list[int]) -> None:
        """The fed tokens' hidden states go into the context; the positions the target dropped go again."""
        self.drafter.add_context(step.hidden, step.batch.draft_cache)
        rewind(step.batch.draft_cache, num_drop)

    def observe(self, step: DraftStep, hidden: mx.array, next_tokens: mx.array) -> list[mx.array]:
        cache = step.batch.draft_cache
        self.drafter.add_context(hidden, cache)
        return [a for c in cache for a in c.state if isinstance(a, mx.array)]

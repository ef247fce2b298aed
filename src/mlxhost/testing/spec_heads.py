"""Draft-head fixtures: EAGLE-3 and MTP heads for a model folder, trained on the model's own greedy output.

`build_head_folder(out, model_dir, kind)` writes a checkpoint folder that `--speculative KIND
--speculative-model OUT` serves (engine/spec/heads.py reads it). The head learns, from sequences the
target continued greedily, to guess the target's token two positions past each hidden state it is fed
(teacher forcing, one step, as the first training stage of EAGLE and MTP does); tools/train_spec_head.py
runs the same training on a real model. `train_steps=0` leaves the random initialization (a head
that is rarely right).
"""

from __future__ import annotations

import pathlib
import random
from collections import Counter
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
from mlx import nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxhost.engine.spec.dflash import DFlashDrafter, save_drafter
from mlxhost.engine.spec.heads import HEADS, save_head
from mlxhost.engine.spec.hidden import HiddenTap
from mlxhost.models.loader import load_model


def head_config(kind: str, target: Any, draft_vocab_size: int | None = None) -> dict:
    """A one-layer head shaped like the target's layers. EAGLE-3: its input (three layers' raw outputs, of
    very different scales in a real model) is normed before `fc`, and `draft_vocab_size` (default: the
    target's) gives it an LM head of its own over that many tokens (`set_draft_vocab`), cheap to draft with."""
    args = target.args
    n = len(target.model.layers)
    if kind == "mtp":
        return {"model_type": "mtp", "num_layers": 1, "hidden_size": args.hidden_size}
    heads = args.num_attention_heads
    layer = {"model_type": "llama", "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
             "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": args.num_key_value_heads,
             "head_dim": getattr(args, "head_dim", None) or args.hidden_size // heads,
             "rms_norm_eps": args.rms_norm_eps, "vocab_size": args.vocab_size,
             "rope_theta": getattr(args, "rope_theta", 10000.0), "tie_word_embeddings": True}
    # Low, middle and high layers, in the hidden_states numbering (i: layer i-1's output), as the
    # Speculators checkpoints give them.
    aux = sorted({min(2, n), max(1, n // 2), n}) if n >= 3 else [1, n, n]
    return {"model_type": "eagle3", "speculators_model_type": "eagle3", "transformer_layer_config": layer,
            "draft_vocab_size": draft_vocab_size or args.vocab_size, "target_hidden_size": args.hidden_size,
            "tie_word_embeddings": True, "norm_before_fc": True, "eagle_aux_hidden_state_layer_ids": aux}


def draft_vocab(sequences: list[list[int]], starts: list[int], size: int, keep=()) -> list[int]:
    """An EAGLE-3 draft vocabulary of `size` ids, sorted: `keep` (end-of-sequence ids), the tokens the target
    output most often in `sequences` (from each one's start), then the lowest ids left (a BPE vocabulary's
    earliest, most frequent merges)."""
    counts = Counter(t for seq, start in zip(sequences, starts) for t in seq[start:])
    chosen = dict.fromkeys([*keep, *(t for t, _ in counts.most_common())])
    i = 0
    while len(chosen) < size:
        chosen.setdefault(i)
        i += 1
    return sorted(list(chosen)[:size])


def set_draft_vocab(head: Any, target: Any, ids: list[int]) -> None:
    """An EAGLE-3 head drafts over `ids` only: `d2t` maps its ids back to the target's, and its LM head starts
    as the target's embedding rows of those tokens (the tied LM head, cut down)."""
    m = head.module
    index = mx.array(ids, dtype=mx.int32)
    m.d2t = index - mx.arange(len(ids), dtype=mx.int32)
    m.lm_head.weight = target.model.embed_tokens(index).astype(m.lm_head.weight.dtype)


def greedy_sequence(target: Any, prompt: list[int], num_new: int) -> list[int]:
    """The prompt continued greedily by `num_new` tokens."""
    cache = make_prompt_cache(target)
    logits = target(mx.array([prompt]), cache=cache)
    out = list(prompt)
    for _ in range(num_new):
        nxt = mx.argmax(logits[:, -1], axis=-1)
        out.append(nxt.item())
        logits = target(nxt[:, None], cache=cache)
    return out


def train_head(head: Any, target: Any, sequences: list[list[int]], starts: list[int], steps: int,
               lr: float = 3e-3, seed: int = 0, log=None, skip_prompt: bool = False, batch_size: int = 1,
               distill: bool = False) -> float:
    """Teacher-forced training, `batch_size` sequences per step (right-padded): pair (target hidden t, token
    t+1) -> token t+2, the loss on positions whose label the target produced (t + 2 >= the sequence's
    start) and, with a draft vocabulary, that it holds. `skip_prompt`: the head is fed only the pairs from
    the first output token on, as it is when serving (its KV starts at the first decode step). The head's
    final norm starts as the target's: its LM head is the target's (or cut from it). `distill` (a head with a
    draft vocabulary): the label is the target's whole next-token distribution over that vocabulary, not only
    its argmax, which carries far more per position of a small data set. Returns the last loss."""
    tap = HiddenTap(target, head.layer_ids)
    module = head.module
    start_as_target(head, target)
    d2t = getattr(module, "d2t", None)
    t2d = None
    if d2t is not None:  # target id -> draft id, -1 outside the draft vocabulary
        ids = (mx.arange(d2t.shape[0], dtype=mx.int32) + d2t).tolist()
        table = [-1] * target.args.vocab_size
        for i, t in enumerate(ids):
            table[t] = i
        t2d = mx.array(table, dtype=mx.int32)
        module.freeze(recurse=False, keys=["d2t"], strict=False)
    data = []
    for seq, start in zip(sequences, starts):
        x = mx.array([seq])
        logits, h = tap(x, [None] * len(target.model.layers))
        s = min(start, len(seq) - 3) if skip_prompt else 0
        y = x[0, s + 2:]
        weight = (mx.arange(s, len(seq) - 2) + 2 >= start)
        soft = ()
        if t2d is not None and distill:  # the target's distribution at t + 1: what token t + 2 was drawn from
            soft = (mx.softmax(logits[0, s + 1:-1][:, mx.array(ids)], axis=-1),)
        elif t2d is not None:
            y = t2d[y]
            weight = weight & (y >= 0)
        mx.eval(h, y, weight, *soft)
        data.append((mx.stop_gradient(h[0, s:-2]), x[0, s + 1:-1], mx.maximum(y, 0), weight.astype(mx.float32),
                     *soft))
    module.train()
    # Shared target weights (a bound embedding) stay as they are.
    shared = _shared_keys(module, target)

    def loss_fn(model, h, x, y, w, soft=None):
        g = head.forward(x, h, [None] * len(model.layers), from_target=True)
        logits = _logits(head, g)
        if soft is None:
            ce = nn.losses.cross_entropy(logits, y, reduction="none")
        else:
            ce = -(soft * nn.log_softmax(logits, axis=-1)).sum(-1)
        return (ce * w).sum() / mx.maximum(w.sum(), 1)

    opt = optim.Adam(learning_rate=optim.cosine_decay(lr, max(steps, 1), lr / 10))
    value_and_grad = nn.value_and_grad(module, loss_fn)
    order, queue = random.Random(seed), []
    loss = mx.array(float("nan"))
    for step in range(steps):
        if len(queue) < batch_size:  # epochs in a fresh random order
            queue += order.sample(range(len(data)), len(data))
        batch, queue = [data[i] for i in queue[:batch_size]], queue[batch_size:]
        loss, grads = value_and_grad(module, *_pad(batch))
        opt.update(module, _drop_shared(grads, shared))
        mx.eval(module.parameters(), opt.state, loss)
        if log is not None and (step % 100 == 0 or step == steps - 1):
            log(f"step {step}: loss {loss.item():.3f}")
    if t2d is not None:
        module.unfreeze(recurse=False, keys=["d2t"], strict=False)
    module.eval()
    return loss.item()


def start_as_target(head: Any, target: Any) -> None:
    """Starts the head as the identity on the target's last hidden state: `fc` passes it through, the layers'
    residual branches add nothing (zero output projections) and the final norm is the target's (MTP: its
    input is already normed, so its argmax is kept), so its first guesses are the target's own next tokens,
    at a sane scale (a random start gives logits so large that training crawls)."""
    m = head.module
    d = m.norm.weight.shape[0]
    if head.kind == "eagle3":
        m.norm.weight = mx.array(target.model.norm.weight).astype(m.norm.weight.dtype)
    width = m.fc.weight.shape[1]  # MTP: [embedding, hidden]; EAGLE-3: its layers' outputs, the last one last
    m.fc.weight = mx.concatenate([mx.zeros((d, width - d)), mx.eye(d)], axis=1).astype(m.fc.weight.dtype)
    m.update(tree_unflatten([(k, mx.zeros_like(v)) for k, v in tree_flatten(m.layers, prefix=".layers")
                             if k.endswith(("o_proj.weight", "down_proj.weight"))]))


def _pad(batch: list[tuple]) -> tuple:
    """Sequences right-padded to the longest (weight 0 there): causal attention keeps padding out of the rest."""
    n = max(b[1].shape[0] for b in batch)

    def pad(a):
        return mx.pad(a, [(0, n - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
    return tuple(mx.stack([pad(b[i]) for b in batch]) for i in range(len(batch[0])))


def build_head_folder(out: str | pathlib.Path, model_dir: str | pathlib.Path, kind: str, train_steps: int = 300,
                      prompts: list[list[int]] | None = None, num_new: int = 64, seed: int = 0) -> pathlib.Path:
    """`prompts`: what the head is trained on (their greedy continuations); default 16 random ones."""
    target = load_model(str(model_dir)).model
    config = head_config(kind, target)
    mx.random.seed(seed)
    head = HEADS[kind](config, target)
    mx.eval(head.module.parameters())
    if train_steps:
        rng = random.Random(seed)
        prompts = prompts or [[rng.randrange(3, 2000) for _ in range(8)] for _ in range(16)]
        sequences = [greedy_sequence(target, p, num_new) for p in prompts]
        train_head(head, target, sequences, [len(p) for p in prompts], train_steps, seed=seed)
    return save_head(head, config, out)


def _logits(head: Any, g: mx.array) -> mx.array:
    if head.kind == "mtp":
        return head.lm_head(g)
    m = head.module
    h = m.norm(g)
    return m.embed_tokens.as_linear(h) if m.lm_head is None else m.lm_head(h)


def _leaves(tree) -> list:
    return [v for _, v in tree_flatten(tree)]


def _shared_keys(module: nn.Module, target: Any) -> set[str]:
    """The names of the module's parameters that are the target's own arrays (a bound embedding). Taken once,
    before training: each step's `value_and_grad` puts new array objects in the module (and so in the
    target's shared layer), so identities compared later no longer match and the target would be trained."""
    ids = {id(v) for v in _leaves(target.parameters())}
    return {k for k, v in tree_flatten(module.parameters()) if id(v) in ids}


def _drop_shared(grads: dict, shared: set[str]) -> dict:
    """The gradients without the parameters the head shares with the target."""
    return tree_unflatten([(k, g) for k, g in tree_flatten(grads) if k not in shared])


def dflash_config(target: Any, block_size: int = 4) -> dict:
    """A one-layer DFlash drafter shaped like the target, in z-lab's checkpoint layout (`architectures`,
    `dflash_config`); its mask token is the vocabulary's last id, the context the first and last layers."""
    args = target.args
    n = len(target.model.layers)
    heads = args.num_attention_heads
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": args.hidden_size,
            "intermediate_size": args.intermediate_size, "num_hidden_layers": 1, "num_attention_heads": heads,
            "num_key_value_heads": args.num_key_value_heads,
            "head_dim": getattr(args, "head_dim", None) or args.hidden_size // heads,
            "rms_norm_eps": args.rms_norm_eps, "vocab_size": args.vocab_size, "max_position_embeddings": 4096,
            "rope_theta": getattr(args, "rope_theta", 10000.0), "tie_word_embeddings": True,
            "block_size": block_size, "num_target_layers": n,
            "dflash_config": {"mask_token_id": args.vocab_size - 1, "target_layer_ids": sorted({0, n - 1})}}


def train_dflash(drafter: Any, target: Any, sequences: list[list[int]], starts: list[int], steps: int,
                 lr: float = 3e-3, seed: int = 0) -> float:
    """Teacher-forced block training: the context is the target's hidden states from the first output token
    on (what the drafter sees when serving), the block [token t, mask ...] and the labels tokens t+1 ..
    t+K. One random anchor per step, through mlx-vlm's own forward (context and block in one call).
    Returns the last loss."""
    tap = HiddenTap(target, drafter.layer_ids)
    k, mask_id = drafter.block_size - 1, int(drafter.config.mask_token_id)
    data = []
    for seq, start in zip(sequences, starts):
        _, h = tap(mx.array([seq]), [None] * len(target.model.layers))
        mx.eval(h)
        data.append((seq, start, mx.stop_gradient(h)))
    module = drafter.module
    module.train()
    shared = _shared_keys(module, target)

    def loss_fn(model, ctx, block, labels):
        logits = model(block, ctx, [KVCache() for _ in model.layers])[:, 1:]
        return nn.losses.cross_entropy(logits, labels, reduction="mean")

    opt = optim.Adam(learning_rate=lr)
    value_and_grad = nn.value_and_grad(module, loss_fn)
    order = random.Random(seed)
    loss = mx.array(float("nan"))
    for _ in range(steps):
        seq, start, h = data[order.randrange(len(data))]
        t = order.randrange(start + 1, len(seq) - k)
        block = mx.array([[seq[t]] + [mask_id] * k])
        loss, grads = value_and_grad(module, h[:, start:t], block, mx.array([seq[t + 1 : t + 1 + k]]))
        opt.update(module, _drop_shared(grads, shared))
        mx.eval(module.parameters(), opt.state, loss)
    module.eval()
    return loss.item()


def build_dflash_folder(out: str | pathlib.Path, model_dir: str | pathlib.Path, block_size: int = 4,
                        train_steps: int = 0, prompts: list[list[int]] | None = None, num_new: int = 64,
                        seed: int = 0) -> pathlib.Path:
    """A DFlash drafter for the model folder that `--speculative dflash` serves: random weights (drafts
    rarely right, which verification makes harmless), or trained `train_steps` on the model's greedy
    continuations of `prompts` (default 16 random ones)."""
    target = load_model(str(model_dir)).model
    config = dflash_config(target, block_size)
    mx.random.seed(seed)
    drafter = DFlashDrafter(config, target)
    mx.eval(drafter.module.parameters())
    if train_steps:
        rng = random.Random(seed)
        prompts = prompts or [[rng.randrange(3, 2000) for _ in range(8)] for _ in range(16)]
        sequences = [greedy_sequence(target, p, num_new) for p in prompts]
        train_dflash(drafter, target, sequences, [len(p) for p in prompts], train_steps, seed=seed)
    return save_drafter(drafter, config, out)

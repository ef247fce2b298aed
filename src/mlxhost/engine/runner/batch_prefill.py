"""Several prompts' prefill chunks in one forward, for families whose caches take padding.

The rows' own caches (batch 1, of any lengths) are merged into one mlx-lm `BatchKVCache` (`merge`
right-aligns them behind left padding; rope takes each row's offset). Chunks of unequal length are
right-padded, as mlx-lm's `BatchGenerator` does for prompts: causal attention keeps real tokens from
seeing the padding to their right, and `finalize` rolls the padded tail around into left padding so the
rows are right-aligned again. Every row's last chunk token is held back for a second forward of one
token per row: the LM head runs on those B positions only (never B x chunk x vocab), as the first pass's
logits are never evaluated. The rows are then cut back out of the batch cache into per-request caches.

Families whose caches cannot be padded (rotating sliding windows, recurrent `ArraysCache` state,
quantized KV under --kv-bits) and vision-language models keep the one-prompt-per-forward path.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxhost.kv.kinds import KINDS

# Token fed in padded positions; its keys and values are finite and no real token attends to them.
_PAD_TOKEN = 0


def why_not_batched(model: Any, make_cache: Callable[[Any], list[Any]] = make_prompt_cache) -> str | None:
    """None when this model's prompts (with the caches `make_cache` gives them) can be prefilled together;
    otherwise the reason, for the log."""
    if getattr(model, "is_vlm", False):
        return "a vision-language model (positions depend on the images)"
    cache = make_cache(model)
    if not KINDS.can_pad(cache):
        return f"its caches ({', '.join(sorted({type(c).__name__ for c in cache}))}) cannot take padding"
    return None


# Rows whose cache is longer run alone: merging copies every row's cache into the batch and back each step
# (a transient second copy of their KV), which short prompts of a burst pay little for and long contexts
# gain nothing from (their chunk's attention over the context dominates the forward).
MAX_BATCHED_CONTEXT = 4096


def pick_rows(ends: list[int]) -> list[int]:
    """Which rows (by index) to prefill together, given the cache length each reaches with its chunk.

    The merged cache is rectangular: every row is padded to the longest. A row far longer than the others
    (a long prompt deep into its prefill next to new short ones) would make the short rows attend over
    and hold that length; it runs alone instead. Rows are taken shortest first while at least half the
    rectangle is real tokens, up to MAX_BATCHED_CONTEXT."""
    order = sorted((i for i, end in enumerate(ends) if end <= MAX_BATCHED_CONTEXT), key=ends.__getitem__)
    total, picked = 0, []
    for k, i in enumerate(order, start=1):
        total += ends[i]
        if k * ends[i] > 2 * total:
            break
        picked.append(i)
    return sorted(picked) if len(picked) > 1 else []


def prefill_rows(model: Any, caches: list[list[KVCache]], chunks: list[list[int]],
                 bound: Callable[..., None] = mx.eval, pad_to: int = 1,
                 joining: list[bool] | None = None) -> tuple[mx.array, list]:
    """Runs `chunks[i]` (non-empty) after `caches[i]` for every row i in one batch. Returns the lazy
    logits [B, vocab] at each chunk's last token and each row's per-layer caches grown by its chunk
    (new objects: the given caches are left as they were, so a failed forward can be retried).

    A row marked in `joining` (its prompt ends here and it joins the decode batch this step, which
    copies it) is cut out as a view, not a copy: a join of 8 such rows into a 16-row batch (28 layers,
    CPU) took 30 ms instead of 64-127 ms. The others are copied, as they are kept across steps and a
    view would hold the whole batch's buffers.

    `bound` ends the first pass's graph (`mx.eval`, or `mx.async_eval` where a later read waits for it).
    `pad_to` > 1 rounds the first pass's length up to a multiple of it (more right padding), so a server
    meets few distinct forward shapes: on MLX-CUDA every new attention shape costs a cuDNN graph."""
    lengths = [len(c) for c in chunks]
    cached = [layers[0].offset for layers in caches]
    batch = [BatchKVCache.merge(list(layer)) for layer in zip(*caches)]

    body = max(lengths) - 1
    if body > 0:
        body = -(-body // pad_to) * pad_to
        right = [body - (n - 1) for n in lengths]
        tokens = mx.array([c[:-1] + [_PAD_TOKEN] * r for c, r in zip(chunks, right)])
        for c in batch:
            c.prepare(right_padding=right)
        model(tokens, cache=batch)
        for c in batch:
            c.finalize()  # the padded tail becomes left padding: rows end at the same index again
        # Bound the lazy graph, and only the cache: the first pass's LM head is never computed.
        bound([c.state for c in batch])
    logits = model(mx.array([[c[-1]] for c in chunks]), cache=batch)[:, -1, :]

    joining = joining or [False] * len(chunks)
    grown = [[_take_row(c, i, cached[i] + n, copy=not joining[i]) for c in batch] for i, n in enumerate(lengths)]
    return logits, grown


def _take_row(cache: BatchKVCache, row: int, length: int, copy: bool = True) -> KVCache:
    """Row `row`'s last `length` positions (its real tokens; padding sits left of them) as a KVCache."""
    end = cache.size()
    out = KVCache()
    out.keys = cache.keys[row : row + 1, :, end - length : end]
    out.values = cache.values[row : row + 1, :, end - length : end]
    if copy:
        out.keys, out.values = mx.contiguous(out.keys), mx.contiguous(out.values)
    out.offset = length
    return out

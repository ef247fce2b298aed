"""The decode batch: mlx-lm batch caches whose rows are running requests, plus per-row lazy arrays.

Rows can be kept at a few fixed sizes ("buckets"). MLX's CUDA backend compiles kernels for every new
shape it meets, and a batch that wanders over every size from 1 to 64 paid seconds per new size
(docs/BENCHMARKS.md, "Compile stalls on MLX-CUDA"). With buckets the batch is padded with filler rows —
copies of a live row, so they hold finite values — and only a handful of shapes ever exist.

A batch of one plain-KV row decodes through mlx-lm's own `KVCache` (the "lean" path): no left-padding
mask, one integer rope offset — what `generate_step` runs. The batch cache's mask and per-row offsets
cost a single stream much of its speed (docs/BENCHMARKS.md, "The decode batch").
The row is copied out once when it is left alone and merged back when another joins.

With buckets, a finished row stays as a filler and a prompt that joins later is written into its slot
in place (`_fill_slots`): its keys and values right-aligned at the batch's write position, its left
padding and offset set. Before, every join removed the fillers and re-padded the batch, two gathers
and a concatenation of the whole batch's KV, each many times the cost of writing a row into a slot
(docs/BENCHMARKS.md, "The decode batch"). The batch shrinks only once
its live rows fit in a bucket under half its size, so traffic that hovers near a bucket boundary does
not shrink and regrow it every few steps.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxhost.engine.runner.kv_prealloc import reserve
from mlxhost.kv.kinds import KINDS


def make_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of about 1.5x (12, 16, 24, 32, 48, 64, ...), ending at max_num_seqs."""
    sizes, n = [], 1
    while n < max_num_seqs:
        sizes.append(n)
        n = n * 2 if n < 8 else (n * 3 // 2 if n & (n - 1) == 0 else n * 4 // 3)
    sizes.append(max_num_seqs)
    return sizes


def can_batch(cache: list[Any]) -> bool:
    """Whether every layer's cache kind has a batch version (kv/kinds; mlx-lm's `merge`). Those that do not
    (e.g. chunked KV, or mlx-lm's own QuantizedKVCache) are served one sequence at a time; `--kv-bits`
    uses kv/kinds/quantized.py's batchable subclass instead."""
    return KINDS.can_batch(cache)


def rewind(cache: list[Any], num_drop: list[int]) -> None:
    """Drops the last `num_drop[i]` positions of row i from every layer of a batch KV cache (a rejected
    draft's). mlx-lm's `BatchKVCache.trim` drops the same count from every row; the rows that drop more
    are then shifted right by the rest through its own right-padding path (`prepare(right_padding=...)`
    and `finalize()`: the row rolls, its tail wraps into the left padding, which the mask hides)."""
    if not num_drop:
        return
    common = min(num_drop)
    rest = [n - common for n in num_drop]
    for c in cache:
        if common:
            c.trim(common)
        if any(rest):
            c.prepare(right_padding=rest)
            c.finalize()


def _merge(caches: list[list[Any]]) -> list[Any]:
    """Per-request caches (batch 1) -> one batch cache per layer, through mlx-lm's `merge`. A single
    request's own caches serve as they are when their kind has no batch version."""
    if len(caches) == 1 and not can_batch(caches[0]):
        return list(caches[0])
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]


class DecodeBatch:
    """Owns the rows' caches and next tokens; every reindexing goes through `_take`."""

    def __init__(self, buckets: list[int] | None = None, kv_prealloc_tokens: int = 0, lean: bool = True) -> None:
        self.buckets = buckets
        # A lone row through mlx-lm's KVCache, and joins into filler slots; off, every row stays in batch
        # caches joined by mlx-lm's extend (the path before either existed).
        self.lean = lean
        self.kv_prealloc_tokens = kv_prealloc_tokens  # KV width reserved after each join (0: off)
        self.row_ids: list[str | None] = []  # None: a filler row
        self.cache: list[Any] = []
        self.tokens: mx.array | None = None  # [B] sampled, not yet fed (lazy)
        # [B] position each row's next fed token takes (rope delta included); kept only for models that
        # take explicit positions (VLMs: a row's position is not its cache length after an image).
        self.positions: mx.array | None = None
        # Speculative decoding with a draft model: its batch cache, row for row beside `cache`.
        self.draft_cache: list[Any] | None = None
        # The rows' left padding on the host (plain batch caches), read once after mlx-lm's merge, extend
        # or filter changed it and kept up to date by slot joins and trims; None: not read since.
        self._pads: list[int] | None = None

    @property
    def num_live(self) -> int:
        return sum(rid is not None for rid in self.row_ids)

    def __len__(self) -> int:
        return len(self.row_ids)

    def _bucket(self, n: int) -> int:
        if not self.buckets or n == 0:
            return n
        return next((b for b in self.buckets if b >= n), n)

    @property
    def is_lean(self) -> bool:
        return bool(self.cache) and type(self.cache[0]) is KVCache

    def left_padding(self, row: int) -> int | None:
        """The row's left padding without a device sync in the common case: reading it from the cache
        (`.item()`) waits for every step in flight, once per stored row. None where the caches are not
        all plain batch KV (the caller reads the cache)."""
        if self.is_lean:
            return 0
        if not self.cache or not all(type(c) is BatchKVCache for c in self.cache):
            return None
        return self._host_pads()[row]

    def _host_pads(self) -> list[int]:
        """The host copy of the rows' left padding (plain batch caches), read from the device only when
        mlx-lm's merge, extend or filter or a speculative rewind has moved it since."""
        if self._pads is None:
            self._pads = self.cache[0].state[3].tolist()
        return self._pads

    def advance(self, tokens: mx.array, num_accepted: mx.array | None = None,
                num_drop: list[int] | None = None) -> None:
        """A decode step's outcome: each row's next token to feed [B]. After a speculative step also each
        row's accepted drafts [B] (explicit positions move past them) and the positions it rejected, which
        its KV drops (`rewind` rolls rows into their left padding, so the host copy is read again)."""
        if num_drop is not None:
            rewind(self.cache, num_drop)
            self._pads = None
        self.tokens = tokens
        if self.positions is not None:
            self.positions = self.positions + 1 if num_accepted is None else self.positions + 1 + num_accepted

    def _settle(self) -> None:
        """One live row, nothing padded, plain KV in every layer: switch to mlx-lm's KVCache."""
        if (self.lean and len(self.row_ids) == 1 and self.row_ids[0] is not None and self.positions is None
                and not self.kv_prealloc_tokens and self.cache
                and all(type(c) is BatchKVCache for c in self.cache)):
            self.cache = [c.extract(0) for c in self.cache]
            self._pads = None

    def _unsettle(self) -> None:
        if self.is_lean:
            self.cache = [BatchKVCache.merge([c]) for c in self.cache]
            self._pads = None

    def _take(self, idx: list[int]) -> None:
        self._pads = None  # mlx-lm's filter moves rows and trims shared padding
        if not idx:
            self.row_ids, self.cache, self.tokens, self.positions = [], [], None, None
            self.draft_cache = None
            return
        if idx == list(range(len(self.row_ids))):
            return
        self._unsettle()
        index = mx.array(idx)
        for c in [*self.cache, *(self.draft_cache or ())]:
            c.filter(index)
        self.tokens = self.tokens[index]
        if self.positions is not None:
            self.positions = self.positions[index]
        self.row_ids = [self.row_ids[i] for i in idx]

    def _layout(self, live: list[int]) -> list[int]:
        """Indices for the live rows followed by fillers up to the bucket size."""
        target = self._bucket(len(live))
        return live + [live[-1]] * (target - len(live)) if live else []

    def drop(self, request_ids: set[str]) -> None:
        """Finished rows become fillers; the batch shrinks only when a smaller bucket fits."""
        if not request_ids.intersection(self.row_ids):
            return
        self.row_ids = [None if rid in request_ids else rid for rid in self.row_ids]
        live = [i for i, rid in enumerate(self.row_ids) if rid is not None]
        smaller = self._bucket(len(live))
        # Bucketed, the batch keeps its fillers (slots for later joins) until its live rows fit in a bucket
        # under half its size.
        if not live or (smaller * 2 < len(self.row_ids) if self.buckets else smaller < len(self.row_ids)):
            self._take(self._layout(live))
            self.row_ids[len(live):] = [None] * (len(self.row_ids) - len(live))
        self._settle()

    def join(
        self, request_ids: list[str], caches: list[list[Any]], tokens: mx.array, positions: mx.array | None = None,
        draft_caches: list[list[Any]] | None = None,
    ) -> None:
        """Adds requests whose prefill just finished, with their first sampled tokens [k] (and the
        positions those tokens take, for models that need them; the draft model's caches of their
        prompts, with speculative decoding by a draft model)."""
        if (self.lean and not self.row_ids and len(request_ids) == 1 and positions is None
                and not self.kv_prealloc_tokens and all(type(c) is KVCache for c in caches[0])):
            # A lone request keeps its prefill cache: no merge into a batch cache and back out.
            self.row_ids, self.cache, self.tokens, self.positions = list(request_ids), list(caches[0]), tokens, None
            # A draft model's cache stays a batch cache: speculation rewinds it per row.
            self.draft_cache = _merge(draft_caches) if draft_caches is not None else None
            return
        if self._fill_slots(request_ids, caches, tokens, positions, draft_caches):
            return
        self._unsettle()
        live = [i for i, rid in enumerate(self.row_ids) if rid is not None]
        num_live = len(live) + len(request_ids)
        if self.row_ids and len(live) < len(self.row_ids):
            self._take(live)  # fillers out; they come back after the new rows
        new = _merge(caches)
        if draft_caches is not None:
            new_draft = _merge(draft_caches)
            if self.draft_cache:
                for c, n in zip(self.draft_cache, new_draft):
                    c.extend(n)
            else:
                self.draft_cache = new_draft
        if self.cache:
            for c, n in zip(self.cache, new):
                c.extend(n)
            self.tokens = mx.concatenate([self.tokens, tokens])
            if positions is not None:
                self.positions = mx.concatenate([self.positions, positions])
        else:
            self.cache, self.tokens, self.positions = new, tokens, positions
        if self.kv_prealloc_tokens:
            reserve(self.cache, self.kv_prealloc_tokens)
        self._pads = None  # extend pads the old rows or the new ones
        self.row_ids = self.row_ids + list(request_ids)
        target = self._bucket(num_live)
        if target > num_live:
            self._take(list(range(num_live)) + [num_live - 1] * (target - num_live))
            self.row_ids[num_live:] = [None] * (target - num_live)
        self._settle()

    def _fill_slots(self, request_ids: list[str], caches: list[list[Any]], tokens: mx.array,
                    positions: mx.array | None, draft_caches: list[list[Any]] | None) -> bool:
        """Writes the joining rows into filler slots, in place; False (nothing done) where it cannot:
        too few fillers, a row longer than the batch's write position, cache kinds other than plain KV,
        explicit positions (VLMs), a draft model's caches (merged whole) or reserved KV. n-gram
        speculation's rewinds move rows' padding (`advance`)."""
        free = [i for i, rid in enumerate(self.row_ids) if rid is None]
        if (not self.lean or self.kv_prealloc_tokens or positions is not None or draft_caches is not None
                or self.draft_cache is not None or self.positions is not None or len(request_ids) > len(free) or not self.cache
                or not all(type(c) is BatchKVCache for c in self.cache)
                or not all(type(c) is KVCache for row in caches for c in row)):
            return False
        width = self.cache[0].state[4]
        lengths = [row[0].offset for row in caches]
        if max(lengths) > width:
            return False
        slots = free[: len(request_ids)]
        pads = self._host_pads()
        at = mx.array(slots)
        for layer, c in enumerate(self.cache):
            keys, values, offset, left, idx = c.state
            for slot, row, n in zip(slots, caches, lengths):
                k, v, _ = row[layer].state  # buffers possibly wider than the row's n positions
                keys[slot: slot + 1, :, idx - n: idx, :] = k[..., :n, :]
                values[slot: slot + 1, :, idx - n: idx, :] = v[..., :n, :]
            offset[at] = mx.array(lengths)
            left[at] = mx.array([idx - n for n in lengths])
            c.state = (keys, values, offset, left, idx)
        for slot, n in zip(slots, lengths):
            pads[slot] = width - n
        self.tokens[at] = tokens
        for slot, rid in zip(slots, request_ids):
            self.row_ids[slot] = rid
        self._trim()
        return True

    def _trim(self, at_least: int = 64) -> None:
        """Cuts the positions every live row has as left padding, once they are `at_least`: a batch whose
        slots are refilled never empties, and its write position would otherwise only grow (the width
        every step's attention covers). One copy of the batch's KV per `at_least` positions costs less than
        attention over them every step (docs/BENCHMARKS.md, "The decode batch")."""
        left = self._host_pads()
        cut = min(left[i] for i, rid in enumerate(self.row_ids) if rid is not None)
        if cut < at_least:
            return
        for c in self.cache:
            keys, values, offset, pad, idx = c.state
            c.state = (keys[..., cut:, :], values[..., cut:, :], offset, mx.maximum(pad - cut, 0), idx - cut)
        self._pads = [max(p - cut, 0) for p in left]

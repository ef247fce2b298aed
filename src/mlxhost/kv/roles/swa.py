"""The "swa" role: sliding-window layers (mlx-lm's rotating caches), kept per block while in the window.

A block holds these layers' keys and values of its positions (the "kv" role's layout, a second array) when
they were still in the window at store time; a hit needs them only for the blocks covering the window where
it resumes. A rotating cache keeps only its last window, so the prefill copies each block still inside it.
On the SSD tier they have their own files (the "windows" folder): a hit reads them back only for the few
blocks inside the window, not for the whole chain (Gemma 3 4B: 29 of 34 layers slide).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlxhost.kv.kinds.plain import cat
from mlxhost.kv.kinds.registry import KV, SWA
from mlxhost.kv.roles.base import CacheRole, Tensors, check_rows, from_bytes

if TYPE_CHECKING:
    from mlxhost.kv.kinds.layout import KVLayout


@dataclass
class Window:
    """The sliding layers' KV of the last positions a rotating cache still holds, in temporal order:
    `kv` [layers, kv_heads, n, width] covers positions [offset - n, offset)."""

    offset: int
    kv: mx.array

    def block(self, start: int, size: int) -> mx.array | None:
        """A copy of positions [start, start + size), or None if some left the window."""
        n = self.kv.shape[2]
        if start < self.offset - n or start + size > self.offset:
            return None
        i = n - (self.offset - start)
        return mx.contiguous(self.kv[:, :, i : i + size])


def read_row_window(batch_cache: list[Any], layers: tuple[int, ...], row: int) -> Window:
    """One decode-batch row's sliding window, through mlx-lm's `extract` (ring order and left padding
    undone there)."""
    rows = [batch_cache[i].extract(row) for i in layers]
    return Window(rows[0].offset, mx.stack([cat(c.keys[0], c.values[0]) for c in rows]))


def read_prefill_window(cache: list[Any], layers: tuple[int, ...]) -> Window | None:
    """A batch-1 rotating cache right after a multi-token forward: mlx-lm's concatenating update keeps
    it in temporal order and holds every position of that forward (plus the window before it)."""
    caches = [cache[i] for i in layers]
    n = caches[0].keys.shape[2]
    if any(c._idx != n for c in caches):  # not the temporal order of a concatenating update
        return None
    return Window(caches[0].offset, mx.stack([cat(c.keys[0], c.values[0]) for c in caches]))


class SlidingRole(CacheRole):
    name = SWA
    optional = True
    captures = True
    ssd_folder, ssd_stats, ssd_mark = "windows", "windows", "window"

    def first_needed(self, layout: KVLayout, num_tokens: int) -> int:
        """The last `window` positions, as many as mlx-lm's rotating cache would hold there."""
        return num_tokens - min(layout.window, num_tokens)

    def read_blocks(self, cache, layout, row, pad, starts, block_size):
        layers = self.layers(layout)
        window = read_row_window(cache, layers, row) if row is not None else read_prefill_window(cache, layers)
        return [window.block(s, block_size) if window is not None else None for s in starts]

    def capture_blocks(self, cache, layout, start, stop, num_cached, block_size):
        if stop - start < 2:  # a one-token forward's update rotates in place: not in temporal order
            return {}
        window = read_prefill_window(cache, self.layers(layout))
        if window is None:
            return {}
        bs, out = block_size, {}
        lowest = max(num_cached, window.offset - window.kv.shape[2])
        for b in range(-(-lowest // bs) * bs, stop - bs + 1, bs):
            block = window.block(b, bs)
            if block is not None:
                out[b] = block
        return out

    def fill(self, cache: list[Any], layout: KVLayout, swa: list[mx.array], num_tokens: int) -> None:
        """From the blocks covering the window (`swa`, in order, ending at `num_tokens`)."""
        d = layout.key_width
        win = mx.concatenate(swa, axis=2) if len(swa) > 1 else swa[0]
        n = num_tokens - self.first_needed(layout, num_tokens)
        win = win[:, :, win.shape[2] - n :]
        for j, i in enumerate(self.layers(layout)):
            keys, values = win[j, :, :, :d][None], win[j, :, :, d:][None]
            c = cache[i]
            # The state mlx-lm's rotating cache has after a concatenating update of these positions:
            # temporal order, write index at the end, nothing kept at the front.
            c.state = (mx.contiguous(keys), mx.contiguous(values), num_tokens, 0, c.max_size, n)

    def to_tensors(self, part: mx.array) -> dict[str, mx.array]:
        return {"swa": part}

    def from_tensors(self, tensors: Tensors, layout: KVLayout, dtype: mx.Dtype) -> mx.array | None:
        if "swa" not in tensors:
            return None
        swa = from_bytes(*tensors["swa"], dtype)
        check_rows(swa, len(self.layers(layout)))
        return swa

    def ssd_share(self, layout: KVLayout, left: int) -> int:
        # Half of what is left: window files exist only for the few blocks inside a window, block files for
        # every block (gemma3-4b: ~150 MB of each at a 4k prefix, 150 vs 640 MB at 32k). Without attention
        # layers block files hold no KV: most goes to windows.
        share = left // 2 if layout.layers_of(KV) else left - min(left // 2, 64 << 20)
        return max(1, min(share, left - 1))


SWA_ROLE = SlidingRole()

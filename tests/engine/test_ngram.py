"""Prompt lookup (n-gram drafts) and the per-row KV rewind, without a model."""

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxhost.engine.runner.batch import rewind
from mlxhost.engine.spec.ngram import NgramIndex


def test_proposes_what_followed_the_latest_match_of_the_longest_tail():
    index = NgramIndex()
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    # Tail (1, 2, 3) last seen at 0..2, followed by 4 5 9; the shorter (2, 3) would say 7 8.
    assert index.propose(3) == [4, 5, 9]
    # Past the history's end the match runs on into the draft: period 10 here.
    assert index.propose(12) == [4, 5, 9, 2, 3, 7, 8, 1, 2, 3, 4, 5]
    index.extend([6])
    assert index.propose(4) == []  # (3, 6) never seen before
    index.extend([1, 2])
    assert index.propose(2) == [3, 6]  # the latest earlier (1, 2) is the one followed by 3 6
    assert index.propose(0) == []


def test_a_loop_drafts_k_tokens():
    index = NgramIndex()
    index.extend([8, 1, 2, 1, 2, 1, 2])
    assert index.propose(5) == [1, 2, 1, 2, 1]
    index.extend([7, 7, 7])
    assert index.propose(3) == [7, 7, 7]


def test_incremental_index_equals_a_fresh_one():
    toks = [5, 6, 5, 6, 7, 5, 6, 5, 6, 7, 5]
    a, b = NgramIndex(), NgramIndex()
    for t in toks:
        a.extend([t])
    b.extend(toks)
    assert a.propose(4) == b.propose(4) == [6, 5, 6, 7]


def _cache(rows: list[list[float]]) -> BatchKVCache:
    """A batch cache whose row i holds positions with values rows[i] (left-padded)."""
    width = max(len(r) for r in rows)
    pad = [width - len(r) for r in rows]
    data = mx.array([[0.0] * p + r for p, r in zip(pad, rows)])[:, None, :, None]
    c = BatchKVCache(pad)
    c.update_and_fetch(data, data)
    return c


def _rows(c: BatchKVCache) -> list[list[float]]:
    keys, _ = c.keys_and_values()
    pad = c.left_padding.tolist()
    return [keys[i, 0, pad[i]:, 0].tolist() for i in range(keys.shape[0])]


def test_rewind_drops_each_rows_own_tail():
    c = _cache([[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]])
    rewind([c], [2, 0, 3])
    assert _rows(c) == [[1, 2, 3], [6, 7, 8], [9]]
    assert c.offset.tolist() == [3, 3, 1]
    # The next write lands right after each row's kept positions.
    new = mx.array([[13.0], [14.0], [15.0]])[:, None, :, None]
    c.update_and_fetch(new, new)
    assert _rows(c) == [[1, 2, 3, 13], [6, 7, 8, 14], [9, 15]]

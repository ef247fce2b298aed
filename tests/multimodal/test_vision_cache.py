"""VisionCache: LRU by bytes, replacement, oversize entries, counters."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxhost.multimodal.vision_cache import VisionCache, VisionCacheEntry


def entry(n: int, deepstack: int = 0) -> VisionCacheEntry:
    """n float32 values of features (4n bytes), plus `deepstack` layers of the same size."""
    arrays = {"features": mx.zeros((n,), dtype=mx.float32)}
    if deepstack:
        arrays["deepstack"] = [mx.zeros((n,), dtype=mx.float32) for _ in range(deepstack)]
    return VisionCacheEntry(arrays, {"num_tokens": n})


def test_nbytes_counts_every_array():
    assert entry(10).nbytes == 40
    assert entry(10, deepstack=3).nbytes == 160
    grid = VisionCacheEntry({"features": mx.zeros((2, 3), dtype=mx.float16), "grid_thw": mx.array([[1, 2, 3]])})
    assert grid.nbytes == 12 + 12


def test_get_put_and_counters():
    cache = VisionCache(max_bytes=1000)
    assert cache.get("a") is None
    e = entry(10)
    assert cache.put("a", e)
    assert cache.get("a") is e and "a" in cache and len(cache) == 1
    assert cache.stats() == {"entries": 1, "bytes": 40, "max_bytes": 1000, "hits": 1, "misses": 1,
                             "evictions": 0}


def test_evicts_least_recently_used_until_it_fits():
    cache = VisionCache(max_bytes=120)  # room for three entries of 40 bytes
    for key in "abc":
        cache.put(key, entry(10))
    cache.get("a")  # a is now the most recent; b is the oldest
    cache.put("d", entry(10))
    assert "b" not in cache and all(k in cache for k in "acd")
    cache.put("e", entry(20))  # 80 bytes: evicts c then a
    assert [k for k in "acde" if k in cache] == ["d", "e"]
    assert cache.stats()["evictions"] == 3 and cache.num_bytes == 120


def test_replace_and_oversize():
    cache = VisionCache(max_bytes=100)
    cache.put("a", entry(10))
    cache.put("a", entry(20))
    assert len(cache) == 1 and cache.num_bytes == 80
    assert not cache.put("huge", entry(30))  # 120 bytes never fits; nothing is evicted for it
    assert "huge" not in cache and "a" in cache and cache.stats()["evictions"] == 0
    assert not cache.put("a", entry(30))  # a too-large replacement drops the old entry as well
    assert len(cache) == 0 and cache.num_bytes == 0


def test_zero_bytes_disables_and_clear():
    assert not VisionCache(0).put("a", entry(1))
    cache = VisionCache(1000)
    cache.put("a", entry(10))
    cache.get("a")
    cache.clear()
    assert cache.stats()["entries"] == 0 and cache.stats()["bytes"] == 0 and cache.get("a") is None
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 1
    with pytest.raises(ValueError):
        VisionCache(-1)


def test_set_max_bytes_evicts_least_recent_down_to_the_new_size():
    import mlx.core as mx

    from mlxhost.multimodal.vision_cache import VisionCache, VisionCacheEntry

    cache = VisionCache(1 << 20)
    for key in "abc":
        cache.put(key, VisionCacheEntry({"features": mx.zeros((256,), dtype=mx.float32)}))  # 1 KiB each
    cache.get("a")  # a is now the most recent
    assert cache.set_max_bytes(1024) == 2
    assert "a" in cache and "b" not in cache and "c" not in cache
    assert cache.num_bytes == 1024 and cache.max_bytes == 1024

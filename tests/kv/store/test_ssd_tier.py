import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mlxhost.kv.hashing import disk_key, hash_block
from mlxhost.kv.store.ssd_format import FORMAT_VERSION, BlockData, BlockMeta
from mlxhost.kv.store.ssd_tier import SSDTier

BS = 4
META = BlockMeta(model_key="test/model@cafe", block_size=BS, num_layers=2, dtype="bfloat16")
SHAPE = (2, BS, 8)  # (kv heads, tokens, head dim) of bfloat16: 2 bytes per element


def make_block(i, block_size=BS, shape=SHAPE, num_layers=2):
    """Block i of a deterministic sequence: tokens i*bs.. and random bytes seeded by i."""
    tokens = tuple(range(i * block_size, (i + 1) * block_size))
    rng = np.random.default_rng(i)
    nbytes = int(np.prod(shape)) * 2
    tensors = {
        f"l{layer}.{kv}": (rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes(), tuple(shape))
        for layer in range(num_layers)
        for kv in "kv"
    }
    return hash_block(None, tokens), BlockData(tokens, tensors)


def path_of(tier, block_hash):
    return tier.directory / (disk_key(block_hash) + ".safetensors")


def files(directory, suffix=".safetensors"):
    return sorted(p.name for p in Path(directory).iterdir() if p.name.endswith(suffix))


@pytest.fixture
def tier(tmp_path):
    t = SSDTier(tmp_path / "ssd", 1 << 20, META)
    yield t
    t.close()


def stored(tier, i):
    """Put block i, wait until it is on disk, return (hash, block)."""
    h, block = make_block(i)
    assert tier.put(h, block)
    assert tier.flush(timeout=30)
    return h, block


def test_round_trip(tier):
    h, block = stored(tier, 0)
    assert tier.contains(h) and path_of(tier, h).exists()
    got = tier.get(h, list(block.token_ids))
    assert got == block  # same tokens, same bytes, same shapes
    assert all(type(buf) is bytes for buf, _ in got.tensors.values())
    assert list(got.tensors) == ["l0.k", "l0.v", "l1.k", "l1.v"]
    assert not tier.put(h, block)  # already stored
    assert not tier.contains(make_block(1)[0])


def test_files_are_plain_safetensors(tier):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    h, block = stored(tier, 3)
    arrays = load_file(str(path_of(tier, h)))
    for name, (buf, _) in block.tensors.items():
        assert arrays[name].dtype == np.uint8 and arrays[name].tobytes() == buf
    with safe_open(str(path_of(tier, h)), framework="np") as f:
        meta = f.metadata()
    assert meta["model_key"] == META.model_key and meta["dtype"] == "bfloat16"
    assert meta["block_size"] == str(BS) and meta["num_layers"] == "2" and meta["format_version"] == str(FORMAT_VERSION)
    assert meta["token_ids"] == "[12,13,14,15]" and len(meta["sha256"]) == 64


def test_survives_restart(tmp_path):
    tier = SSDTier(tmp_path, 1 << 20, META)
    blocks = [stored(tier, i) for i in range(3)]
    tier.close()
    again = SSDTier(tmp_path, 1 << 20, META)
    stats = again.stats()
    assert stats["num_blocks"] == 3
    assert stats["bytes"] == sum(p.stat().st_size for p in tmp_path.iterdir())
    for h, block in blocks:
        assert again.contains(h) and again.get(h, block.token_ids) == block
    again.close()


def test_token_mismatch_is_a_miss(tier):
    h, block = stored(tier, 0)
    assert tier.get(h, [9, 9, 9, 9]) is None
    # A file whose tokens do not match its hash can never serve that hash: it goes.
    assert not path_of(tier, h).exists() and not tier.contains(h)
    stats = tier.stats()
    assert stats["collisions"] == 1 and stats["misses"] == 1 and stats["hits"] == 0


def test_truncated_file_is_a_miss_and_removed(tier):
    h, block = stored(tier, 0)
    path = path_of(tier, h)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert tier.get(h, block.token_ids) is None
    assert not path.exists() and not tier.contains(h)
    assert tier.stats()["corrupt_removed"] == 1 and tier.stats()["bytes"] == 0


@pytest.mark.parametrize("size", [0, 5, 8, 200])
def test_truncated_file_is_removed_at_scan(tmp_path, size):
    tier = SSDTier(tmp_path, 1 << 20, META)
    h, block = stored(tier, 0)
    tier.close()
    path = path_of(tier, h)
    path.write_bytes(path.read_bytes()[:size])
    again = SSDTier(tmp_path, 1 << 20, META)
    assert not again.contains(h) and not path.exists()
    assert again.stats()["corrupt_removed"] == 1
    assert again.get(h, block.token_ids) is None
    again.close()


def test_flipped_data_byte_fails_the_checksum(tier):
    h, block = stored(tier, 0)
    path = path_of(tier, h)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert tier.get(h, block.token_ids) is None
    assert not path.exists() and tier.stats()["corrupt_removed"] == 1


def test_tampered_header_that_still_parses_fails_the_checksum(tier):
    # The checksum covers the shapes too: a flipped digit must not hand out a wrong shape.
    h, block = stored(tier, 0)
    path = path_of(tier, h)
    data = path.read_bytes()
    assert data.count(b"[2,4,8]") == 4
    path.write_bytes(data.replace(b"[2,4,8]", b"[2,4,9]", 1))
    assert tier.get(h, block.token_ids) is None
    assert not path.exists() and tier.stats()["corrupt_removed"] == 1


@pytest.mark.parametrize(
    "change",
    [
        {"model_key": "another/model"},
        {"block_size": 8},
        {"num_layers": 3},
        {"dtype": "float16"},
        {"format_version": FORMAT_VERSION + 1},
    ],
)
def test_foreign_files_are_removed_at_scan(tmp_path, change):
    meta = dataclasses.replace(META, **change)
    writer = SSDTier(tmp_path, 1 << 20, meta)
    h, block = make_block(0, block_size=meta.block_size)
    assert writer.put(h, block) and writer.flush(timeout=30)
    writer.close()
    (tmp_path / "notes.txt").write_text("not ours")  # files that are not blocks are left alone

    tier = SSDTier(tmp_path, 1 << 20, META)
    assert tier.stats()["incompatible_removed"] == 1 and tier.stats()["num_blocks"] == 0
    assert files(tmp_path) == [] and (tmp_path / "notes.txt").exists()
    assert tier.get(h, block.token_ids) is None and tier.stats()["misses"] == 1
    tier.close()


def test_garbage_named_like_a_block_is_removed_at_scan(tmp_path):
    (tmp_path / (disk_key(b"\x01" * 16) + ".safetensors")).write_bytes(os.urandom(100))
    huge = (2**62).to_bytes(8, "little") + b"{}"  # a length prefix we must not trust
    (tmp_path / (disk_key(b"\x02" * 16) + ".safetensors")).write_bytes(huge)
    (tmp_path / (disk_key(b"\x03" * 16) + ".safetensors")).write_bytes(b"\x10" + b"\0" * 7 + b"not json")
    tier = SSDTier(tmp_path, 1 << 20, META)
    assert tier.stats()["corrupt_removed"] == 3 and files(tmp_path) == []
    tier.close()


def test_leftover_temp_files_are_removed_at_scan(tmp_path):
    tier = SSDTier(tmp_path, 1 << 20, META)
    h, block = stored(tier, 0)
    tier.close()
    (tmp_path / (disk_key(h) + ".safetensors.1a2b3c.tmp")).write_bytes(b"half a wri")
    (tmp_path / "other.tmp").write_bytes(b"")
    again = SSDTier(tmp_path, 1 << 20, META)
    assert files(tmp_path, ".tmp") == []
    assert again.get(h, block.token_ids) == block
    again.close()


def block_file_size(tmp_path):
    probe = SSDTier(tmp_path / "probe", 1 << 20, META)
    stored(probe, 0)
    size = probe.stats()["bytes"]
    probe.close()
    return size


def test_size_cap_evicts_least_recently_used(tmp_path):
    size = block_file_size(tmp_path)
    tier = SSDTier(tmp_path / "ssd", 3 * size + size // 2, META)  # room for three blocks
    (a, block_a), (b, _), (c, _) = (stored(tier, i) for i in range(3))
    assert tier.get(a, block_a.token_ids) == block_a  # a is now more recent than b
    d, _ = stored(tier, 3)
    assert not tier.contains(b) and not path_of(tier, b).exists()
    assert all(tier.contains(x) for x in (a, c, d))
    stats = tier.stats()
    assert stats["evictions"] == 1 and stats["num_blocks"] == 3 and stats["bytes"] <= stats["max_bytes"]


def test_restart_keeps_lru_order_and_applies_a_lower_cap(tmp_path):
    size = block_file_size(tmp_path)
    tier = SSDTier(tmp_path / "ssd", 1 << 20, META)
    (a, _), (b, _), (c, _) = (stored(tier, i) for i in range(3))
    tier.close()
    for h, t in ((b, 1_000), (c, 2_000), (a, 3_000)):  # b is the oldest, a the newest
        os.utime(path_of(tier, h), ns=(t * 10**9, t * 10**9))
    again = SSDTier(tmp_path / "ssd", 2 * size + size // 2, META)
    assert not again.contains(b) and again.contains(a) and again.contains(c)
    assert files(tmp_path / "ssd") == sorted(disk_key(h) + ".safetensors" for h in (a, c))
    again.close()


def test_block_larger_than_the_cap_is_dropped(tmp_path):
    tier = SSDTier(tmp_path, 100, META)
    h, block = make_block(0)
    assert not tier.put(h, block)
    assert tier.stats()["dropped_writes"] == 1 and not tier.contains(h)
    tier.close()


def test_put_never_blocks_and_drops_when_the_queue_is_full(tmp_path, monkeypatch):
    tier = SSDTier(tmp_path, 1 << 20, META, writer_queue_size=2)
    started, release = threading.Event(), threading.Event()
    real_write = tier._write_block

    def stuck_write(block_hash, block):  # a disk that does not answer until released
        started.set()
        release.wait()
        return real_write(block_hash, block)

    monkeypatch.setattr(tier, "_write_block", stuck_write)
    blocks = [make_block(i) for i in range(4)]
    h0, b0 = blocks[0]
    assert tier.put(h0, b0)
    assert started.wait(timeout=30)  # the writer holds block 0; the queue is empty again

    results = []
    putter = threading.Thread(target=lambda: results.extend(tier.put(h, b) for h, b in blocks[1:]))
    putter.start()
    putter.join(timeout=30)
    assert not putter.is_alive(), "put blocked on a stuck writer"
    assert results == [True, True, False]  # two fit in the queue, the third is dropped
    stats = tier.stats()
    assert stats["dropped_writes"] == 1 and stats["pending_writes"] == 3 and stats["writes"] == 0
    # Queued blocks are served from memory meanwhile; the dropped one is simply absent.
    assert tier.contains(h0) and tier.get(h0, b0.token_ids) is b0
    assert not tier.contains(blocks[3][0])
    assert not tier.flush(timeout=0.01)

    release.set()
    assert tier.flush(timeout=30)
    assert tier.stats()["writes"] == 3 and len(files(tmp_path)) == 3
    tier.close()


def test_write_errors_are_counted_and_the_writer_lives_on(tier, monkeypatch):
    def failing_write(block_hash, block):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tier, "_write_block", failing_write)
    h, block = make_block(0)
    assert tier.put(h, block) and tier.flush(timeout=30)
    assert not tier.contains(h) and tier.stats()["write_errors"] == 1
    monkeypatch.undo()
    h1, _ = stored(tier, 1)
    assert tier.contains(h1)


def test_clear(tier):
    blocks = [stored(tier, i) for i in range(3)]
    assert tier.clear() == 3
    assert files(tier.directory) == []
    assert tier.stats()["num_blocks"] == 0 and tier.stats()["bytes"] == 0
    h, block = blocks[0]
    assert not tier.contains(h) and tier.get(h, block.token_ids) is None
    assert tier.put(h, block)  # usable again afterwards


def test_stats_counters(tier):
    (a, block_a), (b, block_b) = stored(tier, 0), stored(tier, 1)
    tier.get(a, block_a.token_ids)
    tier.get(b, block_b.token_ids)
    tier.get(make_block(7)[0], make_block(7)[1].token_ids)  # never stored
    stats = tier.stats()
    assert stats["writes"] == 2 and stats["reads"] == 2 and stats["hits"] == 2 and stats["misses"] == 1
    assert stats["num_blocks"] == 2 and stats["bytes"] == sum(p.stat().st_size for p in tier.directory.iterdir())
    assert stats["max_bytes"] == 1 << 20 and stats["pending_writes"] == 0
    assert stats["dropped_writes"] == stats["evictions"] == stats["corrupt_removed"] == 0


def test_close_refuses_puts_and_is_idempotent(tier):
    h, block = make_block(0)
    assert tier.put(h, block)
    tier.close()  # writes what was queued first
    assert path_of(tier, h).exists()
    assert not tier.put(*make_block(1))
    assert tier.get(h, block.token_ids) == block
    tier.close()


def test_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        SSDTier(tmp_path, 0, META)
    tier = SSDTier(tmp_path, 1 << 20, META)
    with pytest.raises(ValueError):
        tier.put(b"h" * 16, BlockData((1, 2, 3), {}))  # not a full block
    strided = memoryview(bytes(64))[::2]
    with pytest.raises(ValueError):
        tier.put(b"h" * 16, BlockData((1, 2, 3, 4), {"l0.k": (strided, (32,))}))
    tier.close()


# Big blocks keep the child inside a write most of the time, so SIGKILL lands mid-write.
CRASH_SHAPE = (8, BS, 1024)

CHILD = """
import sys, time
sys.path.insert(0, sys.argv[2])
from test_ssd_tier import CRASH_SHAPE, META, make_block
from mlxhost.kv.store.ssd_tier import SSDTier
tier = SSDTier(sys.argv[1], 1 << 34, META, writer_queue_size=4)
i = 0
while True:
    h, block = make_block(i, shape=CRASH_SHAPE)
    if tier.put(h, block):
        i += 1
    else:
        time.sleep(0.001)
"""


def test_sigkill_mid_write_leaves_only_valid_blocks(tmp_path):
    directory = tmp_path / "ssd"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), str(Path(__file__).parent)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(files(directory) if directory.exists() else []) < 5:
            assert child.poll() is None, "the writer process died on its own"
            time.sleep(0.01)
        # Prefer to kill while a temp file exists, i.e. inside a write.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not files(directory, ".tmp"):
            time.sleep(0.0005)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    num_files = len(files(directory))
    assert num_files >= 5

    tier = SSDTier(directory, 1 << 34, META)
    stats = tier.stats()
    assert files(directory, ".tmp") == []
    assert stats["corrupt_removed"] == 0 and stats["num_blocks"] == num_files
    unmatched = {bytes.fromhex(name.split(".")[0]) for name in files(directory)}
    i = 0
    while unmatched:  # blocks are written in order, so the stored ones are the first few
        h, expected = make_block(i, shape=CRASH_SHAPE)
        if h in unmatched:
            unmatched.discard(h)
            assert tier.get(h, expected.token_ids) == expected
        i += 1
        assert i < num_files + 1000
    assert tier.stats()["hits"] == num_files and tier.stats()["corrupt_removed"] == 0
    tier.close()

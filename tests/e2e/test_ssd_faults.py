"""The SSD tier of the prefix cache under faults, over HTTP: the server keeps serving correct output.

One server with the prefix cache off gives the reference (greedy, ignore_eos). Server A, with an SSD
directory, serves every prompt and stops cleanly, so its blocks are on disk. Each test works on a copy
of that directory (or, for kill -9, on one of its own) and starts a fresh server on it: after a plain
restart, after damaged files (truncated, flipped bytes, another model's, a hash collision, crash
leftovers), after a SIGKILL of the real CLI mid-write, under a size cap of a few blocks, and with every
write failing as on a full disk. Every answer must be 200 and equal the reference; /v1/cache/stats must
tell what the tier did.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from mlxhost.kv.store.ssd_format import BlockData, BlockMeta
from mlxhost.kv.store.ssd_tier import SSDTier

SERVED_NAME = "tiny"  # the name tests/e2e/conftest.py serves under
BS = 16
PROMPT_LEN = 100  # 6 full blocks; lookups hash prompt[:-1], which still holds 6
NUM_BLOCKS = (PROMPT_LEN - 1) // BS
NUM_PROMPTS = 8
MAX_TOKENS = 8
BLOCK = ".safetensors"
_START_TIMEOUT_S = 120  # bounds for the loops below, not timing checks
_POLL_S = 0.05


# -- helpers -----------------------------------------------------------------------------------------
def complete(live_url: str, prompt: list[int]) -> tuple[str, int]:
    """(text, cached_tokens) of a greedy completion; anything but a 200 fails the test."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True}
    r = httpx.post(live_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == MAX_TOKENS
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def ssd_stats(live_url: str) -> dict:
    r = httpx.get(live_url + "/v1/cache/stats", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["ssd"]


def read_header(path: Path) -> dict:
    """The safetensors JSON header of a block file (its __metadata__ holds the tier's fields)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def block_files(directory: Path) -> dict[tuple[int, ...], Path]:
    """Block files by the token ids they hold (random prompts: no two blocks share them)."""
    return {tuple(json.loads(read_header(p)["__metadata__"]["token_ids"])): p
            for p in directory.iterdir() if p.name.endswith(BLOCK)}


def block_of(prompt: list[int], j: int) -> tuple[int, ...]:
    return tuple(prompt[j * BS : (j + 1) * BS])


def dir_bytes(directory: Path) -> int:
    """Everything in the directory, temp files included."""
    total = 0
    for p in directory.iterdir():
        try:
            total += p.stat().st_size
        except FileNotFoundError:  # the writer renamed or evicted it meanwhile
            pass
    return total


def tmp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def meta_of(path: Path, **changes) -> BlockMeta:
    md = read_header(path)["__metadata__"]
    fields = dict(model_key=md["model_key"], block_size=int(md["block_size"]),
                  num_layers=int(md["num_layers"]), dtype=md["dtype"])
    return BlockMeta(**{**fields, **changes})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def cli_server(model_dir, ssd: Path, log_path: Path, max_file_bytes: int | None = None):
    """`mlxhost serve` as a child process on a free loopback port; yields (process, url), kills it at
    the end. `max_file_bytes` sets RLIMIT_FSIZE in the child: writes past it fail as on a full disk."""
    port = free_port()
    flags = [str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
             "--log-level", "warning", "--block-size", str(BS), "--cache-memory", "64MB", "--max-num-seqs", "8",
             "--ssd-cache-dir", str(ssd), "--ssd-cache-max-size", "100MB"]
    limit = "" if max_file_bytes is None else (
        f"import resource; resource.setrlimit(resource.RLIMIT_FSIZE, ({max_file_bytes}, {max_file_bytes})); ")
    # CPython ignores SIGXFSZ, so a write past the limit raises OSError(EFBIG) instead of killing us.
    launcher = limit + ("import runpy, sys; sys.argv[0] = 'mlxhost'; "
                        "runpy.run_module('mlxhost.server.cli', run_name='__main__')")
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", launcher, "serve", *flags], stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            assert proc.poll() is None, "the server exited:\n" + log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, "no start:\n" + log_path.read_text(errors="replace")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


def wait_for(url: str, done) -> dict:
    """Polls the SSD stats until `done(stats)`; the deadline only bounds the loop."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not done(stats := ssd_stats(url)):
        assert time.monotonic() < deadline, stats
        time.sleep(_POLL_S)
    return stats


# -- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(20240611)
    # Ids well inside the 2048-token vocabulary and past the special tokens at its start.
    return [[rng.randrange(16, 2000) for _ in range(PROMPT_LEN)] for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def reference(qwen3_model_dir, make_module_server, prompts) -> list[str]:
    off = make_module_server(qwen3_model_dir, block_size=BS, enable_prefix_cache=False, max_num_seqs=8)
    texts = [complete(off.url, p)[0] for p in prompts]
    off.stop()
    assert all(texts) and len(set(texts)) > 1  # a model that says one thing would prove nothing
    return texts


@pytest.fixture(scope="module")
def populated(qwen3_model_dir, make_module_server, prompts, reference, tmp_path_factory) -> Path:
    """An SSD directory written by server A: every prompt's blocks, flushed by a clean stop."""
    directory = tmp_path_factory.mktemp("ssd-populated")
    a = make_module_server(qwen3_model_dir, block_size=BS, ssd_cache_dir=str(directory), max_num_seqs=8)
    assert [complete(a.url, p)[0] for p in prompts] == reference
    a.stop()  # the engine's close() spills the last step's blocks and waits for the writer
    files = block_files(directory)
    for p in prompts:
        assert all(block_of(p, j) in files for j in range(NUM_BLOCKS))
    return directory


@pytest.fixture
def ssd_dir(populated, tmp_path) -> Path:
    """A private copy of the populated directory (mtimes kept: they carry the LRU order)."""
    return Path(shutil.copytree(populated, tmp_path / "ssd"))


# -- tests -------------------------------------------------------------------------------------------
def test_restart_serves_identical_greedy_output_from_the_ssd_tier(qwen3_model_dir, make_server, prompts,
                                                                  reference, ssd_dir):
    b = make_server(qwen3_model_dir, block_size=BS, ssd_cache_dir=str(ssd_dir), max_num_seqs=8)
    start = ssd_stats(b.url)
    assert start["num_blocks"] == NUM_PROMPTS * NUM_BLOCKS
    assert start["corrupt_removed"] == start["incompatible_removed"] == 0
    for p, expected in zip(prompts, reference):
        text, cached = complete(b.url, p)
        assert text == expected
        assert cached == NUM_BLOCKS * BS  # fresh memory: every block came from disk
    end = ssd_stats(b.url)
    assert end["hits"] == NUM_PROMPTS * NUM_BLOCKS
    assert end["corrupt_removed"] == end["collisions"] == 0


def test_damaged_files_are_misses_and_the_output_stays_correct(qwen3_model_dir, make_server, prompts,
                                                               reference, ssd_dir, tmp_path):
    files = block_files(ssd_dir)
    good = files[block_of(prompts[5], 0)]
    # Prompt 0: block 0 cut to half its size (found at the start-up scan).
    truncated = files[block_of(prompts[0], 0)]
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size // 2)
    # Prompt 1: block 2 with bytes flipped in the middle, inside the KV data (found by the checksum on read).
    flipped = files[block_of(prompts[1], 2)]
    raw = bytearray(flipped.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + 8] = bytes(b ^ 0xFF for b in raw[mid : mid + 8])
    flipped.write_bytes(bytes(raw))
    # Prompt 2: block 1 replaced by a well-formed file from another model: same name, hash and tokens,
    # random KV. Served, it would change the output.
    foreign = files[block_of(prompts[2], 1)]
    header = read_header(foreign)
    md = header["__metadata__"]
    begin, end = header["kv"]["data_offsets"]
    shape = tuple(json.loads(md["shapes"])[0][1])
    other = SSDTier(tmp_path / "other", 1 << 30, meta_of(foreign, model_key="another-model"))
    data = random.Random(0).randbytes(end - begin)
    assert other.put(bytes.fromhex(md["block_hash"]), BlockData(block_of(prompts[2], 1), {"kv": (data, shape)}))
    other.close()
    shutil.copyfile(other.directory / foreign.name, foreign)
    # Prompt 3: block 3 with garbage over its JSON header.
    garbled = files[block_of(prompts[3], 3)]
    raw = bytearray(garbled.read_bytes())
    raw[8:40] = b"\xff" * 32
    garbled.write_bytes(bytes(raw))
    # Prompt 4: block 0's name over a well-formed file of ours that holds other tokens (a hash collision).
    collided = files[block_of(prompts[4], 0)]
    same = SSDTier(tmp_path / "same", 1 << 30, meta_of(collided))
    other_tokens = tuple(t + 1 for t in block_of(prompts[4], 0))
    assert same.put(bytes.fromhex(collided.name[: -len(BLOCK)]), BlockData(other_tokens, {"kv": (data, shape)}))
    same.close()
    shutil.copyfile(same.directory / collided.name, collided)
    # Crash leftovers: an empty block file and a half-written temp file as the writer names them.
    empty = ssd_dir / ("ab" * 16 + BLOCK)
    empty.touch()
    leftover = ssd_dir / (good.name + ".0123456789ab.tmp")
    leftover.write_bytes(good.read_bytes()[:1000])

    b = make_server(qwen3_model_dir, block_size=BS, ssd_cache_dir=str(ssd_dir), max_num_seqs=8)
    start = ssd_stats(b.url)
    assert start["corrupt_removed"] == 3  # truncated, garbled, empty
    assert start["incompatible_removed"] == 1
    assert start["num_blocks"] == NUM_PROMPTS * NUM_BLOCKS - 3
    for path in (truncated, foreign, garbled, empty, leftover):
        assert not path.exists(), path.name
    assert not tmp_files(ssd_dir)

    # The chain of cached blocks stops at the first damaged one.
    expected_cached = [0, 2 * BS, 1 * BS, 3 * BS, 0] + [NUM_BLOCKS * BS] * (NUM_PROMPTS - 5)
    for i, p in enumerate(prompts):
        text, cached = complete(b.url, p)
        assert text == reference[i], f"prompt {i}"
        assert cached == expected_cached[i], f"prompt {i}"
    end = ssd_stats(b.url)
    assert end["corrupt_removed"] == 4  # + the flipped one, dropped when read
    assert end["collisions"] == 1
    assert end["misses"] >= 1
    b.stop()  # flushes the recomputed blocks

    # The damaged blocks were recomputed and written again; every file on disk now reads back whole.
    reopened = SSDTier(ssd_dir, 1 << 30, meta_of(good))
    try:
        assert reopened.stats()["corrupt_removed"] == reopened.stats()["incompatible_removed"] == 0
        assert reopened.stats()["num_blocks"] == NUM_PROMPTS * NUM_BLOCKS
        for tokens, path in block_files(ssd_dir).items():
            assert reopened.get(bytes.fromhex(path.name[: -len(BLOCK)]), tokens) is not None, path.name
    finally:
        reopened.close()


def test_kill_9_while_writing_then_restart_serves_correct_output(qwen3_model_dir, make_server, prompts,
                                                                 reference, tmp_path):
    ssd = tmp_path / "ssd"
    with cli_server(qwen3_model_dir, ssd, tmp_path / "server.log") as (proc, url):
        # A request's blocks are handed to the writer in the engine's next step: after 4 requests in
        # a row, those of the first 3 are queued or written.
        for p in prompts[:4]:
            complete(url, p)
        wait_for(url, lambda s: s["writes"] >= 3 * NUM_BLOCKS)

        # Traffic goes on (the reference prompts left, then throwaway ones), so every step hands the last
        # one's blocks to the writer; kill the moment a new file shows a block write under way.
        written = set(os.listdir(ssd))
        rng = random.Random(7)
        burst = prompts[4:] + [[rng.randrange(16, 2000) for _ in range(PROMPT_LEN)] for _ in range(8)]

        def send(p):
            try:
                complete(url, p)
            except (httpx.TransportError, AssertionError):  # the kill cuts these short
                pass

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(send, p) for p in burst]
            deadline = time.monotonic() + _START_TIMEOUT_S
            while not all(f.done() for f in futures) and time.monotonic() < deadline:
                if set(os.listdir(ssd)) - written:
                    break
                time.sleep(0.001)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL

    # A kill inside a write leaves a temp file; plant one too, in case the kill above caught none.
    some = next(p for p in ssd.iterdir() if p.name.endswith(BLOCK))
    (ssd / (some.name + ".deadbeef0000.tmp")).write_bytes(some.read_bytes()[:500])

    b = make_server(qwen3_model_dir, block_size=BS, ssd_cache_dir=str(ssd), max_num_seqs=8)
    assert not tmp_files(ssd)
    start = ssd_stats(b.url)
    # Writes are temp file + fsync + rename: a SIGKILL never leaves a torn block under its final name.
    assert start["corrupt_removed"] == start["incompatible_removed"] == 0
    assert start["num_blocks"] >= 3 * NUM_BLOCKS
    for i, p in enumerate(prompts):
        text, cached = complete(b.url, p)
        assert text == reference[i], f"prompt {i}"
        if i < 3:
            assert cached == NUM_BLOCKS * BS, f"prompt {i}"
    assert ssd_stats(b.url)["corrupt_removed"] == 0


def test_disk_cap_is_kept_and_output_stays_correct(qwen3_model_dir, make_server, prompts, reference, ssd_dir):
    block_bytes = max(p.stat().st_size for p in ssd_dir.iterdir())
    cap = (2 * NUM_BLOCKS + 2) * block_bytes  # two prompts and a third
    assert dir_bytes(ssd_dir) > cap
    # Memory for one prompt's blocks, so that a prompt served again may come back from the SSD tier.
    kv_block_bytes = read_header(next(ssd_dir.iterdir()))["kv"]["data_offsets"][1]
    c = make_server(qwen3_model_dir, block_size=BS, ssd_cache_dir=str(ssd_dir), ssd_cache_max_bytes=cap,
                    cache_memory_bytes=NUM_BLOCKS * kv_block_bytes, max_num_seqs=8)
    start = ssd_stats(c.url)
    # The cap was lowered under what the directory held: the start-up scan evicts down to it.
    assert dir_bytes(ssd_dir) <= cap
    assert start["bytes"] <= cap and start["evictions"] == NUM_PROMPTS * NUM_BLOCKS - start["num_blocks"]

    # Each request's blocks are spilled as soon as the engine is idle: after the first pass the disk
    # holds the two newest prompts whole, the memory only the newest. The second pass starts with the
    # second newest (an SSD hit), then goes back through prompts the cap has evicted.
    for order in (range(NUM_PROMPTS), reversed(range(NUM_PROMPTS - 1))):
        for i in order:
            text, _ = complete(c.url, prompts[i])
            assert text == reference[i], f"prompt {i}"
            # The newest block lands before the oldest is deleted, and a temp file may be on its way.
            assert dir_bytes(ssd_dir) <= cap + block_bytes
    end = ssd_stats(c.url)
    assert end["writes"] > 0 and end["evictions"] > start["evictions"]
    assert end["hits"] >= NUM_BLOCKS and end["corrupt_removed"] == 0
    assert end["bytes"] <= cap
    c.stop()
    assert dir_bytes(ssd_dir) <= cap


def test_a_full_disk_costs_cache_writes_not_answers(qwen3_model_dir, prompts, reference, tmp_path):
    ssd = tmp_path / "ssd"
    # Every block file (~17 KB) outgrows a 4 KB file-size limit: each write fails like one on a full disk.
    with cli_server(qwen3_model_dir, ssd, tmp_path / "server.log", max_file_bytes=4096) as (_, url):
        for i, p in enumerate(prompts[:4] + prompts[:1]):
            text, _ = complete(url, p)
            assert text == reference[i % 4]
        stats = wait_for(url, lambda s: s["pending_writes"] == 0 and s["write_errors"] >= 3 * NUM_BLOCKS)
        assert stats["writes"] == stats["num_blocks"] == stats["bytes"] == 0
        assert not list(ssd.iterdir())  # the failed writes' temp files were removed
        # Served again: the memory tier still has every block.
        text, cached = complete(url, prompts[1])
        assert text == reference[1] and cached == NUM_BLOCKS * BS

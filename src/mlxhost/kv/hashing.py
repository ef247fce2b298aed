"""Chained hashes of full KV blocks: the keys of the prefix cache and of the SSD tier.

A block's hash covers its parent's hash, so two equal hashes mean two equal *prefixes*,
not merely two equal blocks of tokens. Extra keys (the model identity, later the hashes
of images whose tokens fall inside the block) are mixed in so that the same token ids
under another model or another image never share KV.

Why blake2b and not xxhash: the same digest keys the on-disk tier, so it must be identical
on every install (an optional dependency would silently split the cache) and must not be
collidable on purpose by a client who picks the prompt. blake2b is in the stdlib, is a
cryptographic hash, and costs a few microseconds per block (~5 us for 16 tokens, ~16 us
for 256 in CPython), which is noise next to the model step.
16 bytes keep the dict keys small while birthday collisions stay out of reach.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Any, Sequence

HASH_SIZE = 16

# Bump when the byte layout below changes: digests are persisted (SSD tier file names),
# so a silent change would turn every stored block into a miss or, worse, a false hit.
HASH_VERSION = b"mlxhost-block-v1"

_LITTLE_ENDIAN = sys.byteorder == "little"


def _encode_key(key: Any) -> bytes:
    """Type-tagged, length-prefixed bytes, so ("ab",) and ("a", "b") or "1" and 1 differ."""
    if isinstance(key, (bytes, bytearray, memoryview)):
        tag, payload = b"b", bytes(key)
    elif isinstance(key, str):
        tag, payload = b"s", key.encode("utf-8")
    elif isinstance(key, bool):  # before int: bool is an int subclass
        tag, payload = b"?", b"1" if key else b"0"
    elif isinstance(key, int):
        tag, payload = b"i", str(key).encode("ascii")
    elif isinstance(key, float):
        tag, payload = b"f", repr(key).encode("ascii")
    elif isinstance(key, (tuple, list)):
        tag, payload = b"t", b"".join(_encode_key(k) for k in key)
    else:
        # A generic repr() may embed an object address and break determinism across runs.
        raise TypeError(f"unsupported extra key type for block hashing: {type(key).__name__}")
    return tag + len(payload).to_bytes(8, "little") + payload


def hash_block(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()
) -> bytes:
    """Hash of one full block: its parent's hash, its token ids and its extra keys."""
    h = hashlib.blake2b(HASH_VERSION, digest_size=HASH_SIZE)
    if parent_hash is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + len(parent_hash).to_bytes(1, "little") + parent_hash)
    tokens = array("q", token_ids)
    if not _LITTLE_ENDIAN:  # digests are persisted, so fix the byte order
        tokens.byteswap()
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(tokens.tobytes())
    for key in extra_keys:
        h.update(_encode_key(key))
    return h.digest()


# A span over every position a sequence can have: its key is mixed into every block.
_EVERY_POSITION = 1 << 62


def adapter_span(adapter: str) -> tuple[int, int, str]:
    """A LoRA adapter's identity as a span over the whole sequence (see `extend_block_hashes`): every block
    computed under it carries it, so blocks never cross between adapters or to the base model, in memory
    or on the SSD tier. Requests without an adapter add nothing, so their hashes are the same as before."""
    return (0, _EVERY_POSITION, "lora:" + adapter)


def group_span(group: str, start: int = 0) -> tuple[int, int, str]:
    """A cache-isolation group as a span from `start` to the sequence's end: no block, in memory or on the SSD
    tier, is found by a request of another group, so the time to the first token says nothing across groups.
    Requests without a group add nothing, so their hashes stay what they were. `start` > 0 (a shared system
    prompt's tokens) leaves out only the blocks wholly before it: a block holding any later token carries it."""
    return (start, _EVERY_POSITION, "group:" + group)


def block_extra_keys(model_key: str, extra_keys: tuple = ()) -> tuple:
    """Extra keys mixed into every block; an empty model key adds nothing."""
    return (model_key, *extra_keys) if model_key else tuple(extra_keys)


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple = (),
    model_key: str = "",
    max_num_blocks: int | None = None,
    media_spans: Sequence[tuple[int, int, str]] = (),
) -> list[bytes]:
    """Append to `hashes` the hashes of the full blocks of `token_ids` it does not cover yet.

    Lets a caller hash a growing sequence (decode) incrementally instead of from the start;
    `hashes` must have been built from the same token prefix and keys. Returns `hashes`.
    `media_spans` are (start, end, content hash) of image/video placeholder runs: every block that
    overlaps one also carries that hash, since its tokens alone (all the same placeholder id) say
    nothing about which picture they stand for.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full = len(token_ids) // block_size
    if max_num_blocks is not None:
        num_full = min(num_full, max_num_blocks)
    extra = block_extra_keys(model_key, extra_keys)
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        start = i * block_size
        keys = extra
        if media_spans:
            end = start + block_size
            keys = extra + tuple(h for s, e, h in media_spans if s < end and e > start)
        parent = hash_block(parent, token_ids[start : start + block_size], keys)
        hashes.append(parent)
    return hashes


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple = (),
    model_key: str = "",
    media_spans: Sequence[tuple[int, int, str]] = (),
) -> list[bytes]:
    """Chained hashes of every full block of a sequence; a partial tail is not hashed."""
    return extend_block_hashes([], token_ids, block_size, extra_keys, model_key, media_spans=media_spans)


def disk_key(h: bytes) -> str:
    """File-name-safe form of a block hash (hex). Collisions on disk are guarded by the
    tokens / checksum stored inside the file, not by the name."""
    return h.hex()

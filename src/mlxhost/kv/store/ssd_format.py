"""The SSD tier's block file: a safetensors file with the block's tensors as raw bytes and a header
that says whose block it is. No MLX here.

Blocks arrive as raw little-endian bytes (bfloat16 has no numpy dtype), stored as 1-D uint8 tensors that
any safetensors reader opens; the real shapes are in the header. The header also carries a compatibility
record (model, block size, layers, dtype, format version), the block's token ids and a sha256 over both:
a file failing any check raises `BadFile`, which the tier turns into a miss.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT_VERSION = 2  # 2: attention KV concatenated on the last axis (MLA), sliding KV, snapshots
BLOCK_SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
_BLOCK_NAME = re.compile(r"(?:[0-9a-f]{2})+" + re.escape(BLOCK_SUFFIX))  # what disk_key() makes
# Far above any real header; bounds what a corrupt length prefix can make us allocate.
_MAX_HEADER_BYTES = 16 << 20
METADATA = "__metadata__"


@dataclass(frozen=True)
class BlockMeta:
    """What makes stored blocks usable by this server; any difference makes a file foreign."""

    model_key: str
    block_size: int
    num_layers: int
    dtype: str
    format_version: int = FORMAT_VERSION
    # Quantized KV (--kv-bits): bits, group size and quantized layers (KVQuantPlan.label); "none" for
    # float KV, which files from before this field hold too (see LEGACY_FIELDS).
    kv_quant: str = "none"

    def header_fields(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}  # safetensors metadata is str -> str


# Header fields added after files were written without them, and the value such files stand for.
LEGACY_FIELDS = {"kv_quant": "none"}


@dataclass
class BlockData:
    """One block's KV: tensor name (e.g. "l0.k") -> (raw little-endian bytes, shape). On `put`
    any C-contiguous buffer will do, but another thread writes it later: it must not change."""

    token_ids: tuple[int, ...]
    tensors: dict[str, tuple[bytes, tuple[int, ...]]]


class BadFile(Exception):
    """A block file failed a check; the message says which."""


class Incompatible(BadFile):
    """A well-formed file from another model, block size, dtype or format version."""


class TokenMismatch(BadFile):
    """The file's tokens differ from the caller's: it cannot serve this hash."""



def checksum(block_hash: bytes, token_ids, shapes: list, buffers: list) -> str:
    # Covers the manifest as well as the tensor bytes: a flipped header byte that still
    # parses (a shape digit, a token id) must not be served either.
    h = hashlib.sha256()
    manifest = [block_hash.hex(), [int(t) for t in token_ids], shapes]
    h.update(json.dumps(manifest, separators=(",", ":")).encode())
    for buf in buffers:
        h.update(buf)
    return h.hexdigest()


def encode(meta: BlockMeta, block_hash: bytes, block: BlockData) -> tuple[bytes, list]:
    """The safetensors length prefix + JSON header, and the buffers to write after it."""
    entries, shapes, buffers, offset = {}, [], [], 0
    for name, (buf, shape) in block.tensors.items():
        size = memoryview(buf).nbytes
        entries[name] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        shapes.append([name, [int(d) for d in shape]])
        buffers.append(buf)
        offset += size
    metadata = {**meta.header_fields(), "block_hash": block_hash.hex(),
                "token_ids": json.dumps([int(t) for t in block.token_ids], separators=(",", ":")),
                "shapes": json.dumps(shapes, separators=(",", ":")),
                "sha256": checksum(block_hash, block.token_ids, shapes, buffers)}
    header = json.dumps({METADATA: metadata, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the format pads so tensor data starts 8-byte aligned
    return len(header).to_bytes(8, "little") + header, buffers


def read_header(f, meta: BlockMeta, file_size: int) -> tuple[dict, list[tuple[str, int, int]]]:
    """Check the header; return its metadata and tensors as (name, begin, end) in file order."""
    header_len = int.from_bytes(f.read(8), "little")
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > file_size:  # also: shorter than 8 bytes
        raise BadFile(f"header length {header_len} out of range")
    try:
        header = json.loads(f.read(header_len))
        metadata = header.pop(METADATA)
        for key, expected in meta.header_fields().items():
            found = metadata.get(key, LEGACY_FIELDS.get(key))
            if found != expected:
                raise Incompatible(f"{key}={found!r}, expected {expected!r}")
        spans = sorted(((n, int(e["data_offsets"][0]), int(e["data_offsets"][1]))
                        for n, e in header.items()), key=lambda span: span[1])
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise BadFile(f"unreadable header: {exc!r}") from None
    ends = [0] + [end for _, _, end in spans]  # the format wants the data tiled exactly
    tiled = all(b == ends[i] and e >= b for i, (_, b, e) in enumerate(spans))
    if not tiled or 8 + header_len + ends[-1] != file_size:
        raise BadFile(f"tensor offsets do not tile the {file_size}-byte file (truncated?)")
    return metadata, spans


def hash_from_name(name: str) -> bytes | None:
    """The block hash a file name stands for, or None for files that are not blocks."""
    return bytes.fromhex(name[: -len(BLOCK_SUFFIX)]) if _BLOCK_NAME.fullmatch(name) else None


def read_block(path: Path, meta: BlockMeta, block_hash: bytes, tokens: tuple[int, ...]) -> BlockData:
    """The block stored at `path` if it is intact and holds exactly `tokens`; else raises BadFile."""
    with open(path, "rb") as f:
        metadata, spans = read_header(f, meta, os.fstat(f.fileno()).st_size)
        try:
            if metadata["block_hash"] != block_hash.hex():
                raise BadFile("file holds another block hash")
            stored = tuple(json.loads(metadata["token_ids"]))
            if stored != tokens:
                raise TokenMismatch("stored token ids differ from the request's")
            shapes = json.loads(metadata["shapes"])
            if [s[0] for s in shapes] != [name for name, _, _ in spans]:
                raise BadFile("shapes do not match the tensors")
            expected_sum = metadata["sha256"]
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise BadFile(f"unreadable metadata: {exc!r}") from None
        buffers = [f.read(end - begin) for _, begin, end in spans]
    if checksum(block_hash, stored, shapes, buffers) != expected_sum:  # also catches short reads
        raise BadFile("checksum mismatch")
    tensors = {name: (buf, tuple(shape)) for (name, shape), buf in zip(shapes, buffers)}
    return BlockData(stored, tensors)

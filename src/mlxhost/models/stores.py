"""Ollama's and LM Studio's model stores, read in place (never written): their GGUF files become models
mlxhost lists and serves (models/gguf/ converts each once into its own cache).

Ollama: `<models>/manifests/<registry>/<namespace>/<name>/<tag>` is a JSON manifest whose layers name blobs by
digest; the layer of media type `application/vnd.ollama.image.model` is the GGUF, stored as
`<models>/blobs/sha256-<hex>`. `<models>` is $OLLAMA_MODELS, else ~/.ollama/models. `ollama:NAME[:TAG]`
names one (`ollama:llama3.2:3b`, tag `latest` when left out). Its `.template` layer (Go template syntax)
is not used: the GGUF's own chat template is.

LM Studio: `~/.lmstudio/models/<publisher>/<repo>/` holds `*.gguf` files or an MLX folder.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from mlxhost.models.catalog import LocalModel, describe
from mlxhost.models.loaded import ModelLoadError

log = logging.getLogger(__name__)

OLLAMA_PREFIX = "ollama:"
MODEL_LAYER = "application/vnd.ollama.image.model"
TEMPLATE_LAYER = "application/vnd.ollama.image.template"
DEFAULT_REGISTRY, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"


@dataclass(frozen=True)
class OllamaModel:
    name: str  # as `ollama list` shows it: llama3.2:3b, namespace/name:tag, host/namespace/name:tag
    blob: Path  # the GGUF
    num_bytes: int  # all layers, as Ollama counts a model's size
    has_template: bool


def ollama_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def lmstudio_dir() -> Path:
    """LM Studio's models folder: ~/.lmstudio/models (older versions: ~/.cache/lm-studio/models)."""
    for candidate in ("~/.lmstudio/models", "~/.cache/lm-studio/models"):
        path = Path(candidate).expanduser()
        if path.is_dir():
            return path
    return Path("~/.lmstudio/models").expanduser()


def is_ollama_store(root: Path) -> bool:
    return (root / "manifests").is_dir() and (root / "blobs").is_dir()


def ollama_name(registry: str, namespace: str, name: str, tag: str) -> str:
    if registry != DEFAULT_REGISTRY:
        base = f"{registry}/{namespace}/{name}"
    else:
        base = name if namespace == DEFAULT_NAMESPACE else f"{namespace}/{name}"
    return f"{base}:{tag}"


def scan_ollama(root: Path | None = None) -> list[OllamaModel]:
    root = Path(root) if root is not None else ollama_dir()
    out = []
    for manifest in sorted((root / "manifests").glob("*/*/*/*")):
        if manifest.is_file():
            model = _read_manifest(root, manifest)
            if model is not None:
                out.append(model)
    return out


def _read_manifest(root: Path, manifest: Path) -> OllamaModel | None:
    registry, namespace, name, tag = manifest.parts[-4:]
    try:
        layers = json.loads(manifest.read_text())["layers"]
        model_layer = next(layer for layer in layers if layer.get("mediaType") == MODEL_LAYER)
        blob = root / "blobs" / str(model_layer["digest"]).replace(":", "-")
        size = sum(int(layer.get("size", 0)) for layer in layers)
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        log.warning("Ollama manifest %s: no model layer, skipped", manifest)
        return None
    if not blob.is_file():
        log.warning("Ollama manifest %s: its model blob %s is missing, skipped", manifest, blob.name)
        return None
    has_template = any(layer.get("mediaType") == TEMPLATE_LAYER for layer in layers)
    return OllamaModel(ollama_name(registry, namespace, name, tag), blob, size, has_template)


def resolve_ollama(source: str, root: Path | None = None) -> Path:
    """The GGUF blob that `ollama:NAME[:TAG]` names."""
    root = Path(root) if root is not None else ollama_dir()
    ref = source[len(OLLAMA_PREFIX):] if source.startswith(OLLAMA_PREFIX) else source
    name, _, tag = ref.partition(":")
    parts = name.split("/")
    if not name or len(parts) > 3 or not all(parts):
        raise ModelLoadError(f"{source}: not an Ollama model name (ollama:NAME[:TAG], e.g. ollama:llama3.2:3b)")
    registry, namespace = DEFAULT_REGISTRY, DEFAULT_NAMESPACE
    if len(parts) == 3:
        registry, namespace, name = parts
    elif len(parts) == 2:
        namespace, name = parts
    manifest = root / "manifests" / registry / namespace / name / (tag or DEFAULT_TAG)
    model = _read_manifest(root, manifest) if manifest.is_file() else None
    if model is None:
        if not is_ollama_store(root):
            raise ModelLoadError(f"{source}: no Ollama models folder at {root} (set OLLAMA_MODELS)")
        names = [m.name for m in scan_ollama(root)]
        close = difflib.get_close_matches(ref, names, n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(close)}?)" if close else f" (it has: {', '.join(names[:8]) or 'none'})"
        raise ModelLoadError(f"{source}: no such model in the Ollama store {root}{hint}")
    return model.blob


def scan_store(root: Path) -> list:
    """What `--model-dir` finds beyond folders with a config.json: an Ollama store's models, else the GGUF
    files of a folder (directly inside, one level down, or LM Studio's publisher/repo two levels down)
    and LM Studio's MLX folders. catalog.LocalModel rows."""
    root = Path(root)
    if is_ollama_store(root):
        return [_gguf_row(m.name, m.blob, m.num_bytes) for m in scan_ollama(root)]
    rows = []
    for path in _gguf_files(root):
        rel = path.relative_to(root)
        single = len(_gguf_files(path.parent, depth=0)) == 1 and path.parent != root
        name = "/".join(rel.parent.parts) if single else "/".join(rel.with_suffix("").parts)
        rows.append(_gguf_row(name, path, sum(p.stat().st_size for p in _split_set(path))))
    for folder in sorted(root.glob("*/*/")):  # LM Studio's publisher/repo MLX folders
        if not folder.name.startswith(".") and (folder / "config.json").is_file():
            row = describe(f"{folder.parent.name}/{folder.name}", folder)
            if isinstance(row, LocalModel):
                rows.append(row)
    return rows


def _gguf_files(root: Path, depth: int = 2) -> list[Path]:
    """GGUF models (a split set by its first part) up to `depth` folders down, hidden ones skipped."""
    from mlxhost.models.gguf.reader import SPLIT_NAME  # lazy: pulls in numpy

    patterns = ["*.gguf", "*/*.gguf", "*/*/*.gguf"][:depth + 1]
    found = sorted({p for pattern in patterns for p in root.glob(pattern)
                    if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)})
    return [p for p in found if not (m := SPLIT_NAME.match(p.name)) or int(m["no"]) == 1]


def _split_set(path: Path) -> list[Path]:
    from mlxhost.models.gguf.reader import GGUFError, split_files  # lazy: pulls in numpy

    try:
        return split_files(path)
    except GGUFError:
        return [path]


def _gguf_row(name: str, path: Path, num_bytes: int):
    from mlxhost.models.gguf.arch import ARCHITECTURES  # lazy: pulls in numpy
    from mlxhost.models.gguf.reader import peek_metadata  # lazy: pulls in numpy

    arch = peek_metadata(path).get("general.architecture")
    ok = arch in ARCHITECTURES
    why = "" if ok else (f"GGUF architecture {arch!r} is not supported" if arch else "not a readable GGUF")
    return LocalModel(name, path, num_bytes, f"gguf:{arch}" if arch else "gguf", None, ok, why)


def default_store_sections() -> list[tuple[str, Path]]:
    """(title, folder) of the Ollama and LM Studio stores on this machine, for `mlxhost list`."""
    out = []
    if is_ollama_store(ollama_dir()):
        out.append((f"Ollama ({ollama_dir()})", ollama_dir()))
    if lmstudio_dir().is_dir():
        out.append((f"LM Studio ({lmstudio_dir()})", lmstudio_dir()))
    return out

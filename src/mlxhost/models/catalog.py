"""Models on this machine: the Hugging Face cache and `--model-dir` folders (`mlxhost list`), and a
model folder's folders as lazily loaded models (`mlxhost serve --model-dir DIR`).

Reads only config.json and file sizes: listing a cache of 100 GB takes no model load and no MLX.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from mlxhost.audio.detect import AUDIO_HINT, audio_kind, has_audio
from mlxhost.config import ModelSpec
from mlxhost.models import extras
from mlxhost.models.convert import format_size
from mlxhost.models.vlm import VLM_FAMILIES, is_vlm_config
from mlxhost.testing import demo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalModel:
    """One model folder found on disk."""

    name: str  # hub id for the cache, folder name for a --model-dir folder
    path: Path
    num_bytes: int
    family: str | None  # config.json's model_type
    bits: int | None  # quantization bits; None: not quantized (or unknown)
    servable: bool
    why_not: str = ""  # when not servable: what is missing

    @property
    def bits_text(self) -> str:
        return str(self.bits) if self.bits else "-"


def read_config(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def quantization_bits(config: dict) -> int | None:
    """mlx-lm writes `quantization`, transformers `quantization_config`; VLMs may nest it in text_config."""
    for cfg in (config, config.get("text_config") or {}):
        for key in ("quantization", "quantization_config"):
            q = cfg.get(key)
            if isinstance(q, dict) and isinstance(q.get("bits"), int):
                return q["bits"]
    return None


def can_serve(config: dict) -> tuple[bool, str]:
    """(True, "") when mlxhost can serve this config: a VLM type we support (with the vision extra
    installed), or a model_type mlx-lm has a module for."""
    if audio_kind(config) is not None:  # a faster-whisper config.json has no model_type
        return (True, "") if has_audio() else (False, AUDIO_HINT)
    model_type = config.get("model_type")
    if not model_type:
        return False, "config.json has no model_type"
    if is_vlm_config(config):
        return (True, "") if extras.has_vision() else (False, f"vision-language: {extras.VISION_HINT}")
    if "vision_config" in config and model_type not in VLM_FAMILIES:
        return False, f"vision-language {model_type!r} is not supported (supported: {', '.join(VLM_FAMILIES)})"
    if importlib.util.find_spec(f"mlx_lm.models.{_mlx_lm_module(model_type)}") is None:
        return False, f"mlx-lm has no {model_type!r} module"
    return True, ""


def _mlx_lm_module(model_type: str) -> str:
    from mlx_lm.utils import MODEL_REMAPPING  # e.g. "mistral" is served by mlx-lm's llama module

    return MODEL_REMAPPING.get(model_type, model_type).replace("-", "_")


def describe(name: str, folder: Path, num_bytes: int | None = None) -> LocalModel | None:
    """A LocalModel for a folder holding config.json; None for anything else."""
    config = read_config(folder)
    if config is None:
        return None
    ok, why = can_serve(config)
    size = num_bytes if num_bytes is not None else _folder_bytes(folder)
    return LocalModel(name, folder, size, config.get("model_type"), quantization_bits(config), ok, why)


def _folder_bytes(folder: Path) -> int:
    # Symlinks (the HF cache's snapshot files) count at their target's size, each blob once.
    seen, total = set(), 0
    for f in folder.rglob("*"):
        if f.is_file():
            real = f.resolve()
            if real not in seen:
                seen.add(real)
                total += real.stat().st_size
    return total


def hf_cache_dir() -> Path:
    from huggingface_hub import constants  # lazy: huggingface_hub only when used

    return Path(constants.HF_HUB_CACHE)


def scan_hf_cache(cache_dir: Path | None = None) -> list[LocalModel]:
    """Model repos in the HF cache (`models--org--name/snapshots/<sha>/`): the snapshot `main` points
    to, else the newest one."""
    cache_dir = Path(cache_dir) if cache_dir is not None else hf_cache_dir()
    out = []
    for repo in sorted(cache_dir.glob("models--*")):
        snapshot = _current_snapshot(repo)
        if snapshot is None:
            continue
        repo_id = repo.name[len("models--"):].replace("--", "/")
        model = describe(repo_id, snapshot)
        if model is not None:
            out.append(model)
    return out


def _current_snapshot(repo: Path) -> Path | None:
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = [s for s in (repo / "snapshots").glob("*") if s.is_dir()]
    return max(snapshots, key=lambda s: s.stat().st_mtime, default=None)


def scan_model_dir(model_dir: str | Path) -> list[LocalModel]:
    """The folders of `model_dir` holding a config.json, named after the folder."""
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"--model-dir {model_dir}: not a folder")
    found = (describe(child.name, child) for child in sorted(root.iterdir()) if child.is_dir()
             and not child.name.startswith("."))
    from mlxhost.models.stores import scan_store  # cycle: stores.py builds on LocalModel and describe

    return [m for m in found if m is not None] + scan_store(root)


def model_dir_specs(model_dir: str | Path) -> list[ModelSpec]:
    """Each model folder of `model_dir` as a lazily loaded model named after its folder. Folders that
    cannot be served are left out with a warning, so one odd folder does not stop the server; a
    vision-language folder without the vision extra stays in and answers with the extra's name."""
    specs = []
    for m in scan_model_dir(model_dir):
        if not m.servable and "mlxhost[vision]" not in m.why_not:
            log.warning("--model-dir: skipping %s: %s", m.path, m.why_not)
            continue
        if not m.servable:
            log.warning("--model-dir: %s: %s", m.path, m.why_not)
        specs.append(ModelSpec(name=m.name, source=str(m.path)))
    if not specs:
        raise ValueError(f"--model-dir {model_dir}: no servable model folder (a folder with config.json) inside")
    return specs


def format_table(models: list[LocalModel]) -> str:
    rows = [("NAME", "SIZE", "BITS", "FAMILY", "SERVE", "PATH")]
    rows += [(m.name, format_size(m.num_bytes), m.bits_text, m.family or "?",
              "yes" if m.servable else f"no ({m.why_not})", str(m.path)) for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def demo_models() -> list[LocalModel]:
    """The built-in demo model, once `mlxhost serve` (or `demo-model`) has built it in the user cache."""
    model = describe(demo.DEMO_MODEL_DIRNAME, demo.default_demo_model_dir())
    return [model] if model is not None else []


def served_lines(url: str, timeout: float = 1.0) -> list[str]:
    """What the server at `url` serves, one line per model (its /v1/models), or one line saying none answers."""
    import httpx  # lazy: httpx only when used

    key = os.environ.get("MLXHOST_API_KEY", "").split(",")[0].strip()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        reply = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout, trust_env=False)
    except httpx.HTTPError:
        return [f"Served at {url}: no server answers"]
    if reply.status_code == 401:
        return [f"Served at {url}: the server needs an API key (set MLXHOST_API_KEY)"]
    try:
        cards = reply.json()["data"]
    except (ValueError, KeyError, TypeError):
        return [f"Served at {url}: answered {reply.status_code}, not a model list"]
    lines = [f"Served at {url}: {len(cards)} model(s)"]
    lines += [f"  {c.get('id')}  ({c.get('status', 'loaded')})" for c in cards]
    return lines


def run_list(args) -> int:
    """`mlxhost list`: the HF cache, each --model-dir, the demo model, then what a running server serves."""
    sections = [] if args.no_hf_cache else [(f"Hugging Face cache ({hf_cache_dir()})", scan_hf_cache)]
    dirs = args.model_dir or [d for d in os.environ.get("MLXHOST_MODEL_DIR", "").split(",") if d]
    sections += [(f"--model-dir {d}", lambda d=d: scan_model_dir(d)) for d in dirs]
    from mlxhost.models.stores import default_store_sections  # cycle: stores.py builds on LocalModel

    sections += [(title, lambda d=d: scan_model_dir(d)) for title, d in default_store_sections()
                 if str(d) not in {str(Path(x).expanduser()) for x in dirs}]
    for title, scan in sections:
        try:
            models = scan()
        except ValueError as e:
            print(f"mlxhost list: {e}", file=sys.stderr)
            return 2
        print(f"{title}: {len(models)} model(s)")
        if models:
            print(format_table(models))
        print()
    demo = demo_models()
    if demo:
        print("Demo model (random weights: its replies are gibberish by design; `mlxhost serve` with no model"
              " serves it):")
        print(format_table(demo))
        print()
    if args.server:
        print("\n".join(served_lines(args.server)))
    return 0

"""Which models a server serves: `--models-config models.yaml` and repeated `--model [NAME=]PATH`.

    max_loaded_models: 2          # optional; flags given on the command line win
    max_loaded_memory: 12GB       # optional; weight bytes (file sizes) of all loaded models
    models:                       # a list of entries, or a mapping name -> entry
      - name: qwen
        path: /models/Qwen3-8B-4bit
        pinned: true              # loaded at start-up, never unloaded
        aliases: [qwen3]
      - name: llama
        path: /models/Llama-3.2-3B-4bit
        ttl: 10m                  # unloaded after 10 minutes idle (number: seconds)
        engine: {max_num_seqs: 8, kv_budget_tokens: 32768}   # EngineConfig fields for this model
        loras: {sql: /adapters/sql, chat: ./chat-lora}     # LoRA adapters served as models on this one

Imports no MLX: specs are plain data, parsed before anything loads.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from mlxhost.config import EngineConfig, LoraSpec, ModelSpec, parse_memory
from mlxhost.memory.device import total_ram

_ENTRY_KEYS = {"name", "path", "pinned", "ttl", "aliases", "engine", "loras"}
_TTL_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class ModelsFile:
    """What a models YAML holds."""

    models: tuple[ModelSpec, ...]
    max_loaded_models: int | None = None
    max_loaded_bytes: int | None = None


def default_name(source: str) -> str:
    """The name a model gets when none is given: the folder's name, or the hub id itself."""
    path = Path(source)
    return path.name if path.exists() else source


def parse_model_flag(text: str) -> ModelSpec:
    """`--model NAME=PATH` or `--model PATH` (named after the folder)."""
    name, sep, source = text.partition("=")
    if not sep:
        name, source = default_name(text), text
    return ModelSpec(name=name.strip(), source=source.strip())


def parse_lora_flag(text: str) -> LoraSpec:
    """`--lora NAME=PATH`, or `--lora BASE:NAME=PATH` to put it on one of several models."""
    name, sep, path = text.partition("=")
    if not sep:
        raise ValueError(f"--lora takes NAME=PATH (or BASE:NAME=PATH), got {text!r}")
    base, colon, name = name.strip().rpartition(":")
    return LoraSpec(name=name.strip(), path=path.strip(), base=base.strip() if colon else None)


def _loras(value, name: str, where: Path) -> tuple[LoraSpec, ...]:
    """A model entry's `loras`: a mapping name -> path, or a list of {name, path} / "NAME=PATH"."""
    if value is None:
        return ()
    if isinstance(value, dict):
        value = [{"name": n, "path": p} for n, p in value.items()]
    if not isinstance(value, list):
        raise ValueError(f"`loras` of model {name!r} must be a mapping name -> path or a list")
    out = []
    for item in value:
        if isinstance(item, str):
            item = {"name": item.partition("=")[0], "path": item.partition("=")[2]}
        if not isinstance(item, dict) or set(item) - {"name", "path"}:
            raise ValueError(f"a LoRA entry of model {name!r} must be name and path, got {item!r}")
        path = str(item.get("path") or "")
        local = where.parent / Path(path).expanduser()
        if path and not Path(path).is_absolute() and local.exists():
            path = str(local)  # relative to the YAML file, like a model's path
        out.append(LoraSpec(name=str(item.get("name") or ""), path=path, base=name))
    return tuple(out)


def parse_ttl(value) -> float | None:
    """Seconds from 600, "600", "30s", "10m" or "1h"; None/"none"/0 for no ttl."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "off")):
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) or None
    m = re.fullmatch(r"\s*([0-9.]+)\s*([smh]?)\s*", str(value).lower())
    if m is None:
        raise ValueError(f"ttl must be seconds or a number with s/m/h, got {value!r}")
    return float(m.group(1)) * _TTL_UNITS[m.group(2)] or None


def _engine(base: EngineConfig, overrides, name: str) -> EngineConfig | None:
    if overrides is None:
        return None
    if not isinstance(overrides, dict):
        raise ValueError(f"`engine` of model {name!r} must be a mapping of engine settings")
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"model {name!r}: unknown engine settings {unknown}; known: {sorted(known)}")
    return dataclasses.replace(base, **overrides)


def _spec(entry, name: str | None, base: EngineConfig, where: Path) -> ModelSpec:
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict):
        raise ValueError(f"a model entry must be a mapping, got {entry!r}")
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise ValueError(f"unknown keys {unknown} in model entry {entry!r}; known: {sorted(_ENTRY_KEYS)}")
    if "path" not in entry:
        raise ValueError(f"model entry {entry!r} has no path")
    source = str(entry["path"])
    local = where.parent / Path(source).expanduser()
    if not Path(source).is_absolute() and local.exists():
        source = str(local)  # a relative path means relative to the YAML file
    name = str(entry.get("name") or name or default_name(source))
    aliases = entry.get("aliases") or ()
    if isinstance(aliases, str):
        aliases = (aliases,)
    return ModelSpec(name=name, source=source, pinned=bool(entry.get("pinned", False)),
                     ttl_s=parse_ttl(entry.get("ttl")), aliases=tuple(str(a) for a in aliases),
                     engine=_engine(base, entry.get("engine"), name), loras=_loras(entry.get("loras"), name, where))


def load_models_file(path: str | Path, base: EngineConfig) -> ModelsFile:
    """Parses a models YAML; ValueError names what is wrong."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from exc
    if isinstance(data, list):
        data = {"models": data}
    if not isinstance(data, dict) or not data.get("models"):
        raise ValueError(f"{path}: expected a `models:` list or mapping")
    unknown = sorted(set(data) - {"models", "max_loaded_models", "max_loaded_memory"})
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}")
    entries = data["models"]
    if isinstance(entries, dict):
        specs = [_spec(e, n, base, path) for n, e in entries.items()]
    else:
        specs = [_spec(e, None, base, path) for e in entries]
    memory = data.get("max_loaded_memory")
    if memory is not None:
        memory = parse_memory(str(memory), total_ram())
    return ModelsFile(
        tuple(specs),
        max_loaded_models=data.get("max_loaded_models"),
        max_loaded_bytes=memory,
    )


def with_source_aliases(specs: tuple[ModelSpec, ...]) -> tuple[ModelSpec, ...]:
    """Each model also answers to its path (as single-model servers do), unless another model owns
    that string as a name or alias, or two models share the path."""
    taken = {n for s in specs for n in (s.name, *s.aliases)}
    counts: dict[str, int] = {}
    for s in specs:
        counts[s.source] = counts.get(s.source, 0) + 1
    return tuple(
        dataclasses.replace(s, aliases=s.aliases + (s.source,))
        if counts[s.source] == 1 and s.source not in taken else s
        for s in specs
    )


def weights_on_disk(source: str) -> int:
    """Bytes of a folder's weight files (safetensors; an MLX Whisper's weights.npz, a CTranslate2
    model.bin): what loading will add (0 for a hub id not yet fetched)."""
    folder = Path(source)
    if not folder.is_dir():
        return 0
    files = [*folder.glob("*.safetensors"), *folder.glob("weights.npz"), *folder.glob("model.bin")]
    return sum(p.stat().st_size for p in files)

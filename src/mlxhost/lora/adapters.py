"""LoRA adapter folders, read and checked without MLX: mlx-lm's format and PEFT's.

mlx-lm (`mlx_lm.lora`): `adapters.safetensors` + `adapter_config.json` with `fine_tune_type: lora`, `num_layers`
and `lora_parameters: {rank, scale, dropout, keys?}`; tensors `<module>.lora_a` (in, r) and `<module>.lora_b`
(r, out), applied as `y + scale * (x @ lora_a) @ lora_b` (mlx_lm.tuner.lora.LoRALinear).
PEFT: `adapter_model.safetensors` + `adapter_config.json` with `r`, `lora_alpha`, `target_modules`; tensors
`base_model.model.<module>.lora_A.weight` (r, in) and `.lora_B.weight` (out, r), the transposes of mlx-lm's,
scale `lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`).

Only the safetensors header is parsed here (names, shapes, dtypes), so a malformed folder is refused on the
HTTP side or at start-up, before the engine reads a byte of it. Whether the named modules exist in the base
model, with those sizes, is checked when the engine loads it (manager.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

MLX_LM_FILES = ("adapters.safetensors", "adapter_config.json")
PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")
_DTYPES = {"F32": 4, "F16": 2, "BF16": 2}
_PEFT_PREFIX = "base_model.model."
_PEFT_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")
_MLX_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[ab])$")
_MAX_HEADER = 100 << 20


class AdapterError(ValueError):
    """A malformed adapter folder, or one that does not fit its base model: the client's 400."""


class AdapterBusy(RuntimeError):
    """An adapter that running or queued requests use is not unloaded: a 409."""


class AdapterNoRoom(RuntimeError):
    """An adapter the memory budget has no room for now: a 503."""


@dataclass(frozen=True)
class AdapterModule:
    """One adapted linear layer: where it is in the model and the tensors of its low-rank pair."""

    path: str  # mlx-lm module path, e.g. model.layers.3.self_attn.q_proj
    key_a: str
    key_b: str
    in_dims: int
    out_dims: int
    rank: int


@dataclass(frozen=True)
class AdapterFiles:
    """What an adapter folder holds, as far as it can be known without the model."""

    path: str
    format: str  # "mlx-lm" | "peft"
    weights_file: str
    scale: float
    modules: tuple[AdapterModule, ...]
    transposed: bool  # PEFT: A is stored (r, in) and B (out, r)
    nbytes: int  # the adapter's tensors, as loaded
    digest: str  # of its config and weights: the identity prefix-cache blocks are keyed by

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules)


def adapter_id(name: str, files: AdapterFiles) -> str:
    """What a request carries to name its adapter: the served name and the files' digest, so blocks cached
    under an adapter are never served to a different one later loaded under the same name."""
    return f"{name}@{files.digest[:16]}"


def read_adapter(path: str | Path) -> AdapterFiles:
    """Reads and checks an adapter folder; AdapterError says what is wrong."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise AdapterError(f"LoRA adapter folder {str(folder)!r} does not exist")
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"{folder} has no adapter_config.json (expected mlx-lm's {' + '.join(MLX_LM_FILES)} "
                           f"or PEFT's {' + '.join(PEFT_FILES)})")
    raw = config_file.read_bytes()
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise AdapterError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file} must hold a JSON object")
    if (folder / "adapters.safetensors").is_file():
        fmt, weights = "mlx-lm", folder / "adapters.safetensors"
        scale, rank = _mlx_lm_config(config, config_file)
    elif (folder / "adapter_model.safetensors").is_file():
        fmt, weights = "peft", folder / "adapter_model.safetensors"
        scale, rank = _peft_config(config, config_file)
    else:
        raise AdapterError(f"{folder} has no adapters.safetensors (mlx-lm) or adapter_model.safetensors (PEFT)"
                           + (": only adapter_model.bin, convert it to safetensors"
                              if (folder / "adapter_model.bin").exists() else ""))
    tensors = _safetensors_header(weights)
    modules = _pair_tensors(tensors, fmt, weights, rank)
    nbytes = sum(_DTYPES[t["dtype"]] * math.prod(t["shape"]) for t in tensors.values())
    digest = hashlib.blake2b(raw, digest_size=16)
    with open(weights, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return AdapterFiles(str(folder), fmt, str(weights), scale, modules, fmt == "peft", nbytes, digest.hexdigest())


def _mlx_lm_config(config: dict, where: Path) -> tuple[float, int]:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(f"{where}: fine_tune_type {kind!r} is not served (only lora: a dora adapter or a full "
                           "fine-tune must be fused into its model with mlx_lm.fuse)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError(f"{where}: lora_parameters (rank, scale) is missing")
    if "scale" not in params:
        raise AdapterError(f"{where}: lora_parameters has no scale" + (" (mlx-lm names it scale, not alpha)"
                                                                      if "alpha" in params else ""))
    return _number(params["scale"], "lora_parameters.scale", where), _rank(params.get("rank"), where)


def _peft_config(config: dict, where: Path) -> tuple[float, int]:
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise AdapterError(f"{where}: peft_type {kind!r} is not served (only LORA)")
    refused = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D) layers",
               "modules_to_save": "modules_to_save (fully trained layers)", "rank_pattern": "per-module ranks",
               "alpha_pattern": "per-module alphas"}
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"{where}: {what} are not served")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: trained biases (bias {config['bias']!r}) are not served")
    rank = _rank(config.get("r"), where)
    alpha = _number(config.get("lora_alpha", rank), "lora_alpha", where)
    return (alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank), rank


def _rank(value, where: Path) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(f"{where}: the LoRA rank must be a positive integer, got {value!r}")
    return value


def _number(value, what: str, where: Path) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise AdapterError(f"{where}: {what} must be a number, got {value!r}")
    return float(value)


def _safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file (8-byte little-endian length, then JSON), checked against the
    file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise AdapterError(f"{path} is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _MAX_HEADER):
            raise AdapterError(f"{path} is not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise AdapterError(f"{path} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path} is not a safetensors file")
    header.pop("__metadata__", None)
    for name, t in header.items():
        ok = isinstance(t, dict) and isinstance(t.get("shape"), list) and isinstance(t.get("data_offsets"), list)
        if not ok or len(t["data_offsets"]) != 2 or t["data_offsets"][1] + 8 + length > size:
            raise AdapterError(f"{path}: tensor {name!r} is malformed or lies past the end of the file")
        if t.get("dtype") not in _DTYPES:
            raise AdapterError(f"{path}: tensor {name!r} has dtype {t.get('dtype')!r}; LoRA weights must be "
                               "float32, float16 or bfloat16")
    if not header:
        raise AdapterError(f"{path} holds no tensors")
    return header


def _pair_tensors(tensors: dict[str, dict], fmt: str, where: Path, rank: int) -> tuple[AdapterModule, ...]:
    """Groups the tensors into (A, B) per module and checks their shapes agree."""
    pattern = _PEFT_KEY if fmt == "peft" else _MLX_KEY
    pairs: dict[str, dict[str, str]] = {}
    for name in tensors:
        m = pattern.match(name)
        if m is None:
            raise AdapterError(f"{where}: tensor {name!r} is not a LoRA weight ("
                               + ("<module>.lora_A.weight / .lora_B.weight" if fmt == "peft"
                                  else "<module>.lora_a / .lora_b") + " expected)")
        module = m.group("module")
        if fmt == "peft":
            if not module.startswith(_PEFT_PREFIX):
                raise AdapterError(f"{where}: tensor {name!r} does not start with {_PEFT_PREFIX!r}")
            module = module[len(_PEFT_PREFIX):]
        pairs.setdefault(module, {})[m.group("which").lower()] = name
    modules = []
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"a", "b"}:
            raise AdapterError(f"{where}: module {module!r} has lora_{'a' if 'a' in pair else 'b'} but not its pair")
        a, b = tensors[pair["a"]]["shape"], tensors[pair["b"]]["shape"]
        if len(a) != 2 or len(b) != 2:
            raise AdapterError(f"{where}: the LoRA weights of {module!r} must be matrices, got {a} and {b}")
        if fmt == "peft":  # A (r, in), B (out, r)
            (r, in_dims), (out_dims, r_b) = a, b
        else:  # lora_a (in, r), lora_b (r, out)
            (in_dims, r), (r_b, out_dims) = a, b
        if r != r_b:
            raise AdapterError(f"{where}: the LoRA weights of {module!r} disagree on the rank ({a} and {b})")
        if r != rank:
            raise AdapterError(f"{where}: module {module!r} has rank {r}, the config says {rank}")
        modules.append(AdapterModule(module, pair["a"], pair["b"], in_dims, out_dims, r))
    return tuple(modules)

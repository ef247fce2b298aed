"""What `/api/tags`, `/api/show` and `/api/ps` say about the served models, in Ollama's words.

Read from the model manager's cards and the folder's config.json (never loading a model): Ollama's
`digest` is a hash of the source and size here (there are no Ollama manifests), `format` is
"safetensors" (or "gguf"), and sizes are the weights on disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

# A time far enough ahead that clients read it as "never" (Ollama shows keep_alive -1 the same way).
_NEVER = datetime(2318, 1, 1, tzinfo=timezone.utc)
# Ollama's model_info keys (after "<family>.") and the config.json fields they come from.
_MODEL_INFO = (("embedding_length", "hidden_size"), ("block_count", "num_hidden_layers"),
               ("attention.head_count", "num_attention_heads"), ("attention.head_count_kv", "num_key_value_heads"),
               ("vocab_size", "vocab_size"))
_BYTES_PER_PARAM = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}


def _config(source: str) -> dict:
    """The model's config.json, from its folder or the Hugging Face cache; {} when neither has it."""
    path = Path(source)
    candidate: Any = path / "config.json" if path.is_dir() else None
    if candidate is None and "/" in source and not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache  # the hub client: only for a hub id

            found = try_to_load_from_cache(source, "config.json")
            candidate = Path(found) if isinstance(found, str) else None
        except Exception:  # noqa: BLE001  no cache, a bad id: the listing goes on without details
            candidate = None
    try:
        return json.loads(candidate.read_text(encoding="utf-8")) if candidate is not None else {}
    except (OSError, ValueError):
        return {}


def _parameter_size(config: dict, weight_bytes: int) -> str:
    bits = (config.get("quantization") or {}).get("bits")
    per = bits / 8 if bits else _BYTES_PER_PARAM.get(str(config.get("torch_dtype") or config.get("dtype")), 2.0)
    n = weight_bytes / per
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def details(config: dict, source: str, weight_bytes: int) -> dict:
    family = str(config.get("model_type") or "unknown")
    bits = (config.get("quantization") or {}).get("bits")
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    return {"parent_model": "", "format": "gguf" if source.endswith(".gguf") else "safetensors",
            "family": family, "families": [family], "parameter_size": _parameter_size(config, weight_bytes),
            "quantization_level": f"Q{bits}" if bits else {"float16": "F16", "bfloat16": "BF16",
                                                          "float32": "F32"}.get(dtype, dtype.upper() or "unknown")}


def _digest(card: dict, source: str) -> str:
    return hashlib.sha256(f"{source}:{card.get('weight_bytes')}".encode()).hexdigest()


def _modified(source: str) -> str:
    try:
        mtime = Path(source).stat().st_mtime
    except OSError:
        mtime = time.time()
    return datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z")


def tag_entry(card: dict, source: str) -> dict:
    name = card["id"]
    return {"name": name, "model": name, "modified_at": _modified(source), "size": card.get("weight_bytes") or 0,
            "digest": _digest(card, source), "details": details(_config(source), source, card.get("weight_bytes") or 0)}


def ps_entry(card: dict, source: str, expires_in: Optional[float]) -> dict:
    entry = tag_entry(card, source)
    entry.pop("modified_at")
    expires = _NEVER if expires_in is None else datetime.fromtimestamp(time.time() + expires_in, timezone.utc)
    entry.update({"expires_at": expires.isoformat().replace("+00:00", "Z"), "size_vram": entry["size"],
                  "context_length": card.get("max_model_len") or 0})
    return entry


def capabilities(config: dict, served: Any) -> list[str]:
    """What the model does, as Ollama lists it: from the loaded model when there is one, else its config."""
    if served is not None:
        if served.embedding_only:
            return ["embedding"]
        caps = ["completion"]
        caps += ["insert"] if served.fim is not None else []  # `suffix` (serving/fim.py)
        caps += ["tools"] if served.tool_parser else []
        caps += ["thinking"] if served.reasoning_tags else []
        caps += ["vision"] if served.multimodal is not None else []
        return caps
    # BERT-style folders (models/encoder.py) are encoders: embeddings (or scores) only.
    if any("Bert" in a or "Roberta" in a for a in config.get("architectures") or ()):
        return ["embedding"]
    return ["completion"] + (["vision"] if "vision_config" in config else [])


def _template(source: str, served: Any) -> str:
    template = getattr(getattr(served, "tokenizer", None), "chat_template", None)
    if isinstance(template, str):
        return template
    path = Path(source)
    for name in ("chat_template.jinja",):
        if (path / name).is_file():
            return (path / name).read_text(encoding="utf-8")
    try:
        value = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError):
        return ""
    return value if isinstance(value, str) else ""


def show(card: dict, source: str, served: Any) -> dict:
    config = _config(source)
    info = details(config, source, card.get("weight_bytes") or 0)
    arch = info["family"]
    context = card.get("max_model_len") or config.get("max_position_embeddings") or 0
    model_info = {"general.architecture": arch, "general.basename": card["id"], f"{arch}.context_length": context}
    for key, ours in _MODEL_INFO:
        if config.get(ours) is not None:
            model_info[f"{arch}.{key}"] = config[ours]
    return {"modelfile": f"# served by mlxhost from {source}\nFROM {source}\n", "parameters": "",
            "template": _template(source, served), "details": info, "model_info": model_info,
            "capabilities": capabilities(config, served), "modified_at": _modified(source)}

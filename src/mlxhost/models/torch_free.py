"""Keeps PyTorch out of a process whose models all load through mlx-lm.

transformers imports torch wherever it is installed (5.17-5.24: `AutoTokenizer`'s module pulls in the generation
config, which imports it), and mlx-lm imports transformers' tokenizer classes as it is imported itself. So on
a machine that has PyTorch, a CUDA box typically, every `mlxhost serve` and each warm-up helper process it
starts paid torch's import before loading anything (docs/BENCHMARKS.md, "Start-up on MLX-CUDA"). A text model
loaded by mlx-lm, its tokenizer and its chat template use none of torch; vision processors, encoders and audio
models may, so those keep it. `MLXHOST_IMPORT_TORCH=1` keeps it for every model.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from mlxhost.models.loader import model_kind  # light: it imports no model library before a load

TORCH_ENV = "MLXHOST_IMPORT_TORCH"  # "1": torch imports as usual; "0": set by keep_torch_out for helpers


def is_text_model(source: str | None) -> bool:
    """True for the demo model (None) and for a local model folder whose config.json loads through mlx-lm;
    False for anything else (a hub id, a GGUF file, an unreadable config), which keeps torch."""
    if source is None:
        return True
    path = Path(source).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and model_kind(config) == "text"


def keep_torch_out(environ=os.environ) -> bool:
    """Makes torch look absent to this process, as on a machine without it, and tells the helper processes
    it starts (which load the same model) to do the same. Returns whether it did: not where TORCH_ENV is
    "1", nor once torch or transformers is imported (transformers decides whether torch exists once)."""
    if environ.get(TORCH_ENV) == "1" or sys.modules.get("torch") is not None or "transformers" in sys.modules:
        return False
    # A None entry makes importlib.util.find_spec("torch") answer None, which is how transformers asks.
    sys.modules["torch"] = None
    environ[TORCH_ENV] = "0"
    return True


def follow_parent(environ=os.environ) -> bool:
    """In a helper process: keep torch out where the server that started it did (TORCH_ENV "0")."""
    return environ.get(TORCH_ENV) == "0" and keep_torch_out(environ)

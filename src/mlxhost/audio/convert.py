"""`mlxhost convert FASTER_WHISPER_FOLDER OUT`: a faster-whisper (CTranslate2) Whisper folder written as
an mlx-whisper-layout MLX folder (config.json with the dimensions, weights.safetensors, tokenizer.json).

Serving the CTranslate2 folder itself works too (it is converted on every load, in about a second for
tiny); converting once gives a folder that mlx-whisper and mlx-audio read as well. Numpy only.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from mlxhost.audio.ct2 import read_model_bin, whisper_from_ct2
from mlxhost.audio.detect import whisper_layout


def is_ct2_whisper(folder: str | Path) -> bool:
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return whisper_layout(config) == "ct2" and (folder / "model.bin").is_file()


def convert_ct2_whisper(src: str | Path, out: str | Path, dtype: str = "float16") -> Path:
    src, out = Path(src), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty: name a new or empty folder")
    spec, variables = read_model_bin(src / "model.bin")
    if spec != "WhisperSpec":
        raise ValueError(f"{src / 'model.bin'} holds a CTranslate2 {spec}, not a Whisper model")
    dims, weights = whisper_from_ct2(variables)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v.astype(dtype)) for k, v in weights.items()}, str(out / "weights.safetensors"))
    config = {"model_type": "whisper", **dims}
    heads = json.loads((src / "config.json").read_text()).get("alignment_heads")
    if heads:
        config["alignment_heads"] = heads
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "vocabulary.txt"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


def run(args) -> int:
    try:
        out = convert_ct2_whisper(args.hf_path, args.out, args.dtype or "float16")
    except (FileExistsError, ValueError) as e:
        print(f"mlxhost convert: {e}", file=sys.stderr)
        return 2
    print(f"{out} (Whisper, MLX layout, {args.dtype or 'float16'})")
    return 0

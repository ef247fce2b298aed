"""Encoder embedding models (BERT, ModernBERT, XLM-RoBERTa folders), loaded through mlx-embeddings.

They answer `/v1/embeddings` only: no LM head, no KV cache, bidirectional attention. Which folders are
encoders and how their vectors are pooled is read off the folder here; the MLX work is in
engine/encoder.py.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxhost.models.loaded import LoadedModel, ModelLoadError, materialize

log = logging.getLogger(__name__)

# model_type (as mlx-embeddings names its modules) -> the prefix of its Hugging Face architectures.
# mlx-embeddings' other text models (qwen3, gemma3_text, ...) are decoders: mlx-lm serves those.
ENCODER_TYPES = {"bert": "Bert", "modernbert": "ModernBert", "xlm_roberta": "XLMRoberta"}
# sentence-transformers' pooling flags -> our pooling modes (engine/encoder.py `pool`).
_MODE_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
              "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "lasttoken"}
# sentence-transformers modules that change nothing we compute (we always L2-normalize).
_HARMLESS_MODULES = ("Transformer", "Pooling", "Normalize")


def encoder_type(config: dict) -> str | None:
    """The mlx-embeddings model type of an encoder config (by model_type, else by an architecture
    such as BertModel / ModernBertForMaskedLM); None for anything else."""
    model_type = str(config.get("model_type") or "").lower().replace("-", "_")
    if model_type in ENCODER_TYPES:
        return model_type
    for arch in config.get("architectures") or ():
        for kind, prefix in ENCODER_TYPES.items():
            if arch in (f"{prefix}Model", f"{prefix}ForMaskedLM", f"{prefix}ForSequenceClassification"):
                return kind
    return None


def read_pooling(folder: Path) -> str:
    """How the folder says to pool: sentence-transformers' Pooling module config (found through
    modules.json, else at 1_Pooling/), else mean over the attention mask (the common default)."""
    folder = Path(folder)
    pooling_dir = folder / "1_Pooling"
    modules = _read_json(folder / "modules.json")
    if isinstance(modules, list):
        for module in modules:
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            if kind == "Pooling":
                pooling_dir = folder / module.get("path", "1_Pooling")
            elif kind not in _HARMLESS_MODULES:
                # A Dense projection etc. would change the vectors: serving them without it is wrong.
                raise ModelLoadError(f"{folder / 'modules.json'}: sentence-transformers module {kind!r} "
                                     "is not supported (only Transformer, Pooling, Normalize)")
    cfg = _read_json(pooling_dir / "config.json")
    if cfg is None:
        return "mean"
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    if len(on) != 1 or on[0] not in _MODE_KEYS:
        raise ModelLoadError(f"{pooling_dir / 'config.json'}: needs exactly one of {', '.join(_MODE_KEYS)}; "
                             f"got {', '.join(on) or 'none'}")
    return _MODE_KEYS[on[0]]


@dataclass
class EncoderModel:
    """What the encoder engine needs: the mlx-embeddings module, how to pool, how to pad."""

    module: Any
    kind: str  # an ENCODER_TYPES key
    pooling: str  # "mean", "cls", "max" or "lasttoken"
    pad_token_id: int
    max_len: int  # positions an input may fill
    is_encoder = True  # LoadedModel.is_encoder reads this
    is_vlm = False


def load_encoder(source: str, config: dict) -> LoadedModel:
    """Loads an encoder folder with mlx-embeddings' `load` (weights, sanitize, quantization, tokenizer)."""
    try:
        from mlx_embeddings.utils import load  # optional: the embeddings extra
    except ImportError as exc:
        raise ModelLoadError(f"{source} is an encoder embedding model ({config.get('model_type')}); serving it "
                             "needs mlx-embeddings: pip install 'mlxhost[embeddings]'") from exc
    from mlxhost.models.cross_encoder import cross_encoder_type, load_cross_encoder  # lazy: pulls in mlx

    if cross_encoder_type(config) is not None:  # a reranker: a classification head over the encoder
        return load_cross_encoder(source, config)

    folder = Path(source)
    if not folder.is_dir():
        raise ModelLoadError(f"{source}: encoder embedding models are served from a local folder")
    kind = encoder_type(config)
    pooling = read_pooling(folder)
    start = time.perf_counter()
    try:
        # model_type spelled the way mlx-embeddings names its module (xlm-roberta -> xlm_roberta).
        module, tokenizer = load(source, model_config={"model_type": kind})
    except (ValueError, FileNotFoundError) as exc:
        raise ModelLoadError(f"{source}: mlx-embeddings cannot load it: {exc}") from exc
    materialize(module)
    elapsed = time.perf_counter() - start
    log.info("loaded encoder %s (%s, %s pooling) in %.2f s", source, kind, pooling, elapsed)
    positions = int(config.get("max_position_embeddings") or 512)
    if kind == "xlm_roberta":
        # RoBERTa's positions start after the padding id: 514 positions hold 512 tokens.
        positions -= int(config.get("pad_token_id", 1)) + 1
    pad = config.get("pad_token_id")
    pad = pad if pad is not None else (getattr(tokenizer, "pad_token_id", None) or 0)
    model = EncoderModel(module, kind, pooling, int(pad), positions)
    return LoadedModel(model, tokenizer, config, source, timings={"load": elapsed})


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from None

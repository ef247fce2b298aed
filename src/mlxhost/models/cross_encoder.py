"""Cross-encoder rerankers: BERT / XLM-RoBERTa sequence-classification folders (Hugging Face's
`BertForSequenceClassification`, `XLMRobertaForSequenceClassification`, as sentence-transformers'
CrossEncoder saves them), scoring a (query, document) pair in one forward.

mlx-embeddings has the encoders but no classification heads: the heads are written here, on top of its
BERT / XLM-RoBERTa modules, with Hugging Face's weight names (`bert.*` / `roberta.*`, `classifier.*`), so a
checkpoint loads as it is. BERT's head reads the pooler (tanh dense over [CLS]); RoBERTa's has its own
dense + tanh + projection over <s>. A one-logit head is turned into a relevance score by a sigmoid
(sentence-transformers' default), a two-logit head by the softmax of label 1.
"""

from __future__ import annotations

import glob
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxhost.models.loaded import LoadedModel, ModelLoadError, materialize

log = logging.getLogger(__name__)

# Hugging Face architecture -> mlx-embeddings model type.
ARCHITECTURES = {"BertForSequenceClassification": "bert", "XLMRobertaForSequenceClassification": "xlm_roberta"}
_ACTIVATIONS = ("sigmoid", "identity", "softmax")


def cross_encoder_type(config: dict) -> str | None:
    for arch in config.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    return None


def num_labels(config: dict) -> int:
    return int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)


class RobertaHead(nn.Module):
    def __init__(self, hidden: int, labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, labels)

    def __call__(self, first: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(first)))


class CrossEncoder(nn.Module):
    """Logits [B, num_labels] for right-padded pairs; attributes named as Hugging Face names the weights."""

    def __init__(self, kind: str, config: dict) -> None:
        super().__init__()
        self.kind = kind
        hidden, labels = int(config["hidden_size"]), num_labels(config)
        if kind == "bert":
            from mlx_embeddings.models.bert import Model, ModelArgs  # optional: the embeddings extra

            self.bert = Model(ModelArgs.from_dict({**config, "model_type": "bert"}))
            self.classifier = nn.Linear(hidden, labels)
        else:
            from mlx_embeddings.models.xlm_roberta import Model, ModelArgs  # optional: the embeddings extra

            self.roberta = Model(ModelArgs.from_dict({**config, "model_type": "xlm-roberta",
                                                      "add_pooling_layer": False}))
            self.classifier = RobertaHead(hidden, labels)

    @property
    def encoder_module(self) -> nn.Module:
        return self.bert if self.kind == "bert" else self.roberta

    def __call__(self, input_ids: mx.array, token_type_ids: mx.array, attention_mask: mx.array) -> mx.array:
        if self.kind == "bert":
            out = self.bert(input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
            return self.classifier(out.pooler_output)
        out = self.roberta(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return self.classifier(out.last_hidden_state[:, 0])


def activation(config: dict) -> str:
    """How logits become a relevance score: the folder's sentence-transformers setting, else by labels."""
    named = str((config.get("sentence_transformers") or {}).get("activation_fn") or "").rsplit(".", 1)[-1].lower()
    if named in _ACTIVATIONS:
        return named
    return "sigmoid" if num_labels(config) == 1 else "softmax"


@dataclass
class CrossEncoderModel:
    """What the encoder engine needs (models/encoder.py's EncoderModel fields, so /v1/embeddings of its
    encoder still works) plus the scoring head."""

    scorer: CrossEncoder
    kind: str
    pad_token_id: int
    max_len: int
    activation: str  # "sigmoid", "softmax" (label 1) or "identity"
    pooling: str = "cls"
    is_encoder = True
    is_vlm = False
    is_cross_encoder = True

    @property
    def module(self) -> nn.Module:
        return self.scorer.encoder_module


def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Hugging Face names as the module names them: old LayerNorm gamma/beta, buffers dropped."""
    out = {}
    for name, value in weights.items():
        if name.endswith("position_ids"):
            continue
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        out[name] = value
    return out


def load_cross_encoder(source: str, config: dict) -> LoadedModel:
    from transformers import AutoTokenizer  # lazy: transformers only when used

    folder = Path(source)
    kind = cross_encoder_type(config)
    if num_labels(config) > 2 and activation(config) != "identity":
        raise ModelLoadError(f"{source}: a sequence classifier with {num_labels(config)} labels is not a reranker")
    start = time.perf_counter()
    files = sorted(glob.glob(str(folder / "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{source}: no *.safetensors weights (convert a PyTorch checkpoint first)")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(f))
    module = CrossEncoder(kind, config)
    try:
        module.load_weights(list(sanitize(weights).items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"{source}: the weights do not fit a {kind} cross-encoder: {exc}") from exc
    module.eval()
    materialize(module)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    positions = int(config.get("max_position_embeddings") or 512)
    if kind == "xlm_roberta":
        positions -= int(config.get("pad_token_id", 1)) + 1  # RoBERTa's positions start after the padding id
    pad = config.get("pad_token_id")
    pad = int(pad if pad is not None else (tokenizer.pad_token_id or 0))
    model = CrossEncoderModel(module, kind, pad, positions, activation(config))
    elapsed = time.perf_counter() - start
    log.info("loaded cross-encoder %s (%s, %s) in %.2f s", source, kind, model.activation, elapsed)
    return LoadedModel(model, tokenizer, config, source, timings={"load": elapsed})


def read_config(folder: Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))

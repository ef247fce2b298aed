"""Offline builder of a tiny random-weight cross-encoder folder (a BERT or XLM-RoBERTa sequence classifier
with one relevance logit, as sentence-transformers' CrossEncoder saves rerankers).

The fixture for rerank: encoder_demo's WordPiece tokenizer (pairs as `[CLS] a [SEP] b [SEP]` with token
types), weights under Hugging Face's names written from models/cross_encoder.py's own module.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from mlxhost.testing.encoder_demo import _write_json, build_tokenizer


@dataclass(frozen=True)
class CrossEncoderDemoConfig:
    kind: str = "bert"  # or "xlm_roberta"
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    seed: int = 0


def _hf_config(config: CrossEncoderDemoConfig, vocab_size: int) -> dict:
    bert = config.kind == "bert"
    return {
        "architectures": ["BertForSequenceClassification" if bert else "XLMRobertaForSequenceClassification"],
        "model_type": "bert" if bert else "xlm-roberta",
        "vocab_size": vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "gelu",
        "max_position_embeddings": config.max_position_embeddings,
        "type_vocab_size": 2 if bert else 1,
        "layer_norm_eps": 1e-12 if bert else 1e-5,
        "pad_token_id": 0,  # encoder_demo's [PAD]
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
        "torch_dtype": "float32",
    }


def build_cross_encoder_folder(out_dir, config: CrossEncoderDemoConfig = CrossEncoderDemoConfig()) -> pathlib.Path:
    """Builds the tiny reranker folder at out_dir (created if missing) and returns its path."""
    import mlx.core as mx  # lazy: mlx only when used
    from mlx.utils import tree_flatten  # lazy: mlx only when used

    from mlxhost.models.cross_encoder import CrossEncoder  # lazy: pulls in mlx

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = _hf_config(config, build_tokenizer(out))
    _write_json(out / "config.json", hf_config)
    mx.random.seed(config.seed)
    module = CrossEncoder(config.kind, hf_config)
    weights = dict(tree_flatten(module.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    return out

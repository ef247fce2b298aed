"""Offline builder of a tiny random-weight BERT folder (a sentence-transformers-style embedding model).

The fixture for encoder embeddings: a WordPiece tokenizer trained here on the demo corpus, weights from
mlx-embeddings' own BERT class (so its loader reads them back as is), and optionally the
sentence-transformers files that name the pooling (`modules.json`, `1_Pooling/config.json`).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from mlxhost.testing.tokenizer_corpus import make_corpus

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # BERT's order: [PAD] is id 0
TOKENIZER_VOCAB_SIZE = 1024


@dataclass(frozen=True)
class EncoderDemoConfig:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    # "mean" or "cls": written as sentence-transformers' 1_Pooling/config.json; None: no such files
    # (the server then mean-pools, like most BERT embedding models).
    pooling: str | None = "mean"
    seed: int = 0

    def __post_init__(self):
        if self.pooling not in (None, "mean", "cls"):
            raise ValueError(f"pooling must be None, 'mean' or 'cls', got {self.pooling!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")


def _train_tokenizer():
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    # bert-base-uncased's pipeline: lowercase, split on spaces and punctuation, [CLS] ... [SEP].
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                        show_progress=False)
    tokenizer.train_from_iterator(make_corpus(num_lines=2000), trainer)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tokenizer


def build_tokenizer(out: pathlib.Path) -> int:
    """Writes tokenizer.json, vocab.txt and the configs transformers reads; returns the vocabulary size."""
    tokenizer = _train_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    (out / "vocab.txt").write_text("".join(token + "\n" for token, _ in vocab), encoding="utf-8")
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": True,
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "mask_token": "[MASK]",
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    })
    _write_json(out / "special_tokens_map.json", {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                                                  "unk_token": "[UNK]", "mask_token": "[MASK]"})
    return len(vocab)


def _hf_config(config: EncoderDemoConfig, vocab_size: int) -> dict:
    return {
        "architectures": ["BertModel"],
        "model_type": "bert",
        "vocab_size": vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "gelu",
        "max_position_embeddings": config.max_position_embeddings,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }


def _write_weights(out: pathlib.Path, config: EncoderDemoConfig, hf_config: dict) -> None:
    import mlx.core as mx  # lazy: mlx only when used
    from mlx.utils import tree_flatten  # lazy: mlx only when used
    from mlx_embeddings.models.bert import Model, ModelArgs  # optional: the embeddings extra

    mx.random.seed(config.seed)
    model = Model(ModelArgs.from_dict(hf_config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def _write_sentence_transformers(out: pathlib.Path, config: EncoderDemoConfig) -> None:
    _write_json(out / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    _write_json(out / "1_Pooling" / "config.json", {
        "word_embedding_dimension": config.hidden_size,
        "pooling_mode_cls_token": config.pooling == "cls",
        "pooling_mode_mean_tokens": config.pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    })


def build_encoder_folder(out_dir, config: EncoderDemoConfig = EncoderDemoConfig()) -> pathlib.Path:
    """Builds the tiny BERT folder at out_dir (created if missing) and returns its path."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = _hf_config(config, build_tokenizer(out))
    _write_json(out / "config.json", hf_config)
    _write_weights(out, config, hf_config)
    if config.pooling is not None:
        _write_sentence_transformers(out, config)
    return out


def _write_json(path: pathlib.Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")

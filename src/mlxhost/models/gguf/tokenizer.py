"""The tokenizer a GGUF's metadata describes, written as tokenizer.json + tokenizer_config.json.

transformers builds it (vocabulary, merges, pre-tokenizer split, control and user-defined tokens) from
the same metadata keys llama.cpp writes. Its own GGUF reader imports torch, so we hand its tokenizer
builder the metadata our reader parsed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import processors

from mlxhost.models.gguf.reader import GGUFError, GGUFHeader

log = logging.getLogger(__name__)

_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
            "pad_token": "padding_token_id"}


def _builder():
    """transformers' GGUF tokenizer builder: `convert_gguf_tokenizer(architecture, tokenizer_dict)` and
    its metadata key map (module moved in transformers 5)."""
    try:
        # lazy: transformers only when used
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        try:
            # lazy: transformers only when used
            from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
        except ImportError as exc:
            raise GGUFError("building a tokenizer from GGUF metadata needs transformers' GGUF tokenizer "
                            f"builder (pip install -U transformers): {exc}") from None
    return GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer


def write_tokenizer(header: GGUFHeader, out: Path, max_length: int) -> dict:
    """Writes the tokenizer files into `out`; returns tokenizer_config.json's content."""
    meta = header.metadata
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError(f"{header.path}: no tokenizer in its metadata (tokenizer.ggml.tokens)")
    mapping, convert = _builder()
    tokenizer_dict = {name: meta[f"tokenizer.{key}"] for key, name in mapping["tokenizer"].items()
                      if f"tokenizer.{key}" in meta}
    try:
        backend, _ = convert(header.architecture, tokenizer_dict)
    except (ValueError, KeyError, TypeError) as exc:
        raise GGUFError(f"{header.path}: cannot build its tokenizer: {exc}") from None
    tokens = meta["tokenizer.ggml.tokens"]
    _add_bos_eos(backend, meta, tokens)
    backend.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    for name, key in _SPECIAL.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[name] = tokens[int(token_id)]
    # A sentencepiece ("llama") vocabulary without the flag gets a BOS, as llama.cpp does.
    default_bos = meta.get("tokenizer.ggml.model") == "llama"
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    else:
        # Ollama's template layer is Go template syntax, not Jinja: it cannot stand in for one.
        log.warning("%s: no chat template in its metadata; chat requests need one, plain completions "
                    "work", header.path)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return config


def _add_bos_eos(backend, meta: dict, tokens: list[str]) -> None:
    """BOS / EOS added by the tokenizer itself, as llama.cpp does when the file asks for it (Gemma's and
    Llama's sentencepiece vocabularies): tokenizer_config's add_bos_token alone does not change
    tokenizer.json, which is what a fast tokenizer runs."""
    default_bos = meta.get("tokenizer.ggml.model") == "llama"
    wrap = []
    for key, flag, default in (("bos", "add_bos_token", default_bos), ("eos", "add_eos_token", False)):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if bool(meta.get(f"tokenizer.ggml.{flag}", default)) and token_id is not None:
            wrap.append((key, tokens[int(token_id)], int(token_id)))
    if not wrap:
        return
    bos = next((f"{t}:0 " for k, t, _ in wrap if k == "bos"), "")
    eos = next((f" {t}:0" for k, t, _ in wrap if k == "eos"), "")
    template = processors.TemplateProcessing(single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos} {bos}$B:1{eos}",
                                             special_tokens=sorted({(t, i) for _, t, i in wrap}))
    existing = backend.post_processor
    backend.post_processor = template if existing is None else processors.Sequence([existing, template])


def stop_token_ids(header: GGUFHeader) -> list[int]:
    """End of sequence, end of turn and end of message ids the file names (generation stops at each)."""
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = header.metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids

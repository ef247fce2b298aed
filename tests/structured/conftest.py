"""A tokenizer whose tool and reasoning tags are single added tokens, as in Qwen2.5/Qwen3 (`<tool_call>`,
`<think>`: added, not special), Mistral (`[TOOL_CALLS]`: special) and Llama 3 (`<|python_tag|>`: special).
It is the demo tokenizer with those tokens added after its vocabulary: built in about a second, no download."""

import pytest

TEXT_TAGS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
SPECIAL_TAGS = ("[TOOL_CALLS]", "<|python_tag|>")


@pytest.fixture(scope="session")
def tagged_tokenizer_dir(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer

    from mlxserve.models.demo import build_tokenizer

    path = tmp_path_factory.mktemp("tagged-tokenizer")
    build_tokenizer(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TAGS])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TAGS])
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="session")
def tagged_tokenizer(tagged_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tagged_tokenizer_dir))

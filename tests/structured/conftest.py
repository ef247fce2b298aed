"""The demo tokenizer with its tool and reasoning tags as single added tokens (`mlxhost.testing.tag_tokens`)."""

import pytest


@pytest.fixture(scope="session")
def tagged_tokenizer_dir(tmp_path_factory):
    from mlxhost.testing.demo import build_tokenizer
    from mlxhost.testing.tag_tokens import add_tag_tokens

    path = tmp_path_factory.mktemp("tagged-tokenizer")
    build_tokenizer(path)
    add_tag_tokens(path)
    return path


@pytest.fixture(scope="session")
def tagged_tokenizer(tagged_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tagged_tokenizer_dir))

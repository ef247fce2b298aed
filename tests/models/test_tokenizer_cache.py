"""The tokenizer kept between starts (models/tokenizer_cache.py): read back, it tokenizes, templates and
detokenizes as the freshly loaded one does; any change to the folder's tokenizer files, or a torn file, loads
afresh."""

from __future__ import annotations

import os
import shutil

import mlx_lm.utils
import pytest

from mlxhost.engine.detokenizer import make_detokenizer_factory
from mlxhost.models.tokenizer_cache import load_tokenizer, tokenizer_key

TEXT = "Héllo, wörld! 1234 <think>tokens</think>"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture
def folder(qwen3_model_dir, tmp_path):
    own = tmp_path / "model"
    shutil.copytree(qwen3_model_dir, own)  # a copy: the tests edit its tokenizer files
    return own


@pytest.fixture
def fresh_loads(monkeypatch):
    """Counts mlx-lm's own loads (the cache's misses)."""
    calls = []
    real = mlx_lm.utils.load_tokenizer

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(mlx_lm.utils, "load_tokenizer", counted)
    return calls


def _same(a, b) -> None:
    ids = a.encode(TEXT)
    assert b.encode(TEXT) == ids
    assert b.decode(ids) == a.decode(ids)
    assert b.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == \
        a.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert b.eos_token_ids == a.eos_token_ids
    assert (b.think_start, b.think_end, b.has_tool_calling) == (a.think_start, a.think_end, a.has_tool_calling)
    detok_a, detok_b = make_detokenizer_factory(a)(ids[:2]), make_detokenizer_factory(b)(ids[:2])
    assert [detok_b.add(t) for t in ids] == [detok_a.add(t) for t in ids]


def test_read_back_as_loaded(folder, tmp_path, fresh_loads):
    cache = tmp_path / "cache"
    first = load_tokenizer(folder, [1, 2], cache)
    assert len(fresh_loads) == 1 and len(list(cache.glob("tokenizer-*.pickle"))) == 1
    again = load_tokenizer(folder, [1, 2], cache)
    assert len(fresh_loads) == 1  # read back, not loaded
    assert again is not first
    _same(first, again)
    assert again.eos_token_ids == {1, 2}


def test_no_cache_folder_loads_afresh(folder, fresh_loads):
    load_tokenizer(folder, None, None)
    load_tokenizer(folder, None, None)
    assert len(fresh_loads) == 2


def test_changes_load_afresh(folder, tmp_path, fresh_loads):
    cache = tmp_path / "cache"
    load_tokenizer(folder, None, cache)
    load_tokenizer(folder, [7], cache)  # other eos ids
    assert len(fresh_loads) == 2
    before = tokenizer_key(folder, None)
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"model_max_length": 131072', '"model_max_length": 77'))
    assert tokenizer_key(folder, None) != before
    edited = load_tokenizer(folder, None, cache)
    assert len(fresh_loads) == 3 and edited.model_max_length == 77
    # Weight files are not read into the key: a re-quantized model keeps its tokenizer.
    (folder / "model.safetensors").write_bytes(b"not weights")
    load_tokenizer(folder, None, cache)
    assert len(fresh_loads) == 3


def test_torn_file_loads_afresh_and_is_replaced(folder, tmp_path, fresh_loads):
    cache = tmp_path / "cache"
    first = load_tokenizer(folder, None, cache)
    (path,) = cache.glob("tokenizer-*.pickle")
    path.write_bytes(path.read_bytes()[:1000])
    again = load_tokenizer(folder, None, cache)
    assert len(fresh_loads) == 2
    _same(first, again)
    load_tokenizer(folder, None, cache)
    assert len(fresh_loads) == 2  # the file was written whole again


def test_the_folder_keeps_the_most_recently_used(folder, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    for i in range(10):
        old = cache / f"tokenizer-old{i}.pickle"
        old.write_bytes(b"x")
        os.utime(old, (1000 + i, 1000 + i))
    stale = cache / ".tokenizer-left-by-a-dead-start"
    stale.write_bytes(b"x")
    os.utime(stale, (1000, 1000))
    load_tokenizer(folder, None, cache)
    kept = sorted(p.name for p in cache.glob("tokenizer-*.pickle"))
    assert len(kept) == 8 and f"tokenizer-{tokenizer_key(folder, None)}.pickle" in kept
    assert "tokenizer-old9.pickle" in kept and "tokenizer-old2.pickle" not in kept
    assert not stale.exists()

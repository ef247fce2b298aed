import pytest

from mlxserve.cache.hashing import (
    HASH_SIZE,
    block_extra_keys,
    block_hashes,
    disk_key,
    extend_block_hashes,
    hash_block,
)


def test_hash_is_deterministic_and_sized():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, (1, 2, 3, 4))
    assert isinstance(a, bytes) and len(a) == HASH_SIZE


def test_golden_digest_is_stable():
    # Digests name files in the SSD tier: a format change must be deliberate (HASH_VERSION).
    assert hash_block(None, [1, 2, 3]).hex() == "eaf78493205262ee8b91f11c9a54e5c7"


def test_hash_depends_on_parent_tokens_and_extra_keys():
    tokens = [5, 6, 7, 8]
    root = hash_block(None, tokens)
    p1 = hash_block(None, [1, 1, 1, 1])
    p2 = hash_block(None, [2, 2, 2, 2])
    assert hash_block(p1, tokens) != hash_block(p2, tokens)
    assert hash_block(p1, tokens) != root  # a parent differs from no parent
    assert hash_block(None, [8, 7, 6, 5]) != root  # order matters
    assert hash_block(None, tokens, ("img-a",)) != hash_block(None, tokens, ("img-b",))
    assert hash_block(None, tokens, ("img-a",)) != root


def test_extra_key_encoding_is_unambiguous():
    t = [1, 2]
    assert hash_block(None, t, ("ab",)) != hash_block(None, t, ("a", "b"))
    assert hash_block(None, t, ("1",)) != hash_block(None, t, (1,))
    assert hash_block(None, t, (b"x",)) != hash_block(None, t, ("x",))
    assert hash_block(None, t, (True,)) != hash_block(None, t, (1,))
    assert hash_block(None, t, (("a", "b"),)) != hash_block(None, t, ("a", "b"))
    # Tokens and keys cannot bleed into each other.
    assert hash_block(None, [1, 2, 3]) != hash_block(None, [1, 2], (3,))


def test_unsupported_extra_key_type_raises():
    with pytest.raises(TypeError):
        hash_block(None, [1], (object(),))


def test_block_hashes_chain_and_skip_partial_tail():
    tokens = list(range(10))
    hashes = block_hashes(tokens, 4, model_key="m")
    assert len(hashes) == 2  # 2 full blocks, tail of 2 tokens not hashed
    extra = block_extra_keys("m")
    h0 = hash_block(None, tokens[0:4], extra)
    assert hashes == [h0, hash_block(h0, tokens[4:8], extra)]


def test_chained_hash_changes_when_an_earlier_block_changes():
    a = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = block_hashes([1, 2, 3, 0, 9, 9, 9, 9], 4)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same second block, different prefix


def test_model_key_and_extra_keys_change_every_block():
    tokens = list(range(8))
    base = block_hashes(tokens, 4, model_key="model-a")
    other_model = block_hashes(tokens, 4, model_key="model-b")
    other_extra = block_hashes(tokens, 4, extra_keys=("img",), model_key="model-a")
    assert all(x != y for x, y in zip(base, other_model))
    assert all(x != y for x, y in zip(base, other_extra))
    assert block_hashes(tokens, 4) == block_hashes(tokens, 4, model_key="")


def test_extend_block_hashes_is_incremental():
    tokens = list(range(13))
    full = block_hashes(tokens, 4, model_key="m")
    acc: list[bytes] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(acc, tokens[:n], 4, model_key="m")
        assert len(acc) == n // 4
    assert acc == full
    limited = extend_block_hashes([], tokens, 4, model_key="m", max_num_blocks=1)
    assert limited == full[:1]


def test_disk_key_is_hex_round_trip():
    h = hash_block(None, [1, 2, 3])
    key = disk_key(h)
    assert key == h.hex() and len(key) == 2 * HASH_SIZE
    assert bytes.fromhex(key) == h

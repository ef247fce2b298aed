import pytest

from mlxhost.kv.hashing import (
    HASH_SIZE,
    block_extra_keys,
    block_hashes,
    disk_key,
    extend_block_hashes,
    group_span,
    hash_block,
)


def test_hash_is_deterministic_and_sized():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, (1, 2, 3, 4))
    assert isinstance(a, bytes) and len(a) == HASH_SIZE


def test_golden_digest_is_stable():
    # Digests name files in the SSD tier: a format change must be deliberate (HASH_VERSION).
    assert hash_block(None, [1, 2, 3]).hex() == "b0b51427b164e5bc9710a6e108f3f008"


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


# --- media spans: image hashes as extra keys of the blocks their placeholder tokens touch -------------

PAD = 7  # an image placeholder id: every image of one size gives the same run of it


def _image_prompt(start: int = 20, num_image_tokens: int = 30, total: int = 80) -> list[int]:
    tokens = [100 + i for i in range(total)]
    tokens[start:start + num_image_tokens] = [PAD] * num_image_tokens
    return tokens


def test_different_image_changes_blocks_from_the_first_one_touching_it():
    tokens = _image_prompt(start=20, num_image_tokens=30)  # placeholders at 20..49
    a = block_hashes(tokens, 16, model_key="m", media_spans=[(20, 50, "image-a")])
    b = block_hashes(tokens, 16, model_key="m", media_spans=[(20, 50, "image-b")])
    assert len(a) == len(b) == 5
    assert a[0] == b[0]  # block 0 (0..15) holds only text before the image
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # 1..3 hold image tokens, 4 follows them (chain)
    assert a == block_hashes(tokens, 16, model_key="m", media_spans=[(20, 50, "image-a")])
    # Without the hash the same tokens would share every block whatever the picture.
    plain = block_hashes(tokens, 16, model_key="m")
    assert plain[0] == a[0] and plain[1] != a[1]


def test_media_hash_is_an_extra_key_of_exactly_the_blocks_it_overlaps():
    tokens = _image_prompt(start=16, num_image_tokens=16)  # placeholders fill block 1 exactly
    spans = [(16, 32, "img")]
    hashes = block_hashes(tokens, 16, model_key="m", media_spans=spans)
    extra = block_extra_keys("m")
    h0 = hash_block(None, tokens[0:16], extra)
    h1 = hash_block(h0, tokens[16:32], extra + ("img",))
    h2 = hash_block(h1, tokens[32:48], extra)  # the span ends at 32: block 2 does not carry it
    assert hashes[:3] == [h0, h1, h2]


def test_two_images_in_one_block_both_count_in_order():
    tokens = _image_prompt(start=2, num_image_tokens=4, total=16)
    tokens[8:12] = [PAD] * 4
    ab = block_hashes(tokens, 16, media_spans=[(2, 6, "a"), (8, 12, "b")])
    ba = block_hashes(tokens, 16, media_spans=[(2, 6, "b"), (8, 12, "a")])
    only_a = block_hashes(tokens, 16, media_spans=[(2, 6, "a")])
    assert ab == [hash_block(None, tokens, ("a", "b"))]
    assert len({ab[0], ba[0], only_a[0]}) == 3


def test_extend_block_hashes_with_media_is_incremental():
    tokens = _image_prompt(start=20, num_image_tokens=30, total=70)
    spans = [(20, 50, "img")]
    full = block_hashes(tokens, 16, model_key="m", media_spans=spans)
    acc: list[bytes] = []
    for n in range(0, len(tokens) + 1, 5):
        extend_block_hashes(acc, tokens[:n], 16, model_key="m", media_spans=spans)
    extend_block_hashes(acc, tokens, 16, model_key="m", media_spans=spans)
    assert acc == full


def test_a_group_span_from_a_shared_prefix_leaves_out_only_the_blocks_wholly_before_it():
    tokens, bs = list(range(64)), 16
    plain = block_hashes(tokens, bs)
    a = block_hashes(tokens, bs, media_spans=(group_span("key:a", 37),))
    b = block_hashes(tokens, bs, media_spans=(group_span("key:b", 37),))
    assert a[:2] == b[:2] == plain[:2]  # tokens 0..31: all shared, hashed as without a group
    assert all(x != y != z for x, y, z in zip(a[2:], b[2:], plain[2:]))  # the block holding token 37 on: grouped
    assert block_hashes(tokens, bs, media_spans=(group_span("key:a"),)) == \
        block_hashes(tokens, bs, media_spans=(group_span("key:a", 0),))
    assert block_hashes(tokens, bs, media_spans=(group_span("key:a", 0),))[0] != plain[0]

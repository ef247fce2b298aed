"""MultimodalPromptBuilder on the tiny Qwen2.5-VL / Qwen3-VL fixtures: placeholder expansion, spans,
the grid memo, and refusals when placeholders and media do not line up."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from mlxhost.config import MediaConfig
from mlxhost.models.loader import load_model
from mlxhost.multimodal.hashing import image_hash
from mlxhost.multimodal.media import MediaError
from mlxhost.multimodal.prompt import MediaPart, MultimodalPromptBuilder
from mlxhost.multimodal.video import decode_video
from tests.multimodal.test_video import make_mp4


@pytest.fixture(scope="module")
def qwen25(qwen25vl_dir):
    return load_model(str(qwen25vl_dir))


@pytest.fixture(scope="module")
def qwen3(qwen3vl_dir):
    return load_model(str(qwen3vl_dir))


@pytest.fixture
def builder(qwen25):
    # Function scope: a fresh grid memo per test.
    return MultimodalPromptBuilder(qwen25.model, qwen25.tokenizer, MediaConfig())


def noise(seed: int, width: int = 300, height: int = 224) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def uri(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(*parts: str, text: str = "describe this") -> list[dict]:
    return [{"role": "user", "content": [{"type": p} for p in parts] + [{"type": "text", "text": text}]}]


def test_image_expands_to_grid_product_over_merge_squared(builder, qwen25):
    model = qwen25.model
    img = noise(0)
    ids, (item,) = builder.build(user("image"), [MediaPart("image", uri(img))])
    t, h, w = item.grid_thw
    n = t * h * w // model.merge_size**2
    assert model.merge_size == 2 and n == item.num_tokens and n > 16
    ((start, length),) = item.spans
    assert length == n and ids.count(model.image_token_id) == n
    assert ids[start:start + n] == [model.image_token_id] * n
    vocab = qwen25.tokenizer
    assert ids[start - 1] == vocab.convert_tokens_to_ids("<|vision_start|>")
    assert ids[start + n] == vocab.convert_tokens_to_ids("<|vision_end|>")
    assert item.kind == "image" and item.content_hash == image_hash(img)
    assert item.pixel_values is not None and item.pixel_values.shape[0] == t * h * w

    # The same ids and pixels as the model's own processor (mlx-vlm's prompt path).
    text = model.processor.tokenizer.apply_chat_template(user("image"), add_generation_prompt=True, tokenize=False)
    ref = model.processor(text=[text], images=[img])
    assert ids == np.asarray(ref["input_ids"])[0].tolist()
    assert np.array_equal(item.pixel_values, np.asarray(ref["pixel_values"]))


def test_two_images_get_spans_in_order(builder, qwen25):
    small, large = noise(1, 64, 64), noise(2, 300, 224)
    ids, items = builder.build(user("image", "image"), [MediaPart("image", uri(small)), MediaPart("image", uri(large))])
    assert [m.content_hash for m in items] == [image_hash(small), image_hash(large)]
    (s1, n1), (s2, n2) = items[0].spans[0], items[1].spans[0]
    assert s1 + n1 < s2 and n1 < n2
    assert ids.count(qwen25.model.image_token_id) == n1 + n2


def test_repeated_image_skips_preprocessing(builder, qwen25, monkeypatch):
    part = MediaPart("image", uri(noise(3)))
    ids, (first,) = builder.build(user("image"), [part])
    calls = []
    monkeypatch.setattr(qwen25.model, "preprocess_image", lambda image: calls.append(image))
    ids2, (again,) = builder.build(user("image"), [part])
    assert calls == []  # not preprocessed (nor decoded) a second time
    assert ids2 == ids
    assert again.pixel_values is None and again.image is None
    assert (again.content_hash, again.grid_thw, again.spans) == (first.content_hash, first.grid_thw, first.spans)
    assert again.encoded is not None  # what the engine decodes if its vision cache dropped the features


def test_placeholder_typed_in_text_is_refused(builder):
    # A client typing the placeholder token must not smuggle in an image slot without pixels.
    with pytest.raises(MediaError, match="placed 2 images .* has 1 and 0"):
        builder.build(user("image", text="look: <|image_pad|>"), [MediaPart("image", uri(noise(4)))])
    with pytest.raises(MediaError, match="placed 1 images .* has 0 and 0"):
        builder.build(user(text="<|vision_start|><|image_pad|><|vision_end|>"), [])
    with pytest.raises(MediaError, match="placed 1 images and 1 videos"):
        builder.build(user("image", text="<|video_pad|>"), [MediaPart("image", uri(noise(4)))])


def test_media_count_must_match_the_template(builder):
    with pytest.raises(MediaError, match="placed 1 images"):
        builder.build(user("image"), [])
    with pytest.raises(MediaError, match="placed 0 images"):
        builder.build(user(), [MediaPart("image", uri(noise(5)))])


def test_bad_media_is_a_media_error(builder):
    with pytest.raises(MediaError, match="invalid base64"):
        builder.build(user("image"), [MediaPart("image", "data:image/png;base64,***")])


@pytest.fixture(scope="module")
def video_uri():
    return "data:video/mp4;base64," + base64.b64encode(make_mp4()).decode()


def test_qwen25_video_is_one_run(builder, qwen25, video_uri):
    ids, (item,) = builder.build(user("video"), [MediaPart("video", video_uri, 4.0, 6)])
    t, h, w = item.grid_thw
    assert item.kind == "video" and item.sampling == (4.0, 6)
    assert item.spans == ((item.spans[0][0], t * h * w // 4),)
    assert ids.count(qwen25.model.video_token_id) == item.num_tokens


def test_qwen3_video_has_one_run_per_frame_group_with_timestamps(qwen3, video_uri):
    builder = MultimodalPromptBuilder(qwen3.model, qwen3.tokenizer, MediaConfig())
    ids, (item,) = builder.build(user("video"), [MediaPart("video", video_uri, 4.0, 6)])
    t, h, w = item.grid_thw
    per_group = h * w // qwen3.model.merge_size**2
    assert t > 1 and len(item.spans) == t
    assert all(n == per_group for _, n in item.spans)
    # Each group is marked with the mean time of its two frames (6 frames spread over the 2 s clip).
    times = decode_video(make_mp4(), MediaConfig(), 4.0, 6).timestamps
    marks = [f"<{(times[2 * g] + times[2 * g + 1]) / 2:.1f} seconds><|vision_start|>" for g in range(t)]
    text = qwen3.tokenizer.decode(ids)
    assert text.count("seconds>") == t and all(m in text for m in marks), (marks, text)
    assert [text.index(m) for m in marks] == sorted(text.index(m) for m in marks)


def test_too_many_media_parts_are_refused_before_any_fetch(qwen25vl_dir):
    from mlxhost.config import MediaConfig
    from mlxhost.models.loader import load_model
    from mlxhost.multimodal.media import MediaError
    from mlxhost.multimodal.prompt import MediaPart, MultimodalPromptBuilder

    loaded = load_model(str(qwen25vl_dir))
    builder = MultimodalPromptBuilder(loaded.model, loaded.tokenizer, MediaConfig(max_media_per_request=2))
    parts = [MediaPart("image", "http://10.255.255.1/never-fetched.png")] * 3
    messages = [{"role": "user", "content": [{"type": "image"}] * 3}]
    with pytest.raises(MediaError, match="at most 2"):
        builder.build(messages, parts)


def test_a_processor_refusal_is_a_media_error(qwen25vl_dir):
    import base64
    import io

    from PIL import Image

    from mlxhost.config import MediaConfig
    from mlxhost.models.loader import load_model
    from mlxhost.multimodal.media import MediaError
    from mlxhost.multimodal.prompt import MediaPart, MultimodalPromptBuilder

    loaded = load_model(str(qwen25vl_dir))
    builder = MultimodalPromptBuilder(loaded.model, loaded.tokenizer, MediaConfig())
    buf = io.BytesIO()
    Image.new("RGB", (1, 400)).save(buf, "PNG")  # aspect ratio 400: Qwen's processor refuses > 200
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image"}]}]
    with pytest.raises(MediaError, match="cannot take this media"):
        builder.build(messages, [MediaPart("image", url)])


def test_tools_and_earlier_tool_calls_reach_the_template_with_an_image(qwen25):
    """An agent's turn with a screenshot keeps its tools and the calls before it, as a text-only turn does: the
    chat template gets them (this fixture's template has no place for tools; real Qwen-VL ones do)."""
    seen = {}

    class Recording:
        def __init__(self, tokenizer):
            self._tok = tokenizer

        def apply_chat_template(self, messages, **kwargs):
            seen.update(messages=messages, **kwargs)
            return self._tok.apply_chat_template(messages, **kwargs)

        def __getattr__(self, name):
            return getattr(self._tok, name)

    builder = MultimodalPromptBuilder(qwen25.model, Recording(qwen25.tokenizer), MediaConfig())
    tools = [{"type": "function", "function": {"name": "click_button", "description": "Click a button",
                                               "parameters": {"type": "object", "properties": {}}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "click_button", "arguments": {}}}
    messages = [{"role": "user", "content": "open the page"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "clicked"}, *user("image", text="what now?")]
    builder.build(messages, [MediaPart("image", uri(noise(3)))], tools, enable_thinking=False)
    assert seen["tools"] == tools and seen["enable_thinking"] is False
    assert seen["messages"][1]["tool_calls"] == [call] and seen["messages"][2]["tool_call_id"] == "c1"

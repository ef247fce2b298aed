"""Multimodal prefill in the engine core, on the tiny Qwen2.5-VL and Qwen3-VL fixtures: logprobs equal
mlx-vlm's own forward over the whole prompt (tower + language model in one call) however the prompt is
chunked, batched with text, served from the prefix cache or the vision cache, or re-encoded."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.prompt_utils import apply_chat_template
from PIL import Image

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import MediaItem, Request, SamplingParams
from mlxhost.models.loader import load_model

FAMILIES = {"qwen2_5_vl": "qwen25vl_dir", "qwen3_vl": "qwen3vl_dir"}
TOL = 1e-4


def noise(seed: int, width: int = 300, height: int = 224) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


class Fixture:
    """One loaded VLM, the prompts it is asked and mlx-vlm's reference log-probabilities."""

    def __init__(self, model_dir) -> None:
        self.loaded = load_model(str(model_dir))
        self.model = self.loaded.model
        self.prompt = apply_chat_template(self.model.processor, self.model.vlm.config, "describe this", num_images=1)

    def inputs(self, img):
        return self.model.processor(text=[self.prompt], images=[img])

    def prompt_ids(self, img) -> list[int]:
        return np.asarray(self.inputs(img)["input_ids"])[0].tolist()

    def item(self, img, key: str, **overrides) -> MediaItem:
        ids = self.prompt_ids(img)
        pixels, grid = self.model.preprocess_image(img)
        start, n = ids.index(self.model.image_token_id), ids.count(self.model.image_token_id)
        fields = dict(pixel_values=pixels, image=img) | overrides
        return MediaItem(key, "image", ((start, n),), grid, **fields)

    def reference(self, img, generated: list[int] = ()) -> np.ndarray:
        """Log-softmax rows [len(generated) + 1, vocab] for the last prompt position and each generated
        token after it, from one mlx-vlm forward over prompt + generated tokens."""
        inputs = self.inputs(img)
        extra = {k: mx.array(np.asarray(v)) for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        ids = self.prompt_ids(img) + list(generated)
        lm = self.model.vlm.language_model
        lm._rope_deltas = lm._position_ids = None  # mlx-vlm keeps rope state between calls
        out = self.model.vlm(mx.array([ids]), **extra)
        logits = (out.logits if hasattr(out, "logits") else out)[0, len(ids) - len(generated) - 1:]
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def core(self, **config) -> EngineCore:
        return EngineCore(self.model, self.loaded.tokenizer, EngineConfig(**config), 4096)


@pytest.fixture(scope="module", params=list(FAMILIES))
def fx(request) -> Fixture:
    return Fixture(request.getfixturevalue(FAMILIES[request.param]))


def run(core: EngineCore, *requests: Request) -> dict:
    """request id -> (token ids, logprob entries), all requests in one batch."""
    out = {r.request_id: ([], []) for r in requests}
    for r in requests:
        core.add_request(r)
    while core.has_work:
        for o in core.step():
            assert o.error is None, o.error
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.logprobs or ())
    return out


def first_token_request(fx: Fixture, rid: str, item: MediaItem, img) -> Request:
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=5)
    return Request(rid, fx.prompt_ids(img), params, media=(item,))


def text_request(fx: Fixture, rid: str) -> Request:
    ids = fx.loaded.tokenizer.encode("hello there, how are you doing today?")
    return Request(rid, ids, SamplingParams(max_tokens=4, temperature=0.0))


def assert_matches(entry, ref_row: np.ndarray) -> None:
    """A first-token logprob entry (top 5) against a reference log-softmax row."""
    top = np.argsort(-ref_row)[:5]
    assert [t for t, _ in entry.top] == top.tolist()
    assert max(abs(lp - ref_row[t]) for t, lp in entry.top) < TOL
    assert entry.token_id == top[0] and abs(entry.logprob - ref_row[top[0]]) < TOL


@pytest.mark.parametrize("step", [16, 512])
def test_chunked_prefill_with_text_neighbour_and_prefix_hit_matches_mlx_vlm(fx, step):
    # step 16: the image's placeholders (60+ tokens) spread over several chunks; 512: one chunk.
    core = fx.core(prefill_step_size=step, block_size=16)
    for k, img in enumerate([noise(0), noise(1)]):
        ref = fx.reference(img)[0]
        item = fx.item(img, f"image-{k}")
        for rep in range(2):
            rid = f"img-{k}-{rep}"
            request = first_token_request(fx, rid, item, img)
            out = run(core, text_request(fx, f"text-{k}-{rep}"), request)
            assert_matches(out[rid][1][0], ref)
            # The repeat starts from the prefix cache: every block with image placeholders is reused.
            if rep == 1:
                start, n = item.spans[0]
                assert request.num_cached_tokens >= (start + n) // 16 * 16 > start
    # Two different images of one size: same tokens, so only their hashes kept their blocks apart.
    assert fx.prompt_ids(noise(0)) == fx.prompt_ids(noise(1))
    assert core.vision_stats()["num_encoded"] == 2


def test_sampled_decode_matches_mlx_vlm_at_every_position(fx):
    """Decode positions carry the multimodal rope delta: every sampled token's logprob equals the
    full forward over prompt + sampled tokens."""
    img = noise(3, 330, 200)
    core = fx.core(prefill_step_size=32, block_size=16)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, logprobs=True, top_logprobs=3)
    request = Request("a", fx.prompt_ids(img), params, media=(fx.item(img, "h"),))
    out = run(core, request, text_request(fx, "t"))
    tokens, entries = out["a"]
    assert len(tokens) == 8
    ref = fx.reference(img, tokens[:-1])
    errors = [abs(ref[i][e.token_id] - e.logprob) for i, e in enumerate(entries)]
    assert max(errors) < TOL, errors


def test_vision_cache_hit_skips_the_tower(fx):
    img = noise(4)
    core = fx.core(prefill_step_size=64, block_size=16, enable_prefix_cache=False)
    item = fx.item(img, "h")
    ref = fx.reference(img)[0]
    for rep in range(2):
        out = run(core, first_token_request(fx, f"r{rep}", item, img))
        assert_matches(out[f"r{rep}"][1][0], ref)
    stats = core.vision_stats()
    assert (stats["num_encoded"], stats["num_reused"], stats["entries"]) == (1, 1, 1)


def test_vision_cache_eviction_reencodes_identically(fx):
    img_a, img_b = noise(5), noise(6)
    item_a, item_b = fx.item(img_a, "a"), fx.item(img_b, "b")
    one_entry = fx.model.encode(item_a.pixel_values, item_a.grid_thw).nbytes
    # Room for one image's features: B evicts A, so A is encoded again.
    core = fx.core(prefill_step_size=64, block_size=16, enable_prefix_cache=False,
                   vision_cache_bytes=one_entry + one_entry // 2)
    assert core.vision_cache.max_bytes == one_entry + one_entry // 2
    ref_a, ref_b = fx.reference(img_a)[0], fx.reference(img_b)[0]
    a1 = run(core, first_token_request(fx, "a1", item_a, img_a))["a1"][1][0]
    b = run(core, first_token_request(fx, "b", item_b, img_b))["b"][1][0]
    a2 = run(core, first_token_request(fx, "a2", item_a, img_a))["a2"][1][0]
    stats = core.vision_stats()
    assert stats["num_encoded"] == 3 and stats["num_reused"] == 0
    assert stats["evictions"] == 2 and stats["entries"] == 1
    assert_matches(a1, ref_a)
    assert_matches(b, ref_b)
    assert a2 == a1


def test_item_without_pixels_is_preprocessed_again(fx):
    """The HTTP side sends no pixels for an image it saw before; if the vision cache no longer has
    it, the engine decodes the image (or its encoded bytes) and runs the processor itself."""
    img = noise(7)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    ref = fx.reference(img)[0]
    core = fx.core(prefill_step_size=64, block_size=16, enable_prefix_cache=False, vision_cache_bytes=0)
    assert core.vision_cache is None
    decoded = fx.item(img, "h", pixel_values=None)
    encoded = fx.item(img, "h", pixel_values=None, image=None, encoded=buf.getvalue())
    for rid, item in (("decoded", decoded), ("encoded", encoded)):
        out = run(core, first_token_request(fx, rid, item, img))
        assert_matches(out[rid][1][0], ref)
    assert core.runner.mm.num_encoded == 2

"""Gemma 3 in the engine core, on the tiny fixture (sliding window 32, 16 image tokens): prompts from
the MultimodalPromptBuilder equal mlx-vlm's processor output, and logprobs equal mlx-vlm's own
forward (`get_input_embeddings` then the language model, what its `generate` runs) however the
prompt is chunked and batched with text, with the sliding-window caches wrapping."""

from __future__ import annotations

import base64
import io

import mlx.core as mx
import numpy as np
import pytest

from mlxhost.config import EngineConfig, MediaConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import Request, SamplingParams
from mlxhost.models.loader import load_model
from mlxhost.multimodal.prompt import MediaPart, MultimodalPromptBuilder
from tests.engine.test_mm_prefill import TOL, assert_matches, noise, run

QUESTION = "describe this picture in a few words"


def data_uri(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Gemma3Fixture:
    def __init__(self, model_dir) -> None:
        self.loaded = load_model(str(model_dir))
        self.model = self.loaded.model
        self.builder = MultimodalPromptBuilder(self.model, self.loaded.tokenizer, MediaConfig())
        self.messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]

    def request(self, rid: str, img, params: SamplingParams) -> Request:
        ids, media = self.builder.build(self.messages, [MediaPart("image", data_uri(img))])
        return Request(rid, ids, params, media=media)

    def processor_inputs(self, img):
        processor = self.model.processor
        text = processor.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=False)
        return processor(text=[text], images=[img])

    def reference(self, img, generated: list[int] = ()) -> np.ndarray:
        """Log-softmax rows for the last prompt position and each generated token after it, from one
        uncached mlx-vlm forward over prompt + generated tokens."""
        inputs = self.processor_inputs(img)
        prompt = np.asarray(inputs["input_ids"])[0].tolist()
        ids = mx.array([prompt + list(generated)])
        vlm = self.model.vlm
        embeds = vlm.get_input_embeddings(ids, mx.array(np.asarray(inputs["pixel_values"])), mask=mx.ones(ids.shape))
        logits = vlm.language_model(ids, inputs_embeds=embeds.inputs_embeds).logits[0, len(prompt) - 1:]
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    def core(self, buckets: list[int] | None = None, **config) -> EngineCore:
        return EngineCore(self.model, self.loaded.tokenizer, EngineConfig(**config), 4096, buckets)


@pytest.fixture(scope="module")
def fx(gemma3_dir) -> Gemma3Fixture:
    return Gemma3Fixture(gemma3_dir)


def text_request(fx: Gemma3Fixture, rid: str, max_tokens: int = 12) -> Request:
    # Longer than the window, so the text row's sliding-window cache wraps too.
    ids = fx.loaded.tokenizer.encode("hello there, how are you doing today? " * 4)
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_builder_gives_the_processors_ids_and_pixels(fx):
    img = noise(0)
    request = fx.request("a", img, SamplingParams(max_tokens=1))
    inputs = fx.processor_inputs(img)
    assert request.prompt_token_ids == np.asarray(inputs["input_ids"])[0].tolist()
    (item,) = request.media
    assert np.array_equal(item.pixel_values, np.asarray(inputs["pixel_values"]))
    soft = fx.model.image_token_id
    ((start, n),) = item.spans
    assert n == 16 and request.prompt_token_ids[start:start + n] == [soft] * n
    # The prompt is longer than the 32-token window: the sliding-window layers' caches wrap.
    assert len(request.prompt_token_ids) > fx.model.lm.config.sliding_window


def test_caches_are_mlx_lm_sliding_window_and_global_and_prefix_sharing_is_on(fx):
    kinds = [type(c).__name__ for c in fx.model.make_cache()]
    assert kinds == ["RotatingKVCache", "KVCache"]
    assert all(type(c).__module__.startswith("mlx_lm.") for c in fx.model.make_cache())
    # Windows restored from blocks, as for text models (tests/engine/test_mm_prefix_sliding.py).
    core = fx.core(block_size=16)
    assert core.prefix is not None
    assert (core.runner.store.layout.swa_layers, core.runner.store.layout.window) == ((0,), 32)


@pytest.mark.parametrize("step", [8, 512])
def test_first_token_matches_mlx_vlm_chunked_and_next_to_text(fx, step):
    # step 8: the image's 16 placeholders span three chunks; 512: the whole prompt in one.
    core = fx.core(prefill_step_size=step, block_size=16)
    for k, img in enumerate([noise(0), noise(1)]):
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=5)
        out = run(core, text_request(fx, f"text-{k}"), fx.request(f"img-{k}", img, params))
        assert_matches(out[f"img-{k}"][1][0], fx.reference(img)[0])
        assert len(out[f"text-{k}"][0]) == 12
    assert core.vision_stats()["num_encoded"] == 2


@pytest.mark.parametrize("batching", [{}, {"buckets": [1, 2, 4], "kv_prealloc_tokens": 64}])
def test_sampled_decode_matches_mlx_vlm_at_every_position(fx, batching):
    # Bucketed: filler rows, and the shrink when the image row ends, go through the rotating caches' filter.
    img = noise(3, 330, 200)
    core = fx.core(prefill_step_size=8, block_size=16, **batching)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, logprobs=True, top_logprobs=3)
    # Three rows: the bucketed batch holds one filler row until the image row ends, then shrinks to 2.
    out = run(core, fx.request("a", img, params), text_request(fx, "t"), text_request(fx, "u", 10))
    tokens, entries = out["a"]
    assert len(tokens) == 8
    ref = fx.reference(img, tokens[:-1])
    errors = [abs(ref[i][e.token_id] - e.logprob) for i, e in enumerate(entries)]
    assert max(errors) < TOL, errors


def test_vision_cache_hit_skips_the_tower(fx):
    img = noise(4)
    # Prefix cache off: the repeat would resume past the image and need no features at all.
    core = fx.core(prefill_step_size=16, block_size=16, enable_prefix_cache=False)
    ref = fx.reference(img)[0]
    for rep in range(2):
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=5)
        out = run(core, fx.request(f"r{rep}", img, params))
        assert_matches(out[f"r{rep}"][1][0], ref)
    stats = core.vision_stats()
    assert (stats["num_encoded"], stats["num_reused"]) == (1, 1)

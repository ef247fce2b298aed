"""Quantized KV on a vision-language model (tiny Qwen2.5-VL): an image request's greedy tokens are the same
alone, next to a text request and from the prefix cache, and its first-token log-probabilities stay close to
float KV's (the image's placeholders are ordinary KV positions once the prefill wrote them)."""

from __future__ import annotations

import numpy as np
from mlx_vlm.prompt_utils import apply_chat_template
from PIL import Image

from mlxhost.config import EngineConfig
from mlxhost.engine.core import EngineCore
from mlxhost.engine.request import MediaItem, Request, SamplingParams
from mlxhost.models.loader import load_model


def test_image_request_with_quantized_kv(qwen25vl_dir):
    loaded = load_model(str(qwen25vl_dir))
    model = loaded.model
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (224, 300, 3), dtype=np.uint8))
    prompt = apply_chat_template(model.processor, model.vlm.config, "describe this", num_images=1)
    ids = np.asarray(model.processor(text=[prompt], images=[img])["input_ids"])[0].tolist()
    pixels, grid = model.preprocess_image(img)
    start, n = ids.index(model.image_token_id), ids.count(model.image_token_id)
    item = MediaItem("img", "image", ((start, n),), grid, pixel_values=pixels, image=img)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=1)

    def run(core, *extra):
        request = Request(f"img-{len(extra)}-{id(core)}", ids, params, media=(item,))
        core.add_request(request)
        for r in extra:
            core.add_request(r)
        tokens, entries = [], []
        while core.has_work:
            for o in core.step():
                assert o.error is None, o.error
                if o.request_id == request.request_id:
                    tokens += o.new_token_ids
                    entries += o.logprobs or ()
        return tokens, entries, request.num_cached_tokens

    def core(**kw):
        config = EngineConfig(block_size=16, prefill_step_size=32, kv_group_size=32, **kw)
        return EngineCore(model, loaded.tokenizer, config, 4096, model_key="vlm")

    float_tokens, float_entries, _ = run(core())
    quant = core(kv_bits=8)
    assert quant.status()["kv_quantization"]["quantized_layers"] == 2
    alone, entries, _ = run(quant)
    text = Request("text", loaded.tokenizer.encode("hello there, how are you?"), SamplingParams(max_tokens=4))
    beside, _, cached = run(quant, text)
    assert beside == alone and cached >= (start + n) // 16 * 16 > start  # a prefix hit over the image
    assert abs(entries[0].logprob - float_entries[0].logprob) < 0.1 and alone[0] == float_tokens[0]

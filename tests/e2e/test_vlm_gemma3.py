"""Gemma 3 served end to end: the real server on the tiny Gemma 3 fixture (sliding window 32, 16 image
tokens), checked against mlx-vlm's own generate and forward and against caches off.

"Caches on" is the prefix cache (its sliding windows restored from blocks) and the vision cache.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx_vlm
import numpy as np
import pytest

from tests.e2e.test_vlm import (
    IMAGE,
    IMAGE_PNG,
    MAX_NEW,
    QUESTION,
    ask,
    assert_error,
    chat,
    client as openai_client,
    data_uri,
    noise_image,
    png,
    post_chat,
    template_ask,
    tokens_of,
    video_part,
    vision_stats,
)

ENGINE = dict(prefill_step_size=8, block_size=16)  # the 16 image tokens span three prefill chunks


@pytest.fixture(scope="module")
def on(make_module_server, gemma3_dir):
    return make_module_server(gemma3_dir, **ENGINE)


@pytest.fixture(scope="module")
def off(make_module_server, gemma3_dir):
    return make_module_server(gemma3_dir, enable_prefix_cache=False, vision_cache_bytes=0, **ENGINE)


@pytest.fixture(scope="module")
def reference(gemma3_dir):
    return mlx_vlm.load(str(gemma3_dir))


def test_image_chat_matches_mlx_vlm_generate_and_forward(on, reference, tmp_path):
    model, processor = reference
    r = chat(on, [ask(data_uri(IMAGE_PNG))], logprobs=True, top_logprobs=5)

    # The same prompt text through mlx-vlm's generate: the same tokens, greedy.
    prompt = processor.tokenizer.apply_chat_template([template_ask()], add_generation_prompt=True, tokenize=False)
    (tmp_path / "img.png").write_bytes(IMAGE_PNG)
    result = mlx_vlm.generate(model, processor, prompt, image=[str(tmp_path / "img.png")], max_tokens=MAX_NEW,
                              temperature=0.0)
    assert r.choices[0].message.content == processor.tokenizer.decode(result.token_ids)
    assert r.usage.prompt_tokens == result.prompt_tokens > 16

    # First-token distribution against mlx-vlm's forward (embeddings, then the language model).
    inputs = processor(text=[prompt], images=[IMAGE])
    ids = mx.array(np.asarray(inputs["input_ids"]))
    embeds = model.get_input_embeddings(ids, mx.array(np.asarray(inputs["pixel_values"])), mask=mx.ones(ids.shape))
    logits = model.language_model(ids, inputs_embeds=embeds.inputs_embeds).logits[0, -1]
    ref = np.array(logits - mx.logsumexp(logits))
    top_ids = np.argsort(-ref)[:5]
    first = r.choices[0].logprobs.content[0]
    assert first.token == processor.tokenizer.decode([int(top_ids[0])])
    got = [(e.token, e.logprob) for e in first.top_logprobs]
    assert [t for t, _ in got] == [processor.tokenizer.decode([int(t)]) for t in top_ids]
    assert [lp for _, lp in got] == pytest.approx([float(ref[t]) for t in top_ids], abs=1e-4)


def test_conversation_is_identical_with_caches_off_and_hits_the_prefix_cache(on, off):
    follow_ups = ["What colors do you see?", "Anything else?"]
    runs = {}
    for name, live in (("on", on), ("off", off)):
        messages, turns = [{"role": "system", "content": "Be brief."}, ask(data_uri(IMAGE_PNG))], []
        for turn in range(3):
            r = chat(live, messages, logprobs=True, top_logprobs=2)
            turns.append((r.choices[0].message.content, tokens_of(r), r.usage.prompt_tokens))
            cached = r.usage.prompt_tokens_details.cached_tokens
            if name == "off":
                assert cached == 0
            elif turn > 0:  # turn 1's image and text come from the prefix cache
                assert cached >= turns[-2][2] - ENGINE["block_size"]
            if turn < 2:
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": follow_ups[turn]}]
        runs[name] = turns
    assert runs["on"] == runs["off"]
    assert vision_stats(on)["entries"] >= 1


def test_concurrent_image_and_text_requests_equal_their_solo_runs(on):
    requests = [[ask(data_uri(png(noise_image(10 + i))), f"picture {i}: {QUESTION}")] for i in range(2)]
    requests += [[{"role": "user", "content": f"Tell me something about topic number {i}, at length."}]
                 for i in range(2)]

    def run(messages):
        r = chat(on, messages, logprobs=True)
        return r.choices[0].message.content, tokens_of(r)

    alone = [run(m) for m in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(run, requests))
    assert together == alone


def test_text_only_chat_and_completions(on, off):
    outs = []
    for live in (on, off):
        r = chat(live, [{"role": "user", "content": "Hello there, how are you?"}])
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
        with openai_client(live) as c:
            cr = c.completions.create(model=live.model_name, prompt="Once upon a time", max_tokens=MAX_NEW,
                                      temperature=0.0)
        assert cr.usage.completion_tokens >= 1
        outs.append((r.choices[0].message.content, cr.choices[0].text))
    assert outs[0] == outs[1]


def test_video_is_a_400(on):
    response = post_chat(on, [{"role": "user", "content": [video_part(data_uri(b"\x00" * 64, "video/mp4")),
                                                          {"type": "text", "text": "hi"}]}])
    assert_error(response, "takes no video")
    assert response.json()["error"]["param"] == "video_url"

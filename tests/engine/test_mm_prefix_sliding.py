"""The prefix cache on a vision-language model with sliding-window layers (the tiny Gemma 3 fixture: window
32, 16 image tokens at positions 8-24, blocks of 16, so the window spans two blocks and the image two).
Image and text requests resume from cached blocks, the sliding layers' window restored from the blocks
inside it, with greedy tokens and their logprobs equal to a core with the prefix cache off, however the
prompt is chunked, on a restart from the SSD tier, and with several requests at once."""

from __future__ import annotations

import numpy as np
import pytest

from mlxhost.engine.request import Request, SamplingParams
from mlxhost.multimodal.prompt import MediaPart
from tests.engine.test_mm_prefill import TOL, noise
from tests.engine.test_mm_prefill_gemma3 import Gemma3Fixture, data_uri

BS = 16
QUESTION = "describe this picture in a few words"


@pytest.fixture(scope="module")
def fx(gemma3_dir) -> Gemma3Fixture:
    return Gemma3Fixture(gemma3_dir)


def core(fx: Gemma3Fixture, step: int = 8, **kw):
    return fx.core(block_size=BS, prefill_step_size=step, cache_memory_bytes=32 << 20, **kw)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)


def ask(fx: Gemma3Fixture, messages: list[dict], images: list, max_tokens: int = 8) -> Request:
    ids, media = fx.builder.build(messages, [MediaPart("image", data_uri(img)) for img in images])
    return Request("", ids, params(max_tokens), media=media)


def user(question: str = QUESTION, image: bool = True) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * image + [{"type": "text", "text": question}]}


def run(engine, requests: dict[str, Request]) -> dict[str, dict]:
    """request id -> greedy ids, their logprobs and the prompt tokens served from the prefix cache."""
    out = {rid: {"ids": [], "lps": [], "cached": 0} for rid in requests}
    for rid, r in requests.items():
        engine.add_request(Request(rid, r.prompt_token_ids, r.sampling, media=r.media))
    while engine.has_work:
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id]["ids"] += o.new_token_ids
            out[o.request_id]["lps"] += [e.logprob for e in o.logprobs or ()]
            out[o.request_id]["cached"] = o.num_cached_tokens
    return out


def one(engine, request: Request) -> dict:
    return run(engine, {"r": request})["r"]


def assert_same(got: dict, want: dict) -> None:
    assert got["ids"] == want["ids"]
    assert np.max(np.abs(np.array(got["lps"]) - np.array(want["lps"]))) < TOL


def then(request: Request, answer: list[int], fx: Gemma3Fixture, text: str) -> Request:
    """The next turn as token ids: this prompt, its answer and a new user message, the same images."""
    tail = fx.loaded.tokenizer.encode(text, add_special_tokens=False)
    return Request("", request.prompt_token_ids + answer + tail, request.sampling, media=request.media)


@pytest.mark.parametrize("step, kv_bits", [(8, None), (24, None), (8, 8)])
def test_turns_repeats_and_other_images_match_the_cache_off(fx, step, kv_bits):
    # step 8: each image chunk half a block; 24: chunks across block and image boundaries. Under
    # --kv-bits the global layer's blocks are quantized, the sliding one's stay float.
    kw = {"kv_bits": kv_bits, "kv_group_size": 32} if kv_bits else {}
    on, off = core(fx, step, **kw), core(fx, step, enable_prefix_cache=False, **kw)
    assert on.prefix is not None and on.runner.store.layout.swa_layers
    turn1 = ask(fx, [user()], [noise(0)], 20)
    first = one(on, turn1)
    assert first["cached"] == 0
    assert_same(first, one(off, turn1))
    # Turn 2 on turn 1's prompt and answer: the window resumes from the answer's blocks.
    turn2 = then(turn1, first["ids"], fx, "<end_of_turn>\n<start_of_turn>user\nand its colours?")
    second = one(on, turn2)
    assert second["cached"] == (len(turn1.prompt_token_ids) + 20) // BS * BS
    assert_same(second, one(off, turn2))
    # The same prompt again: resumed at its last block boundary, past the image.
    again = one(on, turn1)
    assert again["cached"] == (len(turn1.prompt_token_ids) - 1) // BS * BS
    assert_same(again, first)
    # The same text with another picture: the image's hash ends the hit before the image.
    other = ask(fx, [user()], [noise(1)])
    assert other.prompt_token_ids == turn1.prompt_token_ids
    got = one(on, other)
    assert got["cached"] <= other.media[0].spans[0][0]
    assert_same(got, one(off, other))


def test_a_new_image_after_a_hit_and_text_only_requests(fx):
    on, off = core(fx, 24), core(fx, 24, enable_prefix_cache=False)
    turn1 = ask(fx, [user()], [noise(0)])
    one(on, turn1)
    # Through the chat template, a second picture in turn 2: its features go in after the restored window.
    messages = [user(), {"role": "assistant", "content": "a grey square."}, user("and this one?")]
    turn2 = ask(fx, messages, [noise(0), noise(2)])
    second = one(on, turn2)
    assert second["cached"] >= len(turn1.prompt_token_ids) - BS
    assert second["cached"] <= turn2.media[1].spans[0][0]
    assert_same(second, one(off, turn2))
    text = ask(fx, [user("hello there, how are you doing today? " * 3, image=False)], [])
    cold = one(on, text)
    warm = one(on, text)
    assert cold["cached"] == 0 and warm["cached"] == (len(text.prompt_token_ids) - 1) // BS * BS
    assert_same(cold, one(off, text))
    assert_same(warm, cold)


@pytest.mark.parametrize("vision_cache_bytes", [None, 0])
def test_a_hit_that_ends_inside_the_image(fx, vision_cache_bytes):
    # Another question about the same picture shares block 0 only: the prefill resumes at 16, halfway
    # through the image (features from the vision cache, or encoded again without one).
    kw = {} if vision_cache_bytes is None else {"vision_cache_bytes": vision_cache_bytes}
    on, off = core(fx, 8, **kw), core(fx, 8, enable_prefix_cache=False)
    one(on, ask(fx, [user()], [noise(0)]))
    request = ask(fx, [user("what is in it?")], [noise(0)])
    ((start, n),) = request.media[0].spans
    got = one(on, request)
    assert start < got["cached"] == BS < start + n
    assert_same(got, one(off, request))


def test_concurrent_conversations_on_one_image(fx):
    on, off = core(fx, 24), core(fx, 24, enable_prefix_cache=False)
    img = noise(3)
    turn1 = {f"c{i}": ask(fx, [user(f"{QUESTION}, number {i}")], [img], 6 + i) for i in range(4)}
    cold, reference = run(on, turn1), run(off, turn1)
    for rid in turn1:
        assert_same(cold[rid], reference[rid])
    turn2 = {rid: then(r, cold[rid]["ids"], fx, "<end_of_turn>\n<start_of_turn>user\nwhy?") for rid, r in turn1.items()}
    warm, reference = run(on, turn2), run(off, turn2)
    for rid, r in turn1.items():
        assert_same(warm[rid], reference[rid])
        assert warm[rid]["cached"] >= len(r.prompt_token_ids) - BS


def test_restart_from_the_ssd_tier(fx, tmp_path):
    turn1 = ask(fx, [user()], [noise(4)], 20)
    first = core(fx, 24, ssd_cache_dir=str(tmp_path))
    answer = one(first, turn1)
    first.close()
    second = core(fx, 24, ssd_cache_dir=str(tmp_path), vision_cache_bytes=0)
    assert second.cache_stats()["num_cached_blocks"] == 0
    turn2 = then(turn1, answer["ids"], fx, "<end_of_turn>\n<start_of_turn>user\nand its colours?")
    out = one(second, turn2)
    assert out["cached"] == (len(turn1.prompt_token_ids) + 20) // BS * BS
    assert_same(out, one(core(fx, 24, enable_prefix_cache=False), turn2))
    stats = second.cache_stats()
    # Sliding KV is read back only for the blocks inside the window where the hit resumes.
    assert stats["ssd"]["hits"] == out["cached"] // BS and stats["ssd_windows"]["hits"] == 32 // BS
    again = one(second, turn1)
    second.close()
    assert again["cached"] == (len(turn1.prompt_token_ids) - 1) // BS * BS
    assert_same(again, answer)
    assert second.runner.mm.num_encoded == 0  # every image token came from the SSD tier


def test_a_vision_model_with_recurrent_layers_keeps_the_cache_off(fx, tmp_path):
    """No recurrent-layer VLM has run snapshots with images: such a model (a recurrent text fixture
    marked as a VLM here) gets no prefix cache, while the Gemma 3 VLM gets one."""
    from mlxhost.kv.kinds.probe import probe_kv
    from mlxhost.models.loader import load_model
    from mlxhost.testing.families import build_family_folder

    assert probe_kv(fx.model).shareable
    hybrid = load_model(str(build_family_folder(tmp_path, "qwen3_next"))).model
    assert probe_kv(hybrid).shareable
    hybrid.is_vlm = True
    probe = probe_kv(hybrid)
    assert not probe.shareable and "recurrent" in probe.why_unshareable


@pytest.mark.parametrize("step", [8, 24, 512])
def test_a_last_chunk_in_one_forward_on_cuda(fx, step, monkeypatch):
    """On CUDA a short last chunk (image or text) runs as one forward, not its body and its last token
    apart, and matches the split."""
    monkeypatch.setattr("mlxhost.engine.runner.model_runner.is_cuda", lambda: False)
    split = core(fx, step)
    monkeypatch.setattr("mlxhost.engine.runner.model_runner.is_cuda", lambda: True)
    whole = core(fx, step)
    assert split.runner.prefiller.one_forward_logits == 0 < whole.runner.prefiller.one_forward_logits
    turn1 = ask(fx, [user()], [noise(0)], 12)
    first = one(split, turn1)
    assert_same(one(whole, turn1), first)
    turn2 = then(turn1, first["ids"], fx, "<end_of_turn>\n<start_of_turn>user\nand its colours?")
    second = one(split, turn2)
    assert second["cached"] > 0
    assert_same(one(whole, turn2), second)

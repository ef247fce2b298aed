"""64 concurrent streams through the official openai client: every one gets its whole text.

A GPU run saw 1 of 64 streams end without a content chunk. Here the streams are pushed onto the cases a
random model hits when it repeats one token (forced with logit_bias): a UTF-8 lead byte, part of a
4-byte character, a space plus a lead byte (held back until the next token or the end of the reply,
then U+FFFD as the tokenizer's own `decode` gives it), a special token (no text: a model that only
says that says nothing, in every server), next to plain replies; chat and text completions, streamed
with usage. Each stream's text must equal the tokenizer's decode of the tokens it was sent.
"""

from __future__ import annotations

import asyncio
import logging

import openai
import pytest
from mlx_lm.utils import load_tokenizer

STREAMS = 64
_BOUND_S = 240  # bounds the whole burst: a lost or hung stream fails the test instead of blocking it


@pytest.fixture(scope="module")
def live(qwen3_model_dir, make_module_server):
    return make_module_server(qwen3_model_dir, max_num_seqs=STREAMS, prefill_step_size=256)


@pytest.fixture(scope="module")
def tokenizer(qwen3_model_dir):
    return load_tokenizer(qwen3_model_dir)


def forced_tokens(tokenizer) -> list[int | None]:
    """Token ids to force: three that end inside a UTF-8 character, a special one, and None (free text)."""
    vocab = tokenizer._tokenizer.get_vocab() if hasattr(tokenizer, "_tokenizer") else tokenizer.get_vocab()
    by_piece = {piece: i for piece, i in vocab.items()}
    lead = by_piece["ä"]  # the byte-level alphabet's 0xE4: the first byte of a 3-byte character
    partial = next(i for piece, i in by_piece.items() if piece == "ðŁ")  # F0 9F: half an emoji
    spaced = next(i for piece, i in by_piece.items() if piece == "Ġâ")  # " " + E2
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    return [lead, partial, spaced, special, None]


async def one(client: openai.AsyncOpenAI, i: int, forced: int | None, chat: bool) -> tuple[str, int, str | None]:
    """Streams request `i`; returns (its text, completion tokens from usage, finish reason)."""
    extra = {"ignore_eos": True}
    if forced is not None:
        extra["logit_bias"] = {str(forced): 100}
    common = dict(model="tiny", max_tokens=1 + i % 5, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra)
    if chat:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": f"stream {i}: say something"}], **common)
    else:
        stream = await client.completions.create(prompt=f"stream {i}: say something", **common)
    text, tokens, finish = "", 0, None
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else (choice.text or "")
            finish = choice.finish_reason or finish
    return text, tokens, finish


@pytest.mark.anyio
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_64_concurrent_streams_each_get_their_text(live, tokenizer, chat, caplog):
    caplog.set_level(logging.INFO, logger="mlxhost.engine.core")
    cases = forced_tokens(tokenizer)
    async with openai.AsyncOpenAI(base_url=live.base_url, api_key="x", max_retries=0, timeout=_BOUND_S) as client:
        results = await asyncio.wait_for(
            asyncio.gather(*(one(client, i, cases[i % len(cases)], chat) for i in range(STREAMS))), _BOUND_S)
    for i, (text, tokens, finish) in enumerate(results):
        forced, n = cases[i % len(cases)], 1 + i % 5
        assert (tokens, finish) == (n, "length"), i
        if forced is None:
            assert text, i  # a plain reply of the fixture model always has text
            continue
        expected = tokenizer.decode([forced] * n, skip_special_tokens=True)
        assert text == expected, (i, forced, text, expected)
        assert text or forced == cases[3], i  # only the special token says nothing
    # Those empty replies are named in the log with their tokens, so they are not taken for lost streams.
    silent = [r for r in caplog.records if "without any text" in r.getMessage()]
    assert len(silent) == sum(cases[i % len(cases)] == cases[3] for i in range(STREAMS))
    assert all(f"[{cases[3]}]" in r.getMessage() for r in silent)

"""One streamed request of `mlxhost bench serve`, timed on the client: its prompt and body, the SSE read that
times the first token and each gap, and the per-request rates a level pools."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from mlxhost.bench.serve import ServeBenchConfig

# Short common words: with its leading space each is one token in the BPE vocabularies of
# Llama, Qwen, Mistral, Gemma..., so the word count tracks the prompt's token count.
_WORDS = (
    "the of and to in is it that was for on are as with his they at be this from have or "
    "by one had not but what all were when we there can an your which their said if do will "
    "each about how up out them then she many some so these would other into has more her two "
    "like him see time could no make than first been its who now people my made over did down "
    "only way find use may water long little very after words called just where most know get "
    "through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place well"
).split()

# Tokens taken by the "Request <tag>.<i>:" header and a BOS token; subtracted so the
# prompt lands near prompt_tokens.
_PROMPT_OVERHEAD_TOKENS = 6

def decode_rate(num_tokens: int, decode_s: float | None) -> float | None:
    """One request's decode rate: the tokens after the first over the seconds from the first token's event to
    the last token's, (n - 1) / (last - first); None when that span holds no token or no time."""
    if num_tokens < 2 or not decode_s or decode_s <= 0:
        return None
    return (num_tokens - 1) / decode_s


def e2e_rate(num_tokens: int, e2e_s: float | None) -> float | None:
    """One request's tokens over its whole time, send to end of stream: the rate its user sees."""
    return num_tokens / e2e_s if e2e_s and e2e_s > 0 else None


def pooled_rate(pairs: list[tuple[float, float]]) -> float | None:
    """Sum of tokens over sum of seconds, from (tokens, seconds) pairs: the per-request rate of a level. A mean
    of per-request ratios would let one request whose tokens arrived in a burst (microseconds apart) swamp it."""
    seconds = sum(s for _, s in pairs)
    return sum(n for n, _ in pairs) / seconds if seconds > 0 else None


@dataclass
class RequestResult:
    error: str | None = None
    ttft_s: float | None = None  # send -> first non-empty content chunk
    e2e_s: float | None = None  # send -> end of stream
    # First content chunk -> the last event that carried a token (content or not: a token whose text is held
    # back, or the finish event, still ends after that token was made).
    decode_s: float | None = None
    num_chunks: int = 0  # SSE events that carried content
    num_completion_tokens: int = 0
    num_prompt_tokens: int | None = None  # as the server's usage reports it
    itl_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tokens_per_chunk(self) -> float:
        return max(1.0, self.num_completion_tokens / self.num_chunks) if self.num_chunks else 1.0

    @property
    def decode_tok_s(self) -> float | None:
        return decode_rate(self.num_completion_tokens, self.decode_s) if self.ok else None

    @property
    def e2e_tok_s(self) -> float | None:
        return e2e_rate(self.num_completion_tokens, self.e2e_s) if self.ok else None

    def summary(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "itl_s"}
        out["decode_tok_s"], out["e2e_tok_s"] = self.decode_tok_s, self.e2e_tok_s
        return out


def make_prompt(seed: int, tag: str, index: int, prompt_tokens: int) -> str:
    """A prompt of about prompt_tokens tokens, distinct for every (tag, index).

    The index leads the prompt so that no two requests share a first block: a prefix
    cache must not make later requests cheaper than the first.
    """
    rng = random.Random(f"{seed}/{tag}/{index}")
    words = rng.choices(_WORDS, k=max(1, prompt_tokens - _PROMPT_OVERHEAD_TOKENS))
    return f"Request {tag}.{index}: " + " ".join(words)


def make_body(cfg: ServeBenchConfig, prompt: str) -> dict:
    body: dict = {"model": cfg.model, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": 0, "max_tokens": cfg.max_tokens}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # keeps every request at max_tokens, so runs compare
    return body


def _chunk_text(event: dict, chat: bool) -> str:
    choice = (event.get("choices") or [{}])[0]  # the usage chunk has no choices
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # Reasoning models stream thinking under its own key; those are generated tokens too.
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


async def stream_request(
    client: httpx.AsyncClient, cfg: ServeBenchConfig, prompt: str
) -> RequestResult:
    result = RequestResult()
    chat = cfg.endpoint == "chat"
    chunk_times: list[float] = []
    last_token_at = 0.0
    usage_tokens = 0
    start = time.perf_counter()
    async with client.stream("POST", cfg.request_url, json=make_body(cfg, prompt)) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace").strip()
            result.error = f"HTTP {resp.status_code}: {detail[:200]}"
            return result
        async for line in resp.aiter_lines():
            now = time.perf_counter()  # before parsing: the parse is our cost, not the server's
            # Blank separators, ": keep-alive" comments and "event:" lines carry no data.
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("error"):
                result.error = f"stream error: {json.dumps(event['error'])[:200]}"
                return result
            usage = event.get("usage")
            if usage:
                usage_tokens = usage.get("completion_tokens") or 0
                result.num_prompt_tokens = usage.get("prompt_tokens")
            if _chunk_text(event, chat):
                chunk_times.append(now)
            if event.get("choices") and chunk_times:
                last_token_at = now
    end = time.perf_counter()
    if not chunk_times:
        # Tokens without text are the model's own output (e.g. special tokens, skipped in replies).
        result.error = "stream ended without content" + (f" ({usage_tokens} tokens that decode to no text)"
                                                           if usage_tokens else "")
        return result
    result.ttft_s = chunk_times[0] - start
    result.e2e_s = end - start
    result.decode_s = last_token_at - chunk_times[0]
    result.num_chunks = len(chunk_times)
    # Without usage, one content chunk is taken as one token.
    result.num_completion_tokens = usage_tokens or len(chunk_times)
    # An SSE event does not say how many tokens it holds; when usage shows more tokens
    # than events, spread each gap evenly over the average tokens per event.
    per_chunk = result.tokens_per_chunk
    repeat = max(1, round(per_chunk))
    for prev, cur in zip(chunk_times, chunk_times[1:]):
        result.itl_s.extend([(cur - prev) / per_chunk] * repeat)
    return result


async def timed_request(
    client: httpx.AsyncClient, cfg: ServeBenchConfig, prompt: str
) -> RequestResult:
    try:
        return await asyncio.wait_for(stream_request(client, cfg, prompt), cfg.timeout_s)
    except asyncio.TimeoutError:
        return RequestResult(error=f"timeout after {cfg.timeout_s:g}s")
    except Exception as exc:  # noqa: BLE001
        # One broken reply (refused connection, malformed JSON) is an error to count,
        # never a reason to abort a level that other requests are still measuring.
        return RequestResult(error=f"{type(exc).__name__}: {exc}".rstrip(": "))


def quiet_client_logs() -> None:
    """The HTTP client logs one INFO line per request; a bench sends hundreds, so only its warnings show."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def make_client(cfg: ServeBenchConfig, concurrency: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(cfg.timeout_s),
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        # A proxy from the environment would sit between us and the server and skew every
        # number; the bench talks to the given URL only.
        trust_env=False,
    )

"""Plain-data requests and step outputs passed between the API, the engine core and the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from mlxhost.kv.hashing import adapter_span, group_span
from mlxhost.multimodal.media_item import MediaItem


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # The prompt's own logprobs (a text completion's `echo` with `logprobs`): each prompt token's logprob
    # after the tokens before it, and this many alternatives. None: off. Such a prompt is computed whole,
    # not taken from the prefix cache (a cached position has no logits); its blocks are still stored.
    prompt_logprobs: int | None = None
    # A `structured.grammar.Constraint` (plain, hashable data: a serialized llguidance grammar) the
    # output must match; the runner masks this row's logits with it. None: free text.
    constraint: Any = None
    # False: this request decodes without drafts while the server speculates (its output is the same;
    # a request whose drafts would not pay, or that wants plain timing, opts out).
    speculative: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_processors(self) -> bool:
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt tokens already written into this request's KV cache.
    num_computed_tokens: int = 0
    # Prefix-cache hit at admission: these blocks hold the first num_cached_tokens prompt tokens.
    cached_block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    # Images and videos in the prompt, in order of position (empty for text).
    media: tuple[MediaItem, ...] = ()
    # Prefix-cache hashes of this request's full blocks so far (the scheduler's memo: a long prompt is
    # hashed once, not at every store plan).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # The LoRA adapter it runs under (lora/adapters.py `adapter_id`: name and digest); '' for the base model.
    adapter: str = ""
    # Admission order (vLLM's): lower is served first; the scheduler ages it while the request waits.
    priority: int = 0
    # The prefix-cache partition it reads and writes (`--cache-isolation`); '' shares with every request.
    cache_group: str = ""
    # Leading prompt tokens that are a shared system prompt's (the key file's `shared_prefixes`): the blocks
    # wholly among them hash without the cache group, so every group hits them.
    num_shared_prefix_tokens: int = 0
    # A preempted request's output tokens that its next prefill computes again (after the prompt), and how
    # often it was preempted.
    num_replayed_tokens: int = 0
    num_preemptions: int = 0
    # time.monotonic() of the first engine step that ran it (its first prefill chunk); None until then. Written by
    # the engine thread before its first output, read by the HTTP side after it (tracing: queue wait vs prefill).
    scheduled_time: float | None = None
    # Seconds its prompt's blocks stay ahead of LRU eviction in the prefix cache (a cache breakpoint, a prompt cache
    # key); renewed by every hit. 0: plain LRU.
    cache_ttl_s: float = 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def media_spans(self) -> tuple[tuple[int, int, str], ...]:
        """(start, end, content hash) of every placeholder run: extra keys of the blocks they touch."""
        return tuple((s, s + n, m.content_hash) for m in self.media for s, n in m.spans)

    @property
    def block_key_spans(self) -> tuple[tuple[int, int, str], ...]:
        """`media_spans`, and the adapter and the cache group as keys of every block: KV computed under one
        adapter (or for one group) is never another's, nor the base model's (nor the shared cache's)."""
        spans = self.media_spans
        if self.adapter:
            spans = (adapter_span(self.adapter), *spans)
        if self.cache_group:
            spans = (group_span(self.cache_group, self.num_shared_prefix_tokens), *spans)
        return spans

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_token_ids(self) -> list[int]:
        """What its prefill computes: the prompt, and after a preemption the output tokens it had."""
        if not self.num_replayed_tokens:
            return self.prompt_token_ids
        return self.prompt_token_ids + self.output_token_ids[: self.num_replayed_tokens]

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_replayed_tokens

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prefill_tokens

    @property
    def num_prompt_tokens_left(self) -> int:
        return self.num_prefill_tokens - self.num_computed_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None: a prompt's first token, which nothing comes before
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one engine step produced for one request: new text and tokens since the last output."""

    request_id: str
    new_token_ids: list[int]
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    # With `SamplingParams.prompt_logprobs`, on the request's first output: one entry per prompt token (the
    # first one's logprob None).
    prompt_logprobs: list[TokenLogprob] | None = None
    # Prompt tokens it computed and stored under a keep hint (Anthropic's cache_creation_input_tokens): its full
    # blocks beyond the cache hit. 0 without a hint.
    num_cache_creation_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: a consumer that fell behind catches up with a
    single chunk instead of paying per-chunk costs for every token it missed."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    logprobs = [lp for o in outputs for lp in (o.logprobs or ())]
    return RequestOutput(
        request_id=last.request_id,
        new_token_ids=[t for o in outputs for t in o.new_token_ids],
        text="".join(o.text for o in outputs),
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        finish_reason=last.finish_reason,
        logprobs=logprobs if any(o.logprobs is not None for o in outputs) else None,
        error=next((o.error for o in outputs if o.error), None),
        num_cached_tokens=last.num_cached_tokens,
        num_cache_creation_tokens=last.num_cache_creation_tokens,
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None),
    )

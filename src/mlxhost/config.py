"""Typed configuration, validated once at start-up and passed down.

The lowest room: it imports nothing of the package (tests/test_import_layers.py), so every room may read it.
Names that live in a registry (speculative proposers, tool-call parsers) are checked where the registry is:
`mlxhost serve` checks them before anything loads (server/serve_command.py), and an engine refuses an
unknown proposer when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxhost.mcp.config import McpConfig

# How the weights get from disk into MLX arrays (models/loader.py, which reads them; its choose_load_strategy
# has the measured rule for "auto"):
# "mlx-lm": mlx-lm's load: lazy mx.load per file, one mx.eval of all parameters; MLX reads each
#           tensor with pread on a small thread pool straight into its own buffer.
# "chunked": the same lazy load, evaluated a few hundred MB at a time in model order.
# "mmap":   the files memory-mapped, each tensor copied from the mapping into an MLX array, its
#           pages dropped from our address space as soon as it is copied.
LOAD_STRATEGIES = ("mlx-lm", "chunked", "mmap")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine core and its scheduler need to know."""

    max_num_seqs: int = 64
    # Prompt tokens processed per engine step; a longer prompt is split into chunks of this size so
    # running streams get a decode step between chunks.
    prefill_step_size: int = 512
    # Prompts prefilled together: the step's budget is shared fairly among this many waiting prompts and
    # their chunks run in one forward (families with plain KV caches). 1: one prompt after another, oldest
    # first (what families whose caches cannot be padded always get).
    max_num_prefill_rows: int = 8
    # While rows decode, a new prompt may wait up to this many engine steps for others to arrive, so
    # several prefill in one forward (TGI's max-waiting-tokens idea): a prefill forward costs much the
    # same for one prompt as for eight. It waits no longer once `max_num_prefill_rows` prompts wait,
    # and never when nothing decodes or a prompt is mid-prefill. 0: admitted at once.
    prefill_wait_steps: int = 0
    # A waiting request's priority improves by one class per this many engine steps, so no class starves
    # under a steady stream of better ones (engine/priority.py). 0: no aging.
    priority_aging_steps: int = 256
    # While rows decode, a step's prefill chunk is sized from measured step costs so their next token comes
    # within this many seconds (engine/step_cost.py); a prompt alone still prefills whole chunks. 0: whole
    # chunks always, the engine's default: chunks sized by wall time make a run's chunking (and so its
    # float rounding) depend on the machine's load. `mlxhost serve` turns it on (SERVE_MAX_DECODE_GAP_S).
    max_decode_gap_s: float = 0.0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    default_max_tokens: int = 2048
    # Requests allowed to wait for a slot; beyond this the server answers 429 instead of queueing forever.
    max_num_waiting: int = 1024
    # KV tokens the running requests may hold at once (admission control); None: what the memory budget
    # measured at start-up leaves for KV.
    kv_budget_tokens: int | None = None
    # Run the batch through its sizes at start-up, so kernels a backend compiles per shape at first
    # use are ready before traffic: "auto" does so on MLX's CUDA backend, where a cold load otherwise
    # stalls its first requests for seconds (docs/BENCHMARKS.md). Metal and CPU gain nothing.
    warmup: str = "auto"
    # Pad the decode batch to a few fixed sizes (fewer shapes to compile, some wasted rows); "auto":
    # on where the backend compiles per shape (CUDA), so warm-up covers ~10 sizes instead of every one.
    decode_buckets: str = "auto"
    # Prefix cache: KV of full blocks of `block_size` tokens, reused by later prompts with the same start.
    enable_prefix_cache: bool = True
    block_size: int = 128
    # None: the memory budget's prefix share (a quarter of what weights and activations leave).
    cache_memory_bytes: int | None = None
    # "desktop" follows free memory (re-read while running, caches give way first); "dedicated"
    # takes `memory_utilization` of the device's capacity once.
    memory_mode: str = "desktop"
    memory_utilization: float = 0.9
    # Desktop mode: seconds between re-reads of free memory while steps run (0: start-up only).
    memory_refresh_s: float = 2.0
    # KV positions reserved per decode batch up front, so memory stays flat while sequences grow
    # (0: off, the cache grows in mlx-lm's 256-token steps).
    kv_prealloc_tokens: int = 0
    # Quantized KV (`--kv-bits`): 8 or 4 bits in groups of `kv_group_size` values (mlx-lm's
    # QuantizedKVCache format) for the decode batch, prefills and the prefix cache; None: float KV.
    # Where start-up measurements (a prefill chunk's activation peak) are kept per model shape, backend and MLX
    # version, so a later start skips their forwards (memory/profile.py); None: measured at every start.
    measurements_dir: str | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    # How attention reads quantized KV: "quantized" (MLX's quantized matmuls), "dequantized" (a float copy
    # of each layer's KV, for backends whose kernels reject the shapes), "auto" (the first that runs).
    kv_quant_mode: str = "auto"
    # Set per model by a multi-model server (memory/budget.py BudgetConfig.reserved_bytes / share).
    memory_reserved_bytes: int = 0
    memory_share: float = 1.0
    # Vision-language models: encoder outputs kept by image hash (capped by the memory budget's share).
    vision_cache_bytes: int = 512 * (1 << 20)
    # SSD tier: blocks written behind to one file each, found again after a restart.
    ssd_cache_dir: str | None = None
    ssd_cache_max_bytes: int = 50 * 10**9
    # Speculative decoding inside the decode batch: "ngram" (prompt lookup in the request's own tokens),
    # "draft" (`draft_model`, a small model with the same tokenizer), "eagle3" / "mtp" (`draft_model`: a
    # head's folder, fed the target's hidden states), "auto" (the proposer `draft_model` is, else ngram; each
    # step speculates only where measured acceptance covers the measured cost) or "off". A draft model alone
    # turns it on.
    # `num_draft_tokens` is the most a row drafts per step (each row adapts below it).
    speculative: str = "off"
    draft_model: str | None = None
    num_draft_tokens: int = 4
    # MLX-CUDA only (platform/cudnn_attention.py): cuDNN attention builds a graph per new shape;
    # "auto" turns it off (served traffic rarely repeats a shape), "on" keeps MLX's default.
    cudnn_attention: str = "auto"
    # Speculate only while at most this many requests decode: verifying drafts is nearly free while
    # decode is memory-bound (small batches) and costs compute beyond (docs/BENCHMARKS.md).
    spec_max_batch: int = 4

    def __post_init__(self) -> None:
        if self.draft_model and self.speculative == "off":
            object.__setattr__(self, "speculative", "draft")
        if self.speculative in ("eagle3", "mtp") and not self.draft_model:
            raise ValueError(f"speculative decoding with {self.speculative} needs draft_model (the head's folder)")
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("speculative decoding with a draft model needs draft_model")
        if not 1 <= self.num_draft_tokens <= 64:
            raise ValueError("num_draft_tokens must be in 1..64")
        if self.spec_max_batch < 1:
            raise ValueError("spec_max_batch must be >= 1")
        if self.warmup not in ("auto", "background", "on", "off"):
            raise ValueError("warmup must be auto, background, on or off")
        if self.cudnn_attention not in ("auto", "on", "off"):
            raise ValueError("cudnn_attention must be auto, on or off")
        if self.decode_buckets not in ("auto", "on", "off"):
            raise ValueError("decode_buckets must be auto, on or off")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.prefill_step_size < 1:
            raise ValueError("prefill_step_size must be >= 1")
        if self.prefill_wait_steps < 0:
            raise ValueError("prefill_wait_steps must be >= 0")
        if self.max_decode_gap_s < 0:
            raise ValueError("max_decode_gap_s must be >= 0")
        if self.priority_aging_steps < 0:
            raise ValueError("priority_aging_steps must be >= 0")
        if self.max_num_prefill_rows < 1:
            raise ValueError("max_num_prefill_rows must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.cache_memory_bytes is not None and self.cache_memory_bytes < 0:
            raise ValueError("cache_memory_bytes must be >= 0")
        if self.memory_mode not in ("desktop", "dedicated"):
            raise ValueError("memory_mode must be desktop or dedicated")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError("memory_utilization must be in (0, 1]")
        if self.memory_refresh_s < 0 or self.kv_prealloc_tokens < 0:
            raise ValueError("memory_refresh_s and kv_prealloc_tokens must be >= 0")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be >= 1")
        if self.kv_bits is not None and self.kv_bits not in (4, 8):
            raise ValueError(f"kv_bits must be 4 or 8 (or unset for float KV), got {self.kv_bits}")
        if self.kv_group_size not in (32, 64, 128):
            raise ValueError(f"kv_group_size must be 32, 64 or 128, got {self.kv_group_size}")
        if self.kv_quant_mode not in ("auto", "quantized", "dequantized"):
            raise ValueError(f"kv_quant_mode must be auto, quantized or dequantized, got {self.kv_quant_mode!r}")


@dataclass(frozen=True)
class MediaConfig:
    """Limits for images and videos named in requests (URLs, data: URIs, local files)."""

    # Local paths and file:// URLs are refused unless they resolve (symlinks followed) inside one of these.
    allowed_local_media_paths: tuple[str, ...] = ()
    # Off: URLs whose host resolves to a private/loopback/link-local/reserved address are refused (SSRF).
    allow_private_media_urls: bool = False
    fetch_timeout_s: float = 10.0  # per connect / per read
    fetch_deadline_s: float = 30.0  # whole download, so a slow-drip server cannot hold a worker
    max_redirects: int = 5
    max_media_bytes: int = 50 * 10**6  # encoded bytes, checked while streaming
    # Checked from the header before decoding (decompression bombs). 50 MP admits 48 MP phone photos;
    # a decoded RGB image of that size is ~150 MB. Pillow's own guard still refuses > ~179 MP.
    max_image_pixels: int = 50_000_000
    video_fps: float = 2.0
    video_max_frames: int = 32
    video_max_frames_cap: int = 128  # a request asking for more frames is refused
    video_decode_deadline_s: float = 30.0  # decoding one video's sampled frames (a worker thread's time)
    max_media_per_request: int = 32  # images + videos in one request, checked before any is fetched

    def __post_init__(self) -> None:
        if self.fetch_timeout_s <= 0 or self.fetch_deadline_s <= 0 or self.video_decode_deadline_s <= 0:
            raise ValueError("fetch_timeout_s, fetch_deadline_s and video_decode_deadline_s must be > 0")
        if self.max_media_per_request < 1:
            raise ValueError("max_media_per_request must be >= 1")
        if self.max_redirects < 0:
            raise ValueError("max_redirects must be >= 0")
        if self.max_media_bytes < 1 or self.max_image_pixels < 1:
            raise ValueError("max_media_bytes and max_image_pixels must be >= 1")
        if self.video_fps <= 0:
            raise ValueError("video_fps must be > 0")
        if not 1 <= self.video_max_frames <= self.video_max_frames_cap:
            raise ValueError("video_max_frames must be in 1..video_max_frames_cap")


@dataclass(frozen=True)
class SecurityConfig:
    """What a server shared with others checks before a request reaches a model (frontends/common/security.py)."""

    # Any one of these, as `Authorization: Bearer KEY` or `x-api-key: KEY`; empty: no key needed.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # Keys with policies (frontends/common/keys.py): models, limits, priority, cache group; None: none.
    api_key_file: str | None = None
    # Prefix-cache blocks shared by every request ("none"), by a key's requests only ("key"), or by the keys
    # of one `cache_group` ("group"; a key without one is its own group).
    cache_isolation: str = "none"
    metrics_public: bool = False  # /metrics without a key (/health is always open)
    allowed_origins: tuple[str, ...] = ()  # CORS; empty: no CORS headers (browsers refuse cross-origin)
    # Sized for a few large base64 images; checked from Content-Length first, then while streaming.
    max_request_body_bytes: int = 64 << 20
    max_tokens_cap: int | None = None  # a request asking for more is a 400; None: only the context caps it
    # Host header names served (DNS-rebinding guard); "*" serves any. None: the loopback names and the
    # bound address when bound to loopback, any Host otherwise (clients of a shared box use many names).
    allowed_hosts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ValueError("API keys must be non-empty, without surrounding whitespace")
        if self.max_request_body_bytes < 1:
            raise ValueError("max_request_body_bytes must be >= 1")
        if self.cache_isolation not in ("none", "key", "group"):
            raise ValueError("cache_isolation must be none, key or group")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError("max_tokens_cap must be >= 1")
        if self.allowed_hosts is not None and not all(h and h == h.strip() for h in self.allowed_hosts):
            raise ValueError("allowed hosts must be non-empty names without surrounding whitespace")


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter served on a base model as a model name of its own (`--lora`, `loras:` in a models file)."""

    name: str  # what requests put in `model` (or BASE:NAME)
    path: str  # the adapter folder (mlx-lm's or PEFT's format)
    base: str | None = None  # the base model's name; None: the server's only (or first) model

    def __post_init__(self) -> None:
        if not self.name or not self.path:
            raise ValueError("a LoRA adapter needs a name and a path (--lora NAME=PATH)")
        if ":" in self.name:
            raise ValueError(f"LoRA adapter name {self.name!r} must not contain ':' (BASE:NAME addresses it)")


@dataclass(frozen=True)
class ModelSpec:
    """One model of a multi-model server (`--models-config`, repeated `--model`)."""

    name: str  # what requests put in `model`
    source: str  # local folder or hub id
    pinned: bool = False  # loaded at start-up and never unloaded
    ttl_s: float | None = None  # unloaded after this long idle; None: only when another model needs room
    aliases: tuple[str, ...] = ()  # other names requests may use
    engine: EngineConfig | None = None  # this model's engine settings; None: the server's
    loras: tuple[LoraSpec, ...] = ()  # LoRA adapters served on this model (lora/)

    def __post_init__(self) -> None:
        if not self.name or not self.source:
            raise ValueError("a model needs a name and a path")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"ttl of {self.name!r} must be > 0 seconds")


# `mlxhost serve`'s --max-decode-gap: a stream waits at most about a second for its next token behind a long
# prompt's prefill (docs/serving.md).
SERVE_MAX_DECODE_GAP_S = 1.0


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None  # local folder or hub id; None serves the embedded demo model
    served_model_name: str | None = None
    # Several models in one server, loaded on first use (pinned ones at start-up); empty: `model` alone.
    models: tuple[ModelSpec, ...] = ()
    # Room for loaded models; the least recently used idle unpinned one is unloaded to make more.
    # None for both: a model loads when its weights fit in what the memory budget leaves free.
    max_loaded_models: int | None = None
    max_loaded_bytes: int | None = None  # weight bytes (file sizes on disk) of all loaded models
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    engine: EngineConfig = field(default_factory=EngineConfig)
    media: MediaConfig = field(default_factory=MediaConfig)  # images and videos in requests (VLMs)
    # How weights are read: "auto" (models/loader.py's measured rule by size) or a strategy name.
    load_strategy: str = "auto"
    # Text model weights on MLX's CPU backend: "auto" float32 when it fits, "float32" always, "keep" as loaded
    # (platform/cpu_weights.py); other backends keep them as loaded.
    cpu_weights: str = "auto"
    # How replies carry tool calls (a structured.tool_formats name); None: read off the chat template.
    tool_call_parser: str | None = None
    # Fill-in-the-middle (`suffix`): "auto" for models with its marker tokens named as code models, "on" for any
    # model with the markers, "off" for none (frontends/common/fim.py).
    fim: str = "auto"
    security: SecurityConfig = field(default_factory=SecurityConfig)  # keys, CORS, body and max_tokens limits
    # On SIGTERM/SIGINT running streams may finish for this long; then they end with an error event.
    shutdown_timeout_s: float = 30.0
    web_ui: bool = True  # the chat page and dashboard at / (frontends/admin/web.py)
    loras: tuple[LoraSpec, ...] = ()  # --lora adapters, put on their base model's spec by server.model_specs
    batch_dir: str | None = None  # the Batch API's folder (frontends/batch/); None: no Batch API
    otlp_traces_endpoint: str | None = None  # OpenTelemetry traces sent here (tracing.py); None: off
    mcp: McpConfig | None = None  # MCP servers whose tools requests may use (mcp/, docs/mcp.md); None: no MCP

    def __post_init__(self) -> None:
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.cpu_weights not in ("auto", "float32", "keep"):
            raise ValueError(f"cpu_weights must be auto, float32 or keep, got {self.cpu_weights!r}")
        if self.fim not in ("auto", "on", "off"):
            raise ValueError(f"fim must be auto, on or off, got {self.fim!r}")
        if self.load_strategy != "auto" and self.load_strategy not in LOAD_STRATEGIES:
            raise ValueError(f"load_strategy must be auto or one of {LOAD_STRATEGIES}, got {self.load_strategy!r}")
        if self.models and self.model is not None:
            raise ValueError("name one model (positional) or several (--model / --models-config), not both")
        names = [n for spec in self.models for n in (spec.name, *spec.aliases)]
        if len(names) != len(set(names)):
            raise ValueError(f"model names and aliases must be unique, got {names}")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError("max_loaded_models must be >= 1")
        if self.max_loaded_bytes is not None and self.max_loaded_bytes < 1:
            raise ValueError("max_loaded_bytes must be >= 1")


def parse_memory(text: str, total_bytes: int) -> int:
    """"2GB", "512MiB", "1e9" or "20%" (of total_bytes) -> bytes."""
    t = text.strip().upper().replace(" ", "")
    if t.endswith("%"):
        return int(float(t[:-1]) / 100 * total_bytes)
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "B": 1}
    for suffix, scale in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * scale)
    return int(float(t))

"""Which MLX backend computes here, for the few policies that differ on MLX-CUDA."""


def is_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU here."""
    import mlx.core as mx

    return hasattr(mx, "cuda") and mx.cuda.is_available() and mx.default_device() == mx.gpu


def default_prefill_step_size() -> int:
    """Prompt tokens per engine step unless `--prefill-step-size` says otherwise: 2048 on MLX-CUDA, 512
    elsewhere. On an H100 a step that prefilled 8 prompts together cost nearly the same for 64 tokens
    each (34.6 ms) as for 180 (40.1 ms, random Qwen3-0.6B 4-bit; docs/BENCHMARKS.md, runs 11-12), so 512
    tokens shared by 8 prompts paid that cost three times per prompt; at 64 streams steps that prefilled
    took 48% of the engine's time. On Metal and the CPU a step's cost grows with its tokens, and 512 keeps
    the decode streams' step time short while a prompt is prefilled."""
    return 2048 if is_cuda() else 512

"""Which MLX backend computes here, for the few policies that differ on MLX-CUDA."""


def is_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU here."""
    import mlx.core as mx  # lazy: mlx only when used

    return hasattr(mx, "cuda") and mx.cuda.is_available() and mx.default_device() == mx.gpu


def default_prefill_step_size() -> int:
    """Prompt tokens per engine step unless `--prefill-step-size` says otherwise: 2048 on MLX-CUDA, 512
    elsewhere. On MLX-CUDA a step that prefills several prompts costs about the same for a few tokens each
    as for a few hundred, so small steps pay that cost several times per prompt (docs/BENCHMARKS.md,
    "Prefill step size on MLX-CUDA"). On Metal and the CPU a step's cost grows with its tokens, and 512
    keeps the decode streams' step time short while a prompt is prefilled."""
    return 2048 if is_cuda() else 512

"""Which MLX backend computes here, for the few policies that differ on MLX-CUDA."""


def is_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU here."""
    import mlx.core as mx

    return hasattr(mx, "cuda") and mx.cuda.is_available() and mx.default_device() == mx.gpu

"""The runner: all MLX work of a step (prefill, the decode batch, sampling) and the one table of per-request state."""

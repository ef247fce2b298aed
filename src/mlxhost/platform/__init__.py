"""Backend-specific patches: MLX-CUDA defaults, the cuDNN attention switch, quantized layers that fold decode rows."""

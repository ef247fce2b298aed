"""mlxhost: an MLX-native OpenAI-compatible inference server."""

__version__ = "0.1.0"

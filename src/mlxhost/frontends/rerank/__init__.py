"""Rerank and score as a front door: protocol (Cohere / Jina / vLLM shapes), methods (cross-encoder,
yes/no decoder, embedding cosine, each through the served model's engine), routes."""

from mlxhost.frontends.rerank.routes import add_rerank_routes

__all__ = ["add_rerank_routes"]

"""Ollama's API as a front door: protocol (request shapes), translate (into the one internal request),
render (replies and NDJSON streams), listing (tags / show / ps), pulling, routes."""

from mlxhost.frontends.ollama.routes import add_ollama_routes

__all__ = ["add_ollama_routes"]

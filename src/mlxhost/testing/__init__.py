"""Fixture builders for tests and benchmarks: real models from the package registries."""

"""Speculative decoding: proposers (registry.py), verification inside the decode batch, and when it pays."""

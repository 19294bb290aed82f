"""Tiny random-weight Transformers models and the demo that kernelizes them."""

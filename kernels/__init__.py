"""Triton kernels for kivi_cache, installed as ``kivi_cache.kernels``."""

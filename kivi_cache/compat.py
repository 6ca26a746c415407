"""Small helpers across transformers versions."""

from __future__ import annotations

import inspect


def cache_arg_name(model) -> str:
    """The keyword that passes a cache to ``model(...)``/``generate``: ``cache`` (5.24+) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` with the name this transformers version expects."""
    return {cache_arg_name(model): cache}

"""Small helpers across transformers versions."""

from __future__ import annotations

import inspect

from packaging.version import Version

#: the first transformers version whose models and ``generate`` take the cache as ``cache=``
CACHE_KEYWORD_SINCE = Version("5.24.0")


def cache_arg_name(model) -> str:
    """The keyword that passes a cache to ``model(...)`` and ``model.generate(...)``: ``cache`` (transformers >=
    5.24) or ``past_key_values`` (earlier; 5.24 and later still take it, with a deprecation warning). Read from the
    model's ``forward`` (a model of remote code may keep ``past_key_values``); a ``forward`` that names neither
    (``**kwargs`` only) gets the installed version's name."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    return "cache" if transformers_version().release >= CACHE_KEYWORD_SINCE.release else "past_key_values"


def transformers_version() -> Version:
    """The installed transformers' version."""
    import transformers

    return Version(transformers.__version__)


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` with the name this transformers version and model take (:func:`cache_arg_name`)::

        out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=64)
    """
    return {cache_arg_name(model): cache}

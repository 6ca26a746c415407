"""kivi_cache: a 2/4-bit quantized, paged KV cache for HuggingFace transformers.

    from kivi_cache import Int4PagedCache
    out = model.generate(ids, cache=Int4PagedCache(), max_new_tokens=256)

transformers >= 5.24 takes the cache as ``cache=``, earlier versions as ``past_key_values=``;
``**cache_kwargs(model, cache)`` passes it under the name the installed version takes.
"""

from . import hook
from .cache import Int2PagedCache, Int4PagedCache, Int8PagedCache, QuantizedPagedCache
from .cb import ContinuousBatchingUnsupported, disable_continuous_batching, enable_continuous_batching
from .compat import cache_arg_name, cache_kwargs
from .config import QuantConfig
from .layer import CacheUnusableError
from .memory import MemoryReport, break_even_tokens
from .ops import get_backend, kernel_error, set_backend
from .prefill import prefill
from .static import StaticQuantizedPagedCache

hook.install()

__all__ = [
    "QuantizedPagedCache",
    "Int4PagedCache",
    "Int2PagedCache",
    "Int8PagedCache",
    "StaticQuantizedPagedCache",
    "QuantConfig",
    "CacheUnusableError",
    "MemoryReport",
    "break_even_tokens",
    "cache_arg_name",
    "cache_kwargs",
    "set_backend",
    "get_backend",
    "kernel_error",
    "prefill",
    "enable_continuous_batching",
    "disable_continuous_batching",
    "ContinuousBatchingUnsupported",
]
__version__ = "0.1.0"

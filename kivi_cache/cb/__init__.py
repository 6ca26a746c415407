"""Continuous batching with quantized pages, in transformers' own engine.

    import kivi_cache
    kivi_cache.enable_continuous_batching(model, preset="int4")
    outputs = model.generate_batch(prompts, generation_config=gen)   # as transformers documents it
    kivi_cache.disable_continuous_batching(model)                    # transformers' fp16 cache again

After :func:`enable_continuous_batching`, ``model.generate_batch``, ``model.init_continuous_batching`` and
``model.continuous_batching_context_manager`` run transformers' engine (scheduler, requests arriving mid-run,
cancellation, streaming, sampling, stop tokens, forks, eviction under memory pressure) over
:class:`~kivi_cache.cb.cache.KiviPagedAttentionCache`: quantized pages and a full-precision window per request.

Supported: transformers >= 5.24 (whose models hand the engine's arguments to the cache's ``update``), decoder
models whose layers are all full attention, also under tensor parallelism (``tp_plan="auto"``: each rank holds its
KV heads' pages and windows). Refused with an error naming the feature: sliding-window or hybrid
models, latent attention (MLA), CPU offloading (``cpu_offload_space > 0``), asynchronous
batching, CUDA graphs and compiled steps of the engine. Prefix sharing is off (a block's pages do not hold the
token range the engine hashes).
"""

from __future__ import annotations

import copy
import inspect
import types
from dataclasses import dataclass, replace
from importlib.util import find_spec

from ..compat import transformers_version
from ..config import QuantConfig, preset_config

SUPPORTED_SINCE = "5.24.0"


class ContinuousBatchingUnsupported(RuntimeError):
    """The installed transformers or this model cannot run continuous batching on quantized pages."""


def unsupported_reason() -> str | None:
    """Why the installed transformers' engine cannot take the quantized cache, or None where it can."""
    version = transformers_version()
    where = "transformers.generation.continuous_batching"
    if find_spec(f"{where}.cache_allocators") is None:
        return (f"transformers {version} has no continuous-batching cache allocators; kivi_cache's continuous "
                f"batching needs transformers >= {SUPPORTED_SINCE}")
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    if "kwargs" not in inspect.signature(PagedAttentionCache.update).parameters:
        return (f"transformers {version}: the attention function, not the model, updates the continuous-batching "
                f"cache; kivi_cache's continuous batching needs transformers >= {SUPPORTED_SINCE}")
    return None


@dataclass(frozen=True)
class _Settings:
    quant: QuantConfig
    window_slots: int | None
    attn_implementation: str


def _check_model(model, quant: QuantConfig) -> None:
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other or getattr(config, "sliding_window", None) or getattr(config, "use_sliding_window", False):
        raise ContinuousBatchingUnsupported(
            f"continuous batching on quantized pages serves full-attention layers only; this model has "
            f"{other or 'a sliding window'} (use transformers' own engine, or kivi_cache's caches with generate)")
    if getattr(config, "kv_lora_rank", None) is not None:
        raise ContinuousBatchingUnsupported("continuous batching on quantized pages does not serve latent attention "
                                            "(MLA, kv_lora_rank)")
    if getattr(config, "attn_logit_softcapping", None):
        raise ContinuousBatchingUnsupported("continuous batching on quantized pages does not serve attention "
                                            "soft-capping (attn_logit_softcapping)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    quant.check_head_dim(head_dim)


def enable_continuous_batching(model, preset: str = "int4", *, config: QuantConfig | None = None,
                               window_slots: int | None = None) -> None:
    """Serve ``model``'s continuous batching (``generate_batch``, ``init_continuous_batching``, the context manager)
    from quantized pages.

    preset: ``"int8"``, ``"int4"`` or ``"int2"``, the settings of the cache presets (``kivi_cache.config.PRESETS``);
        ``config``: a :class:`~kivi_cache.QuantConfig` instead. Its ``page_size`` is replaced by the engine's
        (``ContinuousBatchingConfig.page_size``, a multiple of ``group_size``); ``num_pages`` is unused (the engine
        sizes the cache from free memory or its ``num_blocks``).
    window_slots: the most requests in flight at once (each holds a full-precision window of ``sink_length +
        residual_length + group_size`` tokens per layer); default ``min(max_requests_per_batch, 256)``.

    The model's attention implementation becomes ``sdpa`` (kivi_cache's hook serves it) until
    :func:`disable_continuous_batching`. Raises :class:`ContinuousBatchingUnsupported` for a transformers version or
    model it cannot serve, ``ValueError`` for bad settings."""
    reason = unsupported_reason()
    if reason is not None:
        raise ContinuousBatchingUnsupported(reason)
    if config is None:
        quant = preset_config(preset)
    elif isinstance(config, QuantConfig):
        quant = config
    else:
        raise ValueError(f"config must be a kivi_cache.QuantConfig or None, got {type(config).__name__}")
    if window_slots is not None and (isinstance(window_slots, bool) or not isinstance(window_slots, int)
                                     or window_slots < 1):
        raise ValueError(f"window_slots must be an integer >= 1 or None, got {window_slots!r}")
    _check_model(model, quant)
    previous = getattr(model, "_kivi_cb", None)
    original = previous.attn_implementation if previous else model.config._attn_implementation
    from .. import hook

    hook.install()
    if hasattr(model, "destroy_cached_continuous_batching_manager"):
        model.destroy_cached_continuous_batching_manager()
    if model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")
    model._kivi_cb = _Settings(quant, window_slots, original)
    model.init_continuous_batching = types.MethodType(_init_continuous_batching, model)


def disable_continuous_batching(model) -> None:
    """Give ``model``'s continuous batching back to transformers' fp16 cache and restore its attention
    implementation (a no-op for a model :func:`enable_continuous_batching` did not switch)."""
    settings = model.__dict__.get("_kivi_cb")
    if settings is None:
        return
    if hasattr(model, "destroy_cached_continuous_batching_manager"):
        model.destroy_cached_continuous_batching_manager()
    del model.__dict__["init_continuous_batching"]
    del model.__dict__["_kivi_cb"]
    if model.config._attn_implementation != settings.attn_implementation:
        model.set_attn_implementation(settings.attn_implementation)


def _engine_config(cb_config, quant: QuantConfig):
    """A copy of the user's ``ContinuousBatchingConfig`` with what the quantized cache needs, after refusing what
    it does not serve."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cb = ContinuousBatchingConfig() if cb_config is None else copy.deepcopy(cb_config)
    refused = {
        "use_async_batching": cb.use_async_batching,
        "use_cuda_graph": any(cb.use_cuda_graph) if isinstance(cb.use_cuda_graph, tuple) else cb.use_cuda_graph,
        "varlen_compile_config": cb.varlen_compile_config is not None,
        "decode_compile_config": cb.decode_compile_config is not None,
        "default_compile_level": cb.default_compile_level > 0,
        "cpu_offload_space": cb.cpu_offload_space is None or cb.cpu_offload_space > 0,
        "max_blocks_per_request": bool(cb.max_blocks_per_request),
    }
    named = [name for name, on in refused.items() if on]
    if named:
        raise ContinuousBatchingUnsupported(
            f"continuous batching on quantized pages does not serve {', '.join(named)} (got "
            f"{', '.join(f'{n}={getattr(cb, n)!r}' for n in named)}); leave them at their defaults")
    if cb.page_size % quant.group_size:
        raise ValueError(f"ContinuousBatchingConfig.page_size must be a multiple of the quantization group_size "
                         f"({quant.group_size}), got page_size={cb.page_size}")
    cb.auto_switch_to_flash = False
    cb.allow_block_sharing = False
    cb.use_async_batching = False
    cb.use_cuda_graph = False
    return cb


def _init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
    """``model.init_continuous_batching`` of a switched model: transformers' entry point, whose manager builds the
    quantized cache (:class:`~kivi_cache.cb.engine.KiviContinuousBatchingManager`)."""
    from .engine import KiviContinuousBatchingManager

    cached = getattr(self, "_cached_continuous_batching_manager", None)
    if cached is not None:
        return cached
    settings = self._kivi_cb
    gen = generation_config if generation_config is not None else self.generation_config
    if gen is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    if gen.eos_token_id is None:
        gen.eos_token_id = -1
    cb = _engine_config(continuous_batching_config, settings.quant)
    quant = replace(settings.quant, page_size=cb.page_size, num_pages=0)
    return KiviContinuousBatchingManager(self, gen, cb, workload_hints, quant=quant,
                                         window_slots=settings.window_slots)

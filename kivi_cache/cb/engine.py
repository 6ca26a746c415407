"""transformers' continuous-batching manager, building the quantized cache instead of its fp16 one.

transformers offers no parameter for the cache class: the manager's ``_create_batch_processor`` builds a
``PagedAttentionCache`` by name. :class:`KiviContinuousBatchingManager` overrides that one method, for the managers
of a model that :func:`kivi_cache.enable_continuous_batching` switched; the scheduler, request handling, streaming,
sampling and memory handling stay the engine's own.

The batch processor gets a view of the model config whose attention implementation is not ``sdpa``: with ``sdpa``
the engine would build an additive mask of ``[T, cache + T]`` every step, which the quantized attention does not read.
"""

from __future__ import annotations

import copy

from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.scheduler import SCHEDULER_MAPPING, FIFOScheduler

from .cache import KiviPagedAttentionCache

#: the attention implementation the engine's batch processor sees (anything but sdpa/eager: no masks)
MASKLESS = "kivi_cb"


def maskless_config(config):
    """A shallow copy of ``config`` whose ``_attn_implementation`` is :data:`MASKLESS` (the model keeps its own)."""
    view = copy.copy(config)
    object.__setattr__(view, "_attn_implementation_internal", MASKLESS)
    return view


class KiviContinuousBatchingManager(continuous_api.ContinuousBatchingManager):
    """The engine's manager, serving its requests from :class:`~kivi_cache.cb.cache.KiviPagedAttentionCache`."""

    def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None, *, quant,
                 window_slots=None):
        self.quant, self.window_slots = quant, window_slots
        super().__init__(model, generation_config, continuous_batching_config, workload_hints)
        cb = self.continuous_batching_config
        cb.max_blocks_per_request = 0  # no block-table (flash) decode path: every step is a ragged batch
        cb.use_cuda_graph = (False, False)
        cb.use_async_batching = False

    def _create_batch_processor(self) -> continuous_api.ContinuousBatchProcessor:
        processor = getattr(self, "batch_processor", None)
        if isinstance(processor, continuous_api.ContinuousBatchProcessor):
            processor.reset()
            return processor
        view = maskless_config(self.model.config.get_text_config())
        supports_keep = getattr(self.model, "_supports_logits_to_keep", None)
        cache = KiviPagedAttentionCache(
            view, self.continuous_batching_config, self.model.device, self.distributed_helper, self.model.dtype,
            callable(supports_keep) and supports_keep(), quant=self.quant, window_slots=self.window_slots)
        self._use_prefix_sharing = False
        continuous_api.update_cb_config_after_cache_creation(
            cb_config=self.continuous_batching_config, num_blocks=cache.num_blocks,
            max_batch_tokens=cache.max_batch_tokens)
        cfg = self.continuous_batching_config
        scheduler = SCHEDULER_MAPPING.get(cfg.scheduler_type, FIFOScheduler)(
            cache=cache, safety_margin=cfg.safety_margin, max_requests_per_batch=cfg.max_requests_per_batch)
        return continuous_api.ContinuousBatchProcessor(
            cache=cache,
            config=view,
            generation_config=self.generation_config,
            continuous_batching_config=cfg,
            logit_processor=self.logit_processor,
            input_queue=self.input_queue if self.is_tp_driver else None,
            cancel_queue=self.cancel_queue if self.is_tp_driver else None,
            output_router=self.output_router,
            background_thread_status=self.background_thread_status,
            model_device=self.model.device,
            model_dtype=self.model.dtype,
            scheduler=scheduler,
            distributed_helper=self.distributed_helper,
        )

"""Learned attention sinks (GPT-OSS's ``sinks``) carried as one more key, for attention paths that take no sink
logit of their own: the Triton prefix path here and ``kivi_cache.hook.sdpa_with_sinks`` (torch's fused sdpa).

Torch only, no Triton, nothing from ``kivi_cache`` (installed as ``kivi_cache.kernels.sinks``; the torch side
imports it from here).
"""

from __future__ import annotations

import torch

SINK_CHANNELS = 8  # extra channels that carry a learned sink as one more key (2 used; 8 keep rows 16-byte aligned)


def sink_channels(sink_logits, sm_scale: float, dtype) -> torch.Tensor:
    """The query side of a learned sink carried as one more key on ``SINK_CHANNELS`` extra channels: ``[Hq,
    SINK_CHANNELS]`` of ``dtype``, each head's first two channels ``hi + lo = sink / sm_scale`` (``hi`` rounded to
    ``dtype``, ``lo`` its remainder), the rest zeros. Against a key holding ``1, 1`` there (and zeros on the other
    channels; every other key zeros there), the sink's logit is the sink to fp32 accuracy and no other logit
    changes. Used by the fused-sdpa paths (:func:`kivi_cache.hook.sdpa_with_sinks`, the Triton prefix path)."""
    target = sink_logits.detach().float() / float(sm_scale)
    hi = target.to(dtype)
    out = torch.zeros(target.shape[0], SINK_CHANNELS, dtype=dtype, device=sink_logits.device)
    out[:, 0] = hi
    out[:, 1] = (target - hi.float()).to(dtype)
    return out

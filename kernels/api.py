"""The kernels' ops in one namespace: ``from kivi_cache.kernels import api``.

Each op is the twin of the function of the same name in :mod:`kivi_cache.reference` (same signature and semantics;
a few extra keyword-only arguments, among them ``tuning``: the launch settings, :mod:`.tuning`).
:class:`DecodeRunner` is ``paged_decode_attention`` planned once for many calls over the same pages (its runs equal
the op's calls). ``kivi_cache.ops`` chooses between these and the torch path; call them directly to run the kernels
whatever the device (on the CPU only under Triton's interpreter). Importing this module imports Triton; the folder's
torch-only modules (:mod:`.checks`, :mod:`.sinks`) do not.
"""

from __future__ import annotations

import torch

from ._util import interpreting
from .decode import DecodeRunner, paged_decode_attention
from .dequant import dequantize_pages
from .prefix import paged_prefix_attention
from .quantize import append_and_flush, quantize_and_write
from .tuning import DecodeTuning, QuantTuning, Tuning

__all__ = ["DecodeRunner", "DecodeTuning", "QuantTuning", "Tuning", "append_and_flush", "available",
           "dequantize_pages", "interpreting", "paged_decode_attention", "paged_prefix_attention",
           "quantize_and_write"]


def available() -> bool:
    """True when the kernels can run here: a CUDA device, or Triton's interpreter (:func:`interpreting`)."""
    return interpreting() or torch.cuda.is_available()

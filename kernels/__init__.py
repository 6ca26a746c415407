"""Triton kernels for kivi_cache, installed as ``kivi_cache.kernels``.

Each public function is the twin of the function of the same name in
:mod:`kivi_cache.reference` (same signature and semantics; a few extra
keyword-only tuning arguments). :class:`DecodeRunner` is ``paged_decode_attention`` planned once
for many calls over the same pages (its runs equal the op's calls; ``kivi_cache.ops.DecodeRunner``
picks it or the reference). The cache decides when to call them; use :func:`available` to know
whether Triton can run here.
"""

from __future__ import annotations

import os


def available() -> bool:
    """True when Triton kernels can run: a CUDA device, or the Triton interpreter (TRITON_INTERPRET=1)."""
    try:
        import torch
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - triton missing
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return torch.cuda.is_available()


from .attention import DecodeRunner, paged_decode_attention, paged_prefix_attention  # noqa: E402
from .dequant import dequantize_pages  # noqa: E402
from .quantize import append_and_flush, quantize_and_write  # noqa: E402

__all__ = [
    "DecodeRunner",
    "append_and_flush",
    "available",
    "dequantize_pages",
    "paged_decode_attention",
    "paged_prefix_attention",
    "quantize_and_write",
]

"""Triton kernels for kivi_cache, installed as ``kivi_cache.kernels``.

Each public function is the twin of the function of the same name in :mod:`kivi_cache.reference` (same signature
and semantics; a few extra keyword-only arguments, among them ``tuning``: the launch settings, :mod:`.tuning`).
:class:`DecodeRunner` is ``paged_decode_attention`` planned once for many calls over the same pages (its runs equal
the op's calls; ``kivi_cache.ops.DecodeRunner`` picks it or the reference). The cache decides when to call them; use
:func:`available` to know whether Triton can run here.
"""

from __future__ import annotations

import os
import sys

if __name__ == "kernels":  # pragma: no cover - exercised in subprocesses by tests/test_layout.py
    # This folder was found as a top-level ``kernels`` module: the repository root is on sys.path (``python -m``,
    # pytest or a notebook started there). That name belongs to Hugging Face's ``kernels`` package, which
    # transformers imports when it is installed. If that package is installed, load it in this module's place;
    # if not, stay an empty module (transformers' probe imports it and finds no version: "not available").
    import importlib.machinery
    import importlib.util

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds after this runs
        _spec.loader.exec_module(_module)


def available() -> bool:
    """True when Triton kernels can run: a CUDA device, or Triton's interpreter (:func:`interpreting`)."""
    try:
        import torch

        from ._util import interpreting
    except Exception:  # pragma: no cover - triton missing
        return False
    if interpreting():
        return True
    return torch.cuda.is_available()


if __name__ != "kernels":  # see the top
    from ._util import interpreting
    from .attention import DecodeRunner, paged_decode_attention, paged_prefix_attention
    from .dequant import dequantize_pages
    from .quantize import append_and_flush, quantize_and_write
    from .tuning import DecodeTuning, QuantTuning, Tuning

__all__ = [
    "DecodeRunner",
    "DecodeTuning",
    "QuantTuning",
    "Tuning",
    "append_and_flush",
    "available",
    "dequantize_pages",
    "interpreting",
    "paged_decode_attention",
    "paged_prefix_attention",
    "quantize_and_write",
]

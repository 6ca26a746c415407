"""Triton kernels for kivi_cache, installed as ``kivi_cache.kernels``.

Importing this package imports nothing (no Triton, nothing from ``kivi_cache``). Its modules:

* :mod:`.checks` (the ops' argument checks and the constants both sides use) and :mod:`.sinks` (learned sinks as one
  more key): torch only, shared with the torch side (``kivi_cache`` imports them from here);
* :mod:`.attention`, :mod:`.dequant`, :mod:`.quantize` (the ops), :mod:`.tuning` (their launch settings),
  :mod:`.unpack`, :mod:`._util`: import Triton.

Each op is the twin of the function of the same name in :mod:`kivi_cache.reference` (same signature and semantics; a
few extra keyword-only arguments, among them ``tuning``: the launch settings, :mod:`.tuning`).
:class:`~.attention.DecodeRunner` is ``paged_decode_attention`` planned once for many calls over the same pages (its
runs equal the op's calls; ``kivi_cache.ops.DecodeRunner`` picks it or the reference). The cache decides when to call
them (``kivi_cache.ops`` imports the modules it needs); use :func:`available` to know whether Triton can run here. The
names in ``__all__`` are also this package's attributes, their module imported on first use.
"""

from __future__ import annotations

import importlib
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
    """True when Triton kernels can run: a CUDA device, or Triton's interpreter (:func:`~._util.interpreting`)."""
    try:
        import torch

        from ._util import interpreting
    except Exception:  # pragma: no cover - triton missing
        return False
    if interpreting():
        return True
    return torch.cuda.is_available()


_LAZY = {  # name -> the module of this package that defines it
    "DecodeRunner": "attention",
    "paged_decode_attention": "attention",
    "paged_prefix_attention": "attention",
    "dequantize_pages": "dequant",
    "append_and_flush": "quantize",
    "quantize_and_write": "quantize",
    "DecodeTuning": "tuning",
    "QuantTuning": "tuning",
    "Tuning": "tuning",
    "interpreting": "_util",
}

if __name__ != "kernels":  # see the top

    def __getattr__(name: str):
        """The names of ``__all__`` from their modules, imported on first use (PEP 562): a Triton import never
        happens just because :mod:`.checks` or :mod:`.sinks` was imported."""
        mod = _LAZY.get(name)
        if mod is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{__name__}.{mod}"), name)

    def __dir__() -> list:
        return sorted({*globals(), *_LAZY})

    __all__ = sorted({"available", *_LAZY})

"""The key/value handles that ``QuantizedPagedCache.update`` returns.

A handle is a ``torch.Tensor`` subclass with the shape, dtype and device of the
full key (or value) history the model expects, but no data. kivi_cache's
attention function recognises it and reads the pages directly. Any other use
(eager attention, flash attention, user code) goes through
``__torch_function__``, which materializes the full-precision history once per
step and runs the operation on it: slower, but always correct.
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_map

_METADATA = {
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.__repr__,
}


_warned_slow = False


def _warn_slow_path(step) -> None:
    """Once per process: a decode step over a quantized history read by an attention function that is not the hook
    (``eager`` attention: GPT-OSS's and Gemma 2's default, or flash), which dequantizes the whole history every step."""
    global _warned_slow
    if _warned_slow or step.key.shape[2] != 1 or not any(getattr(step.layer, "paged_lens", ())):
        return
    _warned_slow = True
    warnings.warn("kivi_cache: this model's attention implementation does not read the quantized pages (e.g. "
                  "'eager', the default of GPT-OSS and Gemma 2): every decode step dequantizes the whole history "
                  "(correct, slow). Load the model with attn_implementation='kivi' (or 'sdpa') to read the pages "
                  "directly", RuntimeWarning, stacklevel=4)


def _handle_to_tensor(a):
    if isinstance(a, KVHandle):
        _warn_slow_path(a.step)
        return a.materialize()
    return a


def _real(a):
    """``a`` (a torch function's arguments) with every handle replaced by its materialized history: plain tuples,
    lists and dicts walked directly (the arguments of nearly every call; pytree's walk costs tens of microseconds),
    other containers (namedtuples, OrderedDicts, ...) through pytree."""
    t = type(a)
    if t is tuple or t is list:
        return t(_real(x) for x in a)
    if t is dict:
        return {k: _real(x) for k, x in a.items()}
    if isinstance(a, KVHandle):
        return _handle_to_tensor(a)
    if isinstance(a, (tuple, list, dict)):
        return tree_map(_handle_to_tensor, a)
    return a


class PendingStep:
    """The new tokens of one update call, shared by its key and value handles."""

    __slots__ = ("layer", "key", "value", "materialized", "done")

    def __init__(self, layer, key: torch.Tensor, value: torch.Tensor):
        self.layer = layer
        self.key = key
        self.value = value
        self.materialized = None
        self.done = False


class KVHandle(torch.Tensor):
    @staticmethod
    def __new__(cls, step: PendingStep, which: int, shape):
        src = step.key if which == 0 else step.value
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=src.dtype, device=src.device)
        t.step = step
        t.which = which
        return t

    def __repr__(self, *args, **kwargs):
        return f"KVHandle(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    def materialize(self, valid: torch.Tensor | None = None) -> torch.Tensor:
        """The full-precision history; ``valid`` (``[B, L]`` bool, None: all) marks the step's real tokens, so
        that pads are not stored (the attention hook's fallback reads it from the mask; other code cannot)."""
        step = self.step
        if step.materialized is None:
            step.materialized = step.layer.materialize(step, valid)
        return step.materialized[self.which]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        args, kwargs = _real(args), _real(kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"kivi_cache: KVHandle reached the dispatcher in {func}; please report this")

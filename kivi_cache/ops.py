"""One function per paged operation; each picks the Triton kernel or a torch implementation, up front.

Backend choice (``set_backend``): ``"auto"`` (default) uses the kernels for CUDA tensors when Triton is importable
and they cover the configuration (:func:`kivi_cache.kernels.checks.kernel_limits`: head_dim, bits, group and page
size), and the torch path otherwise: :mod:`kivi_cache.torch_ops`, which attends a chunk of pages at a time and never
builds the dequantized history (the other operations are the reference's). On a CUDA tensor the torch path warns
once per reason, so a GPU run is never silently slow. ``"torch"`` forces the reference (:mod:`kivi_cache.reference`,
the oracle: it dequantizes the whole history on each call), ``"triton"`` forces the kernels (also on CPU under
``TRITON_INTERPRET=1``). Whichever runs checks the arguments (:mod:`kivi_cache.kernels.checks`) and raises
``ValueError`` for a bad one, before anything is written.
"""

from __future__ import annotations

import warnings

import torch

from . import reference, torch_ops
from .kernels import checks

_BACKENDS = ("auto", "torch", "triton")
_backend = "auto"
_kernels = None
_kernel_error: str | None = None
_warned: set = set()
_limits: dict = {}


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


def _load_kernels():
    """:mod:`kivi_cache.kernels.api` (the kernels' ops), imported on first use (it imports Triton; the package's
    checks do not); None where it cannot load (:func:`kernel_error` says why)."""
    global _kernels, _kernel_error
    if _kernels is None and _kernel_error is None:
        try:
            from .kernels import api  # noqa: PLC0415  (imports triton)

            _kernels = api
        except Exception as exc:  # ImportError, or triton failing to initialise
            _kernel_error = f"{type(exc).__name__}: {exc}"
    return _kernels


def kernel_error() -> str | None:
    """None where the Triton kernels load (what ``"auto"`` uses on CUDA tensors), else why not (the import's
    error): a benchmark or a serving loop on a GPU can refuse to run on the slow torch path instead of only warning
    (a checkout run without installing it, say, where ``kivi_cache.kernels`` is not importable)."""
    _load_kernels()
    return _kernel_error


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"kivi_cache: {reason}; using the torch path on the GPU, which is much slower", RuntimeWarning,
                      stacklevel=4)


def _limit(op: str, pool, key_bits: int, value_bits: int, group_size: int) -> str | None:
    """:func:`~kivi_cache.kernels.checks.kernel_limits` for this call's configuration (remembered per configuration:
    a decode step asks once per layer)."""
    config = checks.pool_config(pool)
    if config is None:
        return None  # not a pool's shapes: the chosen kernels' checks say what is wrong
    d, p = config
    key = (op, d, p, key_bits, value_bits, group_size)
    if key not in _limits:
        _limits[key] = checks.kernel_limits(op, d, key_bits, value_bits, group_size, p, _kernels.interpreting())
    return _limits[key]


def _impl(device_type: str, op: str = "", pool=None, key_bits: int = 0, value_bits: int = 0, group_size: int = 0):
    """The module that runs ``op`` here: the kernels, :mod:`.torch_ops` or :mod:`.reference` (see the module's
    docstring). With ``pool`` and the bits, a configuration the kernels do not cover goes to the torch path under
    ``"auto"`` (with a warning on a GPU); ``"triton"`` then raises the kernels' ValueError when called."""
    if _backend == "torch":
        return reference
    if _backend == "triton":
        mod = _load_kernels()
        if mod is None:
            raise RuntimeError(f"backend 'triton' requested but the kernels cannot load ({_kernel_error})")
        if device_type != "cuda" and not mod.interpreting():
            raise RuntimeError(f"backend 'triton' runs the kernels on CUDA tensors, or on other devices only under "
                               f"TRITON_INTERPRET=1 (set before kivi_cache.kernels is imported); got {device_type} "
                               f"tensors (set_backend('auto') uses the torch path there, 'torch' the reference)")
        return mod
    if device_type != "cuda":
        return torch_ops
    mod = _load_kernels()
    if mod is None:
        _warn_once(f"Triton kernels unavailable ({_kernel_error})")
        return torch_ops
    if pool is not None:
        reason = _limit(op, pool, key_bits, value_bits, group_size)
        if reason is not None:
            _warn_once(f"the {op} kernel does not cover this configuration ({reason})")
            return torch_ops
    return mod


def _call(name: str, device, pool, bits: tuple, *args, **kwargs):
    """``name`` of the module :func:`_impl` picks, called with ``args`` (the op's positional arguments, ``pool``
    among them) on ``device``'s GPU."""
    mod = _impl(device.type, name, pool, *bits)
    if mod is not reference and mod is not torch_ops and device.type == "cuda" and device.index not in (
            None, torch.cuda.current_device()):
        # Triton launches on the current device: with a model spread over GPUs (device_map), a layer's
        # tensors may live on another one.
        with torch.cuda.device(device):
            return getattr(mod, name)(*args, **kwargs)
    return getattr(mod, name)(*args, **kwargs)


def quantize_and_write(k, v, pages, slots, pool, *, key_bits, value_bits, group_size, clip_keys=False,
                       clip_values=False):
    """Quantize N groups ``k``/``v`` ``[N, H, G, D]`` into ``pool`` (:class:`~kivi_cache.kernels.checks.PoolTensors`)
    at pages ``pages[n]``, token slots ``slots[n]`` (:func:`kivi_cache.reference.quantize_and_write`; ``clip_keys``/
    ``clip_values``: the range search of :mod:`kivi_cache.quant`)."""
    pool = checks.pool_tensors(pool)
    _call("quantize_and_write", k.device, pool, (key_bits, value_bits, group_size), k, v, pages, slots, *pool,
          key_bits, value_bits, group_size, clip_keys=_flag("clip_keys", clip_keys),
          clip_values=_flag("clip_values", clip_values))


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def append_and_flush(new_k, new_v, res_k, res_v, res_lengths, sink_lengths, lengths, block_table, pool, *, key_bits,
                     value_bits, group_size, residual_length, sink_length, clip_keys=False, clip_values=False):
    """A decode step's window write and flush of full windows (:func:`kivi_cache.reference.append_and_flush`)."""
    pool = checks.pool_tensors(pool)
    _call("append_and_flush", res_k.device, pool, (key_bits, value_bits, group_size), new_k, new_v, res_k, res_v,
          res_lengths, sink_lengths, lengths, block_table, *pool, key_bits, value_bits, group_size, residual_length,
          sink_length, clip_keys=_flag("clip_keys", clip_keys), clip_values=_flag("clip_values", clip_values))


def dequantize_pages(block_table, lengths, pool, *, key_bits, value_bits, group_size, max_len=None, out=None):
    """The stored history ``[B, H, max_len, D]`` keys and values of each sequence's pages (positions past its length
    zero). ``out=(k, v)``: tensors (views allowed) written in place and returned."""
    pool = checks.pool_tensors(pool)
    extra = {} if out is None else dict(out=out)
    return _call("dequantize_pages", block_table.device, pool, (key_bits, value_bits, group_size), block_table,
                 lengths, *pool, key_bits, value_bits, group_size, max_len=max_len, **extra)


def paged_decode_attention(q, block_table, lengths, pool, *, res_k, res_v, res_lengths, key_bits, value_bits,
                           group_size, sm_scale, new_k=None, new_v=None, merge=True, sliding_window=None,
                           sink_logits=None):
    """One query token per sequence (``q`` ``[B, Hq, D]``) over its pages in ``pool`` and its window ``res_k/res_v``.
    ``new_k``/``new_v``: the step's token, written into the window (at ``res_lengths - 1``) by the op itself.
    ``merge=False``: the kernels never merge partials in the split kernel (which keeps arrival counts allocated
    by its first call): for a compiled step whose CUDA graphs own every allocation it makes. ``sliding_window``:
    attention over the last ``sliding_window`` stored tokens only; ``sink_logits`` (``[Hq]``): learned attention
    sinks, one more softmax logit per query head on no value (GPT-OSS; see
    :func:`kivi_cache.reference.paged_decode_attention`)."""
    pool = checks.pool_tensors(pool)
    extra = {} if new_k is None and new_v is None else dict(new_k=new_k, new_v=new_v)
    if sliding_window is not None:
        extra["sliding_window"] = sliding_window
    if sink_logits is not None:
        extra["sink_logits"] = sink_logits
    return _call("paged_decode_attention", q.device, pool, (key_bits, value_bits, group_size), q, block_table,
                 lengths, *pool, res_k, res_v, res_lengths, key_bits, value_bits, group_size, sm_scale, merge=merge,
                 **extra)


def paged_prefix_attention(q, block_table, lengths, pool, *, res_k, res_v, res_lengths, new_k, new_v, new_mask,
                           key_bits, value_bits, group_size, sm_scale, sliding_window=None, sink_logits=None):
    """A chunk of queries (``q`` ``[B, Hq, L, D]``) over each sequence's stored history (pages and window) and the
    chunk's own keys and values ``new_k/new_v`` (:func:`kivi_cache.reference.paged_prefix_attention`)."""
    pool = checks.pool_tensors(pool)
    extra = {} if sliding_window is None else dict(sliding_window=sliding_window)
    if sink_logits is not None:
        extra["sink_logits"] = sink_logits
    return _call("paged_prefix_attention", q.device, pool, (key_bits, value_bits, group_size), q, block_table,
                 lengths, *pool, res_k, res_v, res_lengths, new_k, new_v, new_mask, key_bits, value_bits, group_size,
                 sm_scale, **extra)


class DecodeRunner:
    """:func:`paged_decode_attention` over one fixed state (block table, lengths, page pool, window) called again and
    again with new queries (plan once, run many: the cache's decode steps). The backend is chosen once, as the op
    chooses it: the Triton kernels' :class:`~kivi_cache.kernels.decode.DecodeRunner` on a GPU (it launches the
    compiled kernels directly after a first ordinary call), the torch path's :class:`~kivi_cache.torch_ops.DecodeRunner`
    (the fixed tensors' shapes checked once, the block table's and lengths' values again after an in-place write to
    them), else the chosen backend's op at every call (the reference; the kernels off a GPU). Called while another GPU
    is current, it runs on the state's. ``own``: the caller builds the index tensors itself (the cache), so the torch
    path does not check their values again (:class:`kivi_cache.kernels.checks.own_state`). Build a new one when the
    state's tensors are replaced."""

    def __init__(self, block_table, lengths, pool, *, res_k, res_v, key_bits, value_bits, group_size,
                 sliding_window: int | None = None, own: bool = False):
        pool = checks.pool_tensors(pool)
        self.block_table, self.lengths, self.pool, self.res_k, self.res_v = block_table, lengths, pool, res_k, res_v
        self.own = own
        self.sliding_window = sliding_window
        self.bits = dict(key_bits=key_bits, value_bits=value_bits, group_size=group_size)
        dev = block_table.device
        self.device = dev if dev.type == "cuda" else None
        mod = _impl(dev.type, "paged_decode_attention", pool, key_bits, value_bits, group_size)
        self.op = mod.paged_decode_attention  # the ordinary call: the reference, or the kernels off a GPU
        self.kernel = None
        if mod is torch_ops or (mod is not reference and self.device is not None):
            self.kernel = mod.DecodeRunner(block_table, lengths, *pool, res_k, res_v, key_bits, value_bits,
                                           group_size, sliding_window=sliding_window)

    def __call__(self, q, res_lengths, sm_scale: float, new_k=None, new_v=None, sink_logits=None):
        k = self.kernel
        if k is None:
            new = {} if new_k is None and new_v is None else dict(new_k=new_k, new_v=new_v)
            return self.op(q, self.block_table, self.lengths, *self.pool, self.res_k, self.res_v, res_lengths,
                           **self.bits, sm_scale=sm_scale, sliding_window=self.sliding_window,
                           sink_logits=sink_logits, **new)
        if self.device is None:  # the torch path's runner
            if self.own:
                with checks.own_state():
                    return k.run(q, res_lengths, sm_scale, new_k, new_v, sink_logits)
            return k.run(q, res_lengths, sm_scale, new_k, new_v, sink_logits)
        if self.device.index not in (None, torch.cuda.current_device()):
            with torch.cuda.device(self.device):
                return k.run(q, res_lengths, sm_scale, new_k, new_v, sink_logits)
        return k.run(q, res_lengths, sm_scale, new_k, new_v, sink_logits)

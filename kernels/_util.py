"""Small shared helpers for the kivi_cache Triton kernels (no kernel code; the ops' argument checks and the constants
shared with the torch side are in :mod:`.checks`)."""

from __future__ import annotations

import torch
import triton

from .checks import POOL_NAMES, kernel_limits


@triton.jit
def _probe():
    """Never launched: what ``@triton.jit`` made of it says how Triton built this package's kernels."""
    pass


# Triton's interpreter runs the kernels (TRITON_INTERPRET=1 when they were defined): ``@triton.jit`` then makes an
# interpreted function (Triton 3.6 to 3.9: ``triton.runtime.interpreter.InterpretedFunction``), not a JITFunction
INTERPRETER = not isinstance(_probe, triton.runtime.JITFunction)


def interpreting() -> bool:
    """True where Triton's interpreter runs the kernels (decided when they were defined, at import)."""
    return INTERPRETER


def check_pool_strides(pool) -> None:
    """The pool as every kernel reads it: each tensor's rows contiguous (last dim), and each zero-point tensor strided
    as its scales (the kernels index both with the scales' strides; dims of size 1 aside), else ValueError naming the
    tensor. (The torch reference takes any strides.)"""
    for name, t in zip(POOL_NAMES, pool, strict=True):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension for the Triton kernels, got strides "
                             f"{tuple(t.stride())} for shape {list(t.shape)}")
    for s, z in ((1, 2), (4, 5)):
        if _used_strides(pool[z]) != _used_strides(pool[s]):
            raise ValueError(f"{POOL_NAMES[z]} must have {POOL_NAMES[s]}'s strides {tuple(pool[s].stride())} (the "
                             f"Triton kernels index both with them), got {tuple(pool[z].stride())}")


def _used_strides(t: torch.Tensor) -> tuple:
    """The strides of ``t``'s dims of more than one element (None for the others: never stepped along)."""
    return tuple(st if n > 1 else None for st, n in zip(t.stride(), t.shape, strict=True))


def check_settings(d: int, key_bits: int, value_bits: int, group_size: int, page_size: int, op: str = "") -> None:
    """head_dim, bits, group size and page size as the kernels take them (:func:`.checks.kernel_limits`), else
    ValueError."""
    reason = kernel_limits(op, d, key_bits, value_bits, group_size, page_size, interpreting())
    if reason is not None:
        raise ValueError(reason)


def pow2_divisor(n: int) -> int:
    """Largest power of two dividing n (n > 0)."""
    return n & -n


def block_tokens(page_size: int, group_size: int, cap: int) -> int:
    """Tokens per kernel iteration: a power of two that divides the page and is a multiple of G, at most ``cap``
    where the group allows. The GPU's lower bound of 32 tokens is a configuration limit checked before
    (:func:`.checks.kernel_limits`, through :func:`check_settings`)."""
    return max(min(pow2_divisor(page_size), cap), group_size)


_SM_COUNT: dict = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


# Launch option of every kernel here (Launcher adds it; a direct launch passes it): floating-point fusion (a * b + c
# as one fma) stated rather than left to Triton's default. The kernels are tuned and timed with it (Triton 3.6's
# default); 3.9 keeps it on but warns at the first compile unless TRITON_DEFAULT_FP_FUSION is set, and announces the
# default off from 3.10 (more instructions in the softmax and merges, other rounding). TRITON_FORCE_DISABLE_FP_FUSION=1
# still turns it off.
FP_FUSION = {"enable_fp_fusion": True}

# ----------------------------------------------------------------------------- cached launches
# A @triton.jit launch spends tens of microseconds in Python (binding and specializing every argument, the
# cache key) before the driver call; an eager decode step makes two per layer. ``Launcher`` keeps the compiled
# kernel of a first launch under the caller's plan key (everything that fixes Triton's specialization except
# the pointers' alignment, which is checked per call) and launches it directly afterwards, through the same
# ``CompiledKernel.run`` call ``JITFunction.run`` ends with (Triton 3.6 to 3.9), with the tensors passed as their
# addresses (Triton's launcher takes an int as the pointer itself; for a tensor it calls ``data_ptr`` and asks the
# driver about the pointer, once per tensor and launch). A caller passes ``plan_key=None`` for Triton's own launch
# (its tuning's ``fast_launch`` off: :mod:`.tuning`). Never under the interpreter or while a launch hook (a profiler)
# is set.
_knobs = None


class Launcher:
    def __init__(self, fn):
        self.fn = fn
        self.kernels: dict = {}
        self.fast_launches = 0  # for tests

    def __call__(self, plan_key, grid: tuple, args: tuple, meta: dict):
        fast = plan_key is not None and not interpreting()
        entry = self.kernels.get(plan_key) if fast else None
        align = None
        if entry is not None:  # (positions of the tensor arguments, {their alignment: (kernel, constexprs)})
            tensors, by_align = entry
            ptrs = [args[i].data_ptr() for i in tensors]
            align = tuple([p % 16 == 0 for p in ptrs])
            hit = by_align.get(align)
            if hit is not None and no_launch_hooks():
                kernel, consts = hit
                call = list(args)
                for i, p in zip(tensors, ptrs, strict=True):
                    call[i] = p
                g = (*grid, 1, 1)
                kernel.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(torch.cuda.current_device()),
                           kernel.function, kernel.packed_metadata, None, None, None, *call, *consts)
                self.fast_launches += 1
                return kernel
        kernel = self.fn[grid](*args, **meta, **FP_FUSION)
        if fast and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata")):
            if entry is None:
                if len(self.kernels) > 4096:  # plan keys seen by a long-lived process: keep the cache bounded
                    self.kernels.clear()
                entry = self.kernels[plan_key] = (
                    tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), {})
            params = self.fn.params[len(args):]  # the constexprs (and defaulted parameters) after the runtime args
            consts = tuple(meta[p.name] if p.name in meta else p.default for p in params)
            if align is None:
                align = tuple(args[i].data_ptr() % 16 == 0 for i in entry[0])
            entry[1][align] = (kernel, consts)
        return kernel

    def compiled(self, plan_key, args: tuple):
        """The compiled kernel a fast launch of ``args`` under ``plan_key`` would use: ``(positions of the tensor
        arguments, kernel, constexprs)``, or None when there is none yet (for callers that keep a launch ready,
        :class:`~kivi_cache.kernels.decode.DecodeRunner`)."""
        entry = self.kernels.get(plan_key)
        if entry is None:
            return None
        tensors, by_align = entry
        hit = by_align.get(tuple(args[i].data_ptr() % 16 == 0 for i in tensors))
        return None if hit is None else (tensors, *hit)


def no_launch_hooks() -> bool:
    """No launch hook is set (Triton 3.6+ keeps them as chains of callables, empty unless a profiler adds one)."""
    global _knobs
    if _knobs is None:
        from triton import knobs  # noqa: PLC0415

        _knobs = knobs.runtime
    return all(h is None or not getattr(h, "calls", True) for h in (_knobs.launch_enter_hook, _knobs.launch_exit_hook))

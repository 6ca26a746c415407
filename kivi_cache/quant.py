"""Reference quantization math in plain torch: the oracle for every kernel.

Scheme (KIVI, arXiv 2402.02750): asymmetric min/max quantization with
round-to-nearest (``floor(x + 0.5)``), codes in ``[0, 2**bits - 1]``.

* keys   are quantized **per channel**: for each head and channel, a group of
  ``group_size`` consecutive tokens shares one scale and one zero point.
* values are quantized **per token**: for each token, a group of
  ``group_size`` consecutive channels shares one scale and one zero point.

``x ~= code * scale + zero``. In order, with ``S`` the storage dtype of scales
and zero points (the model's dtype) and all arithmetic in fp32:

1. the group is clamped to ``[-C, C]``, ``C =`` :func:`range_bound` ``(S)``: ``2**14`` for fp16, ``2**126`` for
   bf16 and fp32 (a quarter or less of S's range), so that a group's span (at most ``2 C``), every code's
   reconstruction and the fp16/bf16 decode kernel's folded zero point ``zero - 2**bits * scale`` (at most
   ``C + 4/3 * 2 C`` in magnitude) are finite in S;
2. ``zero = min(group)`` rounded to nearest in S;
3. ``scale = (max(group) - zero) / (2**bits - 1)`` rounded *up* in S (the
   next representable value when the cast rounded down), so the largest
   element never needs a code above ``2**bits - 1``;
4. ``code = clamp(floor((x - zero) / scale + 0.5), 0, 2**bits - 1)``, and
   ``code = 0`` where ``scale == 0``.

So every element's round-trip error is at most half a step (``scale / 2``) of
its group, plus the rounding of ``zero`` and of the output in S. A constant
group has scale 0, codes 0, and dequantizes exactly to its value.

Clipping (``clip=True``; ``QuantConfig.clip``): steps 2-4 run once for each ``i`` in ``0 ..
CLIP_STEPS - 1`` (8) on the range narrowed about its centre, ``[min + c, max - c]`` with
``c = (max - min) * (i / 32)`` in fp32 (``i = 0``: the plain range; the narrowest keeps 9/16 of the
span), and the group keeps the candidate whose reconstruction ``code * scale + zero`` (fp32, from the
stored scale and zero point) has the lowest sum of squared errors against the clamped group, the first
of equal ones. Elements beyond a narrowed range take the end codes. At 2 bits a group's extremes cost
every other element resolution; the search trades them for it where that lowers the group's error, and
never raises it.

Range: ``code * scale + zero`` lies within ``3 C`` of 0 (``C + 2 C`` rounded up) for every stored triple, so finite
inputs dequantize to finite values in S at every bit width and on every backend. Finite elements beyond ``+-C``
(fp16 magnitudes above 16384, which attention in fp16 could not use anyway, fp32 data stored with fp16 scales, or
magnitudes above ``2**126``) saturate at ``+-C``.

Non-finite inputs: an element that is NaN or +-inf makes its whole group NaN (scale and zero NaN, codes 0): for
keys its channel's G tokens, for values its token's G channels; every other group is unaffected. The Triton
kernels (:mod:`kernels.quantize`) store the same bytes.

Packed layouts (shared with the kernels), ``n = 8 // bits`` codes per byte:

* keys (:func:`pack`): one row per token, packed along the channel axis,
  *planar*: byte ``j`` of a row holds channel ``j + k * D // n`` in bits
  ``[k * bits, (k + 1) * bits)``. A packed row is ``D * bits // 8`` bytes;
  unpacking chunk ``k`` of every byte yields the channel block
  ``[k * D // n, (k + 1) * D // n)``.
* values (:func:`pack_tokens`): one row per channel, packed along the token
  axis of a page, in 32-bit words of ``4 n`` consecutive tokens; byte ``p``
  of word ``w``, bits ``[k * bits, (k + 1) * bits)``, holds token
  ``4 n w + 2 (p % 2 + 2 k) + p // 2``. Bytes ``q`` and ``q + 2`` of a word
  thus hold two consecutive tokens in the same bit field: one shift and mask
  of the word puts both in the halves of a register, the pair of tokens an
  MMA operand register holds for ``P @ V``. Value scales and zero points are
  stored token-contiguous too (``[D // G, P]`` per page), so that a 32-bit
  load gives the two tokens' scales of such a register.
"""

from __future__ import annotations

import sys

import torch

from .kernels.checks import CLIP_STEPS


def qmax(bits: int) -> int:
    return (1 << bits) - 1


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes ``[..., D]`` into ``[..., D * bits // 8]`` (planar layout)."""
    n = 8 // bits
    if n == 1:
        return codes.to(torch.uint8)
    d = codes.shape[-1]
    chunks = codes.to(torch.int32).reshape(*codes.shape[:-1], n, d // n)
    shifts = torch.arange(n, device=codes.device, dtype=torch.int32) * bits
    return (chunks << shifts[:, None]).sum(-2).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., D * bits // 8]`` -> uint8 ``[..., D]``."""
    n = 8 // bits
    if n == 1:
        return packed
    shifts = torch.arange(n, device=packed.device, dtype=torch.uint8) * bits  # uint8 throughout: no widening copies
    chunks = (packed.unsqueeze(-2) >> shifts[:, None]) & qmax(bits)
    return chunks.reshape(*packed.shape[:-1], n * packed.shape[-1])


def range_bound(dtype: torch.dtype) -> float:
    """The clamp bound ``C`` of the module docstring for scales stored in ``dtype``: ``2**14`` for fp16, else
    ``2**126`` (exact in every float dtype)."""
    return 2.0**14 if dtype == torch.float16 else 2.0**126


def round_up_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast non-negative fp32 ``x`` to ``dtype``, rounding up (never below ``x``)."""
    y = x.to(dtype)
    if dtype == torch.float32:
        return y
    low = y.float() < x
    bumped = (y.view(torch.int16) + 1).view(dtype)  # next representable value above a positive y
    return torch.where(low, bumped, y)


def _quantize(x: torch.Tensor, dim: int, bits: int, store_dtype: torch.dtype, clip: bool = False):
    """Quantize ``x`` with one (scale, zero) per slice along ``dim`` (reduced); ``clip``: the range search of the
    module docstring."""
    xf = x.float()
    # x - x: NaN for a NaN or an inf, else +0, whose subtraction below leaves every value (a -0 too) as it is
    poison = (xf - xf).sum(dim=dim, keepdim=True)
    c = range_bound(store_dtype)
    xf = xf.clamp(-c, c)
    lo, hi = xf.amin(dim=dim, keepdim=True), xf.amax(dim=dim, keepdim=True)
    codes, scale, zero = _quantize_range(xf, lo, hi, poison, bits, store_dtype)
    if clip:
        err = _squared_error(xf, codes, scale, zero, dim)
        for i in range(1, CLIP_STEPS):
            cut = (hi - lo) * (i / 32)
            cand = _quantize_range(xf, lo + cut, hi - cut, poison, bits, store_dtype)
            e = _squared_error(xf, *cand, dim)
            better = e < err  # false for a poisoned group (NaN): it keeps the plain candidate's NaN scale
            err = torch.where(better, e, err)
            codes = torch.where(better, cand[0], codes)
            scale, zero = torch.where(better, cand[1], scale), torch.where(better, cand[2], zero)
    return codes, scale.squeeze(dim), zero.squeeze(dim)


def _quantize_range(xf, lo, hi, poison, bits: int, store_dtype: torch.dtype):
    """Steps 2-4 of the module docstring for the range ``[lo, hi]`` (fp32, reduced dim kept) of clamped ``xf``."""
    zero = (lo - poison).to(store_dtype)
    z = zero.float()
    span = (hi - z).clamp_(min=0)
    scale = (round_up_to(span / qmax(bits), store_dtype).float() - poison).to(store_dtype)
    s = scale.float()
    q = torch.where(s > 0, torch.floor((xf - z) / torch.where(s > 0, s, 1.0) + 0.5), 0.0)  # a NaN scale: code 0
    return q.clamp_(0, qmax(bits)).to(torch.uint8), scale, zero


def _squared_error(xf, codes, scale, zero, dim: int) -> torch.Tensor:
    """The fp32 sum over ``dim`` of the squared reconstruction errors (kept dim)."""
    return (codes.float() * scale.float() + zero.float() - xf).square().sum(dim=dim, keepdim=True)


def quantize_keys(k: torch.Tensor, bits: int, group_size: int, store_dtype: torch.dtype | None = None,
                  clip: bool = False):
    """Per-channel key quantization (``clip``: the range search of the module docstring).

    k: ``[..., T, D]`` with T a multiple of group_size.
    Returns codes uint8 ``[..., T, D]`` (unpacked), scale and zero ``[..., T // G, D]``.
    """
    *lead, t, d = k.shape
    if t % group_size:
        raise ValueError(f"key token count {t} is not a multiple of group_size={group_size}")
    grouped = k.reshape(*lead, t // group_size, group_size, d)
    codes, scale, zero = _quantize(grouped, -2, bits, store_dtype or k.dtype, clip)
    return codes.reshape(*lead, t, d), scale, zero


def quantize_values(v: torch.Tensor, bits: int, group_size: int, store_dtype: torch.dtype | None = None,
                    clip: bool = False):
    """Per-token value quantization (``clip``: the range search of the module docstring).

    v: ``[..., T, D]`` with D a multiple of group_size.
    Returns codes uint8 ``[..., T, D]`` (unpacked), scale and zero ``[..., T, D // G]``.
    """
    *lead, t, d = v.shape
    grouped = v.reshape(*lead, t, d // group_size, group_size)
    codes, scale, zero = _quantize(grouped, -1, bits, store_dtype or v.dtype, clip)
    return codes.reshape(*lead, t, d), scale, zero


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """codes ``[..., T, D]`` (unpacked), scale/zero ``[..., T // G, D]`` -> ``[..., T, D]``."""
    *lead, t, d = codes.shape
    c = codes.float().reshape(*lead, t // group_size, group_size, d)  # each group's scale broadcast over its tokens
    out = c * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)
    return out.reshape(*lead, t, d).to(dtype or scale.dtype)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """codes ``[..., T, D]`` (unpacked), scale/zero ``[..., T, D // G]`` -> ``[..., T, D]``."""
    *lead, t, d = codes.shape
    c = codes.float().reshape(*lead, t, d // group_size, group_size)  # each group's scale broadcast over its channels
    out = c * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return out.reshape(*lead, t, d).to(dtype or scale.dtype)


def pack_tokens(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The value layout (module docstring): uint8 codes ``[..., C, T]`` (channel rows, T tokens,
    T a multiple of ``32 // bits``) -> ``[..., C, T * bits // 8]``. Word w of a row (4 bytes) holds tokens
    ``tw * w .. tw * w + tw - 1`` (``tw = 32 // bits``); byte p, bit field k holds token
    ``tw * w + 2 * (p % 2 + 2 * k) + p // 2``, so that the decode kernel's ODD unpack (bytes q and q + 2 of a
    word) gives two consecutive tokens."""
    n = 8 // bits
    tw = 4 * n
    *lead, c, t = codes.shape
    x = codes.to(torch.int32).reshape(*lead, c, t // tw, n, 2, 2)  # token = tw w + 4 k + 2 q + h
    out = torch.zeros(*lead, c, t // tw, 4, dtype=torch.int32, device=codes.device)
    for k in range(n):
        for q in range(2):
            for h in range(2):
                out[..., q + 2 * h] |= x[..., k, q, h] << (k * bits)  # byte p = q + 2h
    return out.to(torch.uint8).reshape(*lead, c, t * bits // 8)


def unpack_tokens(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_tokens`: ``[..., C, T * bits // 8]`` -> uint8 ``[..., C, T]``."""
    n = 8 // bits
    tw = 4 * n
    *lead, c, nb = packed.shape
    t = nb * n
    # each 4-byte word as one int32; token tw w + 4k + 2q + h sits in byte q + 2h at bit k bits: one shift by a vector
    # of tw shifts gives a word's tokens in order (1.7-2.2x faster on the CPU than a loop over the bit fields)
    words = packed.reshape(*lead, c, t // tw, 4).contiguous().view(torch.int32)  # [..., C, W, 1]
    return ((words >> _token_shifts(bits, packed.device)) & qmax(bits)).to(torch.uint8).reshape(*lead, c, t)


_SHIFTS: dict = {}


def _token_shifts(bits: int, device) -> torch.Tensor:
    """int32 ``[32 // bits]``: the bit offset in its word of each token of the word, in token order."""
    key = (bits, device)
    s = _SHIFTS.get(key)
    if s is None:
        n = 8 // bits
        byte = (lambda i: i) if sys.byteorder == "little" else (lambda i: 3 - i)  # byte i of the word at bits 8 byte(i)
        s = _SHIFTS[key] = torch.tensor([8 * byte(q + 2 * h) + k * bits for k in range(n) for q in range(2)
                                         for h in range(2)], dtype=torch.int32, device=device)
    return s

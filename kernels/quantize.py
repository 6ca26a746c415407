"""quantize_and_write: quantize N key/value groups and write them into their pages.

One launch, grid ``(N, H, 2)``: program ``(n, h, 0)`` reads ``k[n, h]`` and program ``(n, h, 1)`` ``v[n, h]``
(``[G, D]`` each; ``QuantTuning(split=False)``: one program does both), and quantizes in fp32 as
:mod:`kivi_cache.quant` (the same bytes): values clamped to ``[-C, C]`` (``2**14`` for fp16 scales, ``2**126``
else: every reconstruction stays finite); zero = min rounded to nearest in the storage dtype S, scale = (max - zero)
/ qmax rounded *up* in S; a NaN or inf element makes its group's scale and zero NaN and its codes 0. Codes are
computed from the *rounded* values (``floor((x - zero) / scale + 0.5)``, IEEE division, clamped; scale 0 gives
code 0), packed (keys planar per token row, values per channel row along tokens: see
:mod:`kivi_cache.quant`) and written with the scales and zeros at ``(pages[n], slots[n])``.

Clipping (``clip_keys``/``clip_values``, constexprs ``CLIP_K``/``CLIP_V``), as :mod:`kivi_cache.quant`: each
group is also quantized by the same steps on the ranges ``[lo + c, hi - c]``, ``c = (hi - lo) * (i / 32)`` for
``i = 1 .. CLIP_STEPS - 1`` (:data:`.checks.CLIP_STEPS`; lo, hi the clamped extremes), and keeps the candidate with
the lowest fp32 sum of squared reconstruction errors, the first of equal ones (a NaN group keeps the plain
candidate's NaN scale and zero). Its products are rounded by themselves as torch's (on the GPU by inline PTX, which fp
fusion leaves unfused), so that only the order of each error's sum differs from the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import checks
from . import tuning as _tuning
from ._util import Launcher, check_pool_strides, check_settings, interpreting

_CLIP_STEPS = tl.constexpr(checks.CLIP_STEPS)  # candidate ranges of the clipping search (the plain one first)


@triton.jit
def _pack_store(codes, dst, t2, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """codes int32 [G, D] -> planar bytes [G, D // n] stored at dst + t2 * stride + byte."""
    N: tl.constexpr = 8 // BITS
    DN: tl.constexpr = D // N
    c3 = tl.reshape(codes, [G, N, DN])
    sh = (tl.arange(0, N) * BITS)[None, :, None]
    packed = tl.sum(c3 << sh, axis=1)  # [G, DN]
    tl.store(dst + t2 + tl.arange(0, DN)[None, :], packed.to(tl.uint8))


@triton.jit
def _pack_tokens_store(codes, dst, slot, s_row, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Value codes int32 [G tokens, D] -> channel rows packed along tokens (:func:`kivi_cache.quant.pack_tokens`):
    the G * BITS / 8 bytes of each row from byte ``slot * BITS / 8`` (whole 32-bit words: G * BITS >= 32)."""
    N: tl.constexpr = 8 // BITS
    TW: tl.constexpr = 4 * N  # tokens per word: token TW w + 4 k + 2 q + h in byte 4 w + q + 2 h, bits k
    c5 = tl.reshape(tl.trans(codes), [D, G // TW, N, 2, 2])  # [channel, w, k, q, h]
    sh = (tl.arange(0, N) * BITS)[None, None, :, None, None]
    packed = tl.sum(c5 << sh, axis=2)  # [channel, w, q, h]
    packed = tl.reshape(tl.permute(packed, (0, 1, 3, 2)), [D, G * BITS // 8])  # byte 4 w + 2 h + q
    off = tl.arange(0, D)[:, None] * s_row + slot * BITS // 8 + tl.arange(0, G * BITS // 8)[None, :]
    tl.store(dst + off, packed.to(tl.uint8))


@triton.jit
def _round_up(r, SDT: tl.constexpr, BUMP: tl.constexpr):
    """Cast non-negative fp32 r to SDT rounding up (next representable value when the cast rounded down)."""
    y = r.to(SDT)
    if BUMP:
        bumped = (y.to(tl.int16, bitcast=True) + 1).to(SDT, bitcast=True)
        y = tl.where(y.to(tl.float32) < r, bumped, y)
    return y


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_range(x, lo, hi, poison, AXIS: tl.constexpr, QMAX: tl.constexpr, SDT: tl.constexpr,
                    BUMP: tl.constexpr, RECIP: tl.constexpr, C: tl.constexpr):
    """x (clamped to [-C, C]) quantized over AXIS on the fp32 range [lo, hi] (reduced shape; clamped here) -> (scale,
    zero) in SDT and fp32 codes in [0, QMAX] computed from the rounded values; a NaN poison makes scale and zero NaN
    and the codes 0."""
    zero = (tl.minimum(tl.maximum(lo, -C), C) - poison).to(SDT)
    zf = zero.to(tl.float32)
    span = tl.maximum(tl.minimum(tl.maximum(hi, -C), C) - zf, 0.0)
    if RECIP:  # torch on CUDA divides by a scalar as a multiply by its fp32 reciprocal
        r = span * (1.0 / QMAX)
    else:
        r = tl.math.div_rn(span, tl.full(span.shape, QMAX, tl.float32))
    scale = _round_up(r, SDT, BUMP)
    scale = (scale.to(tl.float32) - poison).to(SDT)  # in fp32: the interpreter's bf16 arithmetic mishandles NaN
    s = tl.expand_dims(scale.to(tl.float32), AXIS)
    pos = s > 0  # false for a NaN scale: code 0
    q = tl.math.div_rn(x - tl.expand_dims(zf, AXIS), tl.where(pos, s, 1.0))
    q = tl.where(pos, tl.floor(q + 0.5), 0.0)
    return scale, zero, tl.minimum(tl.maximum(q, 0.0), QMAX)


@triton.jit
def _mul_rn(a, b, PTX: tl.constexpr):
    """fp32 a * b (broadcast) rounded by itself, as torch's: on the GPU a PTX ``mul.rn`` (never contracted with a
    following add into an fma, as fp fusion does a plain product), under the interpreter a plain product."""
    if PTX:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return a * b


@triton.jit
def _squared_error(x, q, scale, zero, AXIS: tl.constexpr, PTX: tl.constexpr):
    """fp32 sum over AXIS of (q * scale + zero - x)**2, each product and sum rounded as in
    kivi_cache.quant._squared_error (the order of the sum aside)."""
    e = _mul_rn(q, tl.expand_dims(scale.to(tl.float32), AXIS), PTX) + tl.expand_dims(zero.to(tl.float32), AXIS) - x
    return tl.sum(_mul_rn(e, e, PTX), AXIS)


@triton.jit
def _quantize_axis(x, AXIS: tl.constexpr, QMAX: tl.constexpr, SDT: tl.constexpr, BUMP: tl.constexpr,
                   RECIP: tl.constexpr, CLIP: tl.constexpr, PTX: tl.constexpr):
    """fp32 x quantized over AXIS -> (scale, zero) in SDT and int32 codes computed from the rounded values; CLIP: the
    range search (module docstring; PTX: its products by inline PTX, :func:`_mul_rn`)."""
    C: tl.constexpr = 2.0**14 if SDT == tl.float16 else 2.0**126  # kivi_cache.quant.range_bound(SDT)
    # the group's extremes, NaN where it holds a NaN (the reductions propagate it); the extremes of the clamped values
    # are the clamped extremes
    lo = tl.reduce(x, AXIS, _min_nan)
    hi = tl.reduce(x, AXIS, _max_nan)
    poison = (lo - lo) + (hi - hi)  # NaN where the group holds a NaN or an inf, else +0 (subtracted: no change)
    x = tl.minimum(tl.maximum(x, -C), C)
    scale, zero, q = _quantize_range(x, lo, hi, poison, AXIS, QMAX, SDT, BUMP, RECIP, C)
    if CLIP:
        err = _squared_error(x, q, scale, zero, AXIS, PTX)
        lo = tl.minimum(tl.maximum(lo, -C), C)
        hi = tl.minimum(tl.maximum(hi, -C), C)
        for i in tl.static_range(1, _CLIP_STEPS):
            cut = _mul_rn(hi - lo, tl.full(lo.shape, i / 32, tl.float32), PTX)  # i / 32: an exact fp32 constant
            # [lo + cut, hi - cut] lies within [-C, C]: the helper's clamps leave it as it is
            c_scale, c_zero, c_q = _quantize_range(x, lo + cut, hi - cut, poison, AXIS, QMAX, SDT, BUMP, RECIP, C)
            c_err = _squared_error(x, c_q, c_scale, c_zero, AXIS, PTX)
            better = c_err < err  # false for a NaN group: it keeps the plain candidate
            err = tl.where(better, c_err, err)
            scale = tl.where(better, c_scale, scale)
            zero = tl.where(better, c_zero, zero)
            q = tl.where(tl.expand_dims(better, AXIS), c_q, q)
    return scale, zero, q.to(tl.int32)


@triton.jit
def _quantize_write_kernel(
    k_ptr, v_ptr,  # [N, H, G, D] the groups' keys and values
    pages_ptr, slots_ptr,  # [N] int page id and first token slot (a multiple of G) of each group
    kc_ptr,  # [NP, H, P, D * KBITS / 8] uint8 key codes
    ks_ptr, kz_ptr,  # [NP, H, P / G, D] key scales and zero points
    vc_ptr,  # [NP, H, D, P * VBITS / 8] uint8 value codes (channel rows packed along tokens)
    vs_ptr, vz_ptr,  # [NP, H, D / G, P] value scales and zero points
    s_kn, s_kh, s_kt, s_vn, s_vh, s_vt,  # strides (elements) of k and v: group, head, token
    s_kcp, s_kch, s_kct,  # key codes: page, head, token row
    s_ksp, s_ksh, s_ksg,  # key scales (and zeros): page, head, group
    s_vcp, s_vch, s_vct,  # value codes: page, head, channel row
    s_vsp, s_vsh, s_vst,  # value scales (and zeros): page, head, channel group
    G: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,  # group, head_dim, code widths
    BUMP_K: tl.constexpr, BUMP_V: tl.constexpr,  # scales stored in a 16-bit dtype: round them up in it
    RECIP: tl.constexpr,  # divide by qmax as a multiply by its fp32 reciprocal (as torch on CUDA)
    SPLIT: tl.constexpr,  # keys and values in separate programs (grid axis 2)
    CLIP_K: tl.constexpr, CLIP_V: tl.constexpr,  # the clipping range search for the key / value groups
    PTX: tl.constexpr,  # not under the interpreter: the search's products by inline PTX (_mul_rn)
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)  # SPLIT: program 0 writes the keys, program 1 the values; else program 0 both
    page = tl.load(pages_ptr + n).to(tl.int64)
    slot = tl.load(slots_ptr + n).to(tl.int64)

    if part == 0:  # keys: per channel over the G tokens
        t = tl.arange(0, G)[:, None]
        x = tl.load(k_ptr + n.to(tl.int64) * s_kn + h * s_kh + t * s_kt + tl.arange(0, D)[None, :])
        scale, zero, codes = _quantize_axis(x.to(tl.float32), 0, (1 << KBITS) - 1, ks_ptr.dtype.element_ty,
                                            BUMP_K, RECIP, CLIP_K, PTX)
        ks_off = page * s_ksp + h * s_ksh + (slot // G) * s_ksg + tl.arange(0, D)
        tl.store(ks_ptr + ks_off, scale)
        tl.store(kz_ptr + ks_off, zero)
        _pack_store(codes, kc_ptr + page * s_kcp + h * s_kch, (slot + t) * s_kct, G, D, KBITS)

    if part == SPLIT:  # values: per token over groups of G channels; tile [G tokens, D // G groups, G channels]
        NGV: tl.constexpr = D // G
        t3 = tl.arange(0, G)[:, None, None]
        g3 = tl.arange(0, NGV)[None, :, None]
        y = tl.load(v_ptr + n.to(tl.int64) * s_vn + h * s_vh + t3 * s_vt + g3 * G + tl.arange(0, G)[None, None, :])
        vscale, vzero, vcodes = _quantize_axis(y.to(tl.float32), 2, (1 << VBITS) - 1, vs_ptr.dtype.element_ty,
                                               BUMP_V, RECIP, CLIP_V, PTX)
        t2 = tl.arange(0, G)[:, None]
        vs_off = page * s_vsp + h * s_vsh + (slot + t2) + tl.arange(0, NGV)[None, :] * s_vst  # [D // G, P] per page
        tl.store(vs_ptr + vs_off, vscale)
        tl.store(vz_ptr + vs_off, vzero)
        _pack_tokens_store(tl.reshape(vcodes, [G, D]), vc_ptr + page * s_vcp + h * s_vch, slot, s_vct, G, D, VBITS)


def _quant_tuning(t: _tuning.QuantTuning | None) -> _tuning.QuantTuning:
    """``t``, or the default's quantize settings (read at each call)."""
    t = _tuning.DEFAULT.quant if t is None else t
    if not isinstance(t, _tuning.QuantTuning):
        raise TypeError(f"tuning must be None or a kernels.tuning.QuantTuning, got {type(t).__name__}")
    return t


def quantize_and_write(k, v, pages, slots, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                       key_bits: int, value_bits: int, group_size: int, *,
                       tuning: _tuning.QuantTuning | None = None, clip_keys: bool = False,
                       clip_values: bool = False) -> None:
    """Triton twin of :func:`kivi_cache.reference.quantize_and_write` (same arguments, in place).

    k, v: ``[N, H, G, D]`` (last dim contiguous); pool tensors with a contiguous
    last dim (other strides are passed to the kernel), zero points strided as their scales. Checked as the reference
    (:func:`.checks.check_write`) and by :func:`kernels._util.check_pool_strides`. ``tuning`` (a
    :class:`~kivi_cache.kernels.tuning.QuantTuning`; None: ``tuning.DEFAULT.quant``): programs per group, warps,
    direct launches. ``clip_keys``/``clip_values``: the range search (module docstring) for the key / value groups.
    """
    t = _quant_tuning(tuning)
    pool = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    checks.check_write(k, v, pages, slots, pool, key_bits, value_bits, group_size)
    n, h, g, d = k.shape
    if n == 0:
        return
    check_settings(d, key_bits, value_bits, group_size, k_codes.shape[2])
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    check_pool_strides(pool)
    pages = pages.contiguous()
    slots = slots.contiguous()
    split = int(t.split)
    meta = dict(G=group_size, D=d, KBITS=key_bits, VBITS=value_bits,
                BUMP_K=k_scale.dtype != torch.float32, BUMP_V=v_scale.dtype != torch.float32,
                RECIP=k.device.type == "cuda", SPLIT=split, CLIP_K=bool(clip_keys), CLIP_V=bool(clip_values),
                PTX=not interpreting(), num_warps=t.warps)
    # everything that fixes the compiled kernel besides the pointers' alignment (kernels._util.Launcher; the tuning's
    # settings and the clip flags are in meta): the decode step's flushes then launch it directly (None: Triton's own
    # launch)
    key = (k.shape[1:], k.stride(), v.stride(), k.dtype, v.dtype, k.device, pages.dtype, slots.dtype, k_codes.shape,
           k_codes.stride(), k_scale.stride(), k_scale.dtype, k_zero.stride(), k_zero.dtype, v_codes.stride(),
           v_scale.stride(), v_scale.dtype, v_zero.stride(), v_zero.dtype, tuple(meta.items()))
    _QUANT(key if t.fast_launch else None, (n, h, 1 + split), (
        k, v, pages, slots,
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        v_codes.stride(0), v_codes.stride(1), v_codes.stride(2),
        v_scale.stride(0), v_scale.stride(1), v_scale.stride(2)), meta)


_QUANT = Launcher(_quantize_write_kernel)


# ----------------------------------------------------------------------------- append and flush (compiled decode step)


@triton.jit
def _append_flush_kernel(
    nk_ptr, nv_ptr,  # [B, H, D] the step's key and value
    rk_ptr, rv_ptr,  # [B, H, C, D] full-precision windows (sinks first)
    rlen_ptr,  # [B] int window tokens before the step
    sink_ptr,  # [B] int sink tokens held
    qlen_ptr,  # [B] int quantized tokens (in pages)
    bt_ptr,  # [B, bt_width] int block table
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,  # the pool, as _quantize_write_kernel's
    s_nkb, s_nkh, s_nvb, s_nvh,  # strides of the step's key / value: batch, head
    s_rkb, s_rkh, s_rkt, s_rvb, s_rvh, s_rvt,  # windows: batch, head, token
    s_btb, bt_width,  # block table: row stride, columns
    R, S, P,  # residual length, sink length, tokens per page
    s_kcp, s_kch, s_kct,
    s_ksp, s_ksh, s_ksg,
    s_vcp, s_vch, s_vct,
    s_vsp, s_vsh, s_vst,
    G: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    BUMP_K: tl.constexpr, BUMP_V: tl.constexpr, RECIP: tl.constexpr,
    CLIP_K: tl.constexpr, CLIP_V: tl.constexpr, PTX: tl.constexpr,
):
    """Program (b, h, part): part 0 the keys, 1 the values of sequence b, KV head h. Writes the step's token at
    ``rlen[b]``; if the window is then full (R + G tokens behind the sinks), quantizes its oldest group (the G tokens
    behind the sinks) into the sequence's page at ``qlen[b]`` and moves the R tokens after it G places down."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    part = tl.program_id(2)
    b64 = b.to(tl.int64)
    r = tl.load(rlen_ptr + b).to(tl.int32)
    s = tl.load(sink_ptr + b).to(tl.int32)
    s = tl.where(s < S, s + 1, s)  # a token arriving while the sinks are not all there is a sink
    q = tl.load(qlen_ptr + b).to(tl.int64)
    # a sequence whose table has no column for the group writes nothing (no live page overwritten): the caller
    # checks the column (checks.check_flush) or guarantees it (the static cache's max_cache_len)
    full = (r + 1 - s >= R + G) & (q // P < bt_width)
    d = tl.arange(0, D)
    if part == 0:
        src = nk_ptr + b64 * s_nkb + h * s_nkh
        win = rk_ptr + b64 * s_rkb + h * s_rkh
        s_t = s_rkt
    else:
        src = nv_ptr + b64 * s_nvb + h * s_nvh
        win = rv_ptr + b64 * s_rvb + h * s_rvh
        s_t = s_rvt
    tl.store(win + r * s_t + d, tl.load(src + d))
    if full:
        tl.debug_barrier()  # the token is in the window before any thread reads it (the group holds it when R = 0)
        page = tl.load(bt_ptr + b64 * s_btb + q // P).to(tl.int64)
        slot = q % P
        t = tl.arange(0, G)[:, None]
        if part == 0:  # keys: per channel over the G tokens
            x = tl.load(win + (s + t) * s_t + d[None, :])
            scale, zero, codes = _quantize_axis(x.to(tl.float32), 0, (1 << KBITS) - 1, ks_ptr.dtype.element_ty,
                                                BUMP_K, RECIP, CLIP_K, PTX)
            ks_off = page * s_ksp + h * s_ksh + (slot // G) * s_ksg + d
            tl.store(ks_ptr + ks_off, scale)
            tl.store(kz_ptr + ks_off, zero)
            _pack_store(codes, kc_ptr + page * s_kcp + h * s_kch, (slot + t) * s_kct, G, D, KBITS)
        else:  # values: per token over groups of G channels
            NGV: tl.constexpr = D // G
            t3 = tl.arange(0, G)[:, None, None]
            g3 = tl.arange(0, NGV)[None, :, None]
            y = tl.load(win + (s + t3) * s_t + g3 * G + tl.arange(0, G)[None, None, :])
            vscale, vzero, vcodes = _quantize_axis(y.to(tl.float32), 2, (1 << VBITS) - 1, vs_ptr.dtype.element_ty,
                                                   BUMP_V, RECIP, CLIP_V, PTX)
            vs_off = page * s_vsp + h * s_vsh + (slot + t) + tl.arange(0, NGV)[None, :] * s_vst
            tl.store(vs_ptr + vs_off, vscale)
            tl.store(vz_ptr + vs_off, vzero)
            _pack_tokens_store(tl.reshape(vcodes, [G, D]), vc_ptr + page * s_vcp + h * s_vch, slot, s_vct, G, D,
                               VBITS)
        # the R tokens after the group move G places down, G at a time in ascending order: a chunk's rows are
        # stored (after every thread has loaded them: the barrier) where only rows already read came from
        for c0 in range(0, R, G):
            rows = c0 + t
            m = rows < R
            chunk = tl.load(win + (s + G + rows) * s_t + d[None, :], mask=m)
            tl.debug_barrier()
            tl.store(win + (s + rows) * s_t + d[None, :], chunk, mask=m)


def append_and_flush(new_k, new_v, res_k, res_v, res_lengths, sink_lengths, lengths, block_table, k_codes, k_scale,
                     k_zero, v_codes, v_scale, v_zero, key_bits: int, value_bits: int, group_size: int,
                     residual_length: int, sink_length: int, *, tuning: _tuning.QuantTuning | None = None,
                     clip_keys: bool = False, clip_values: bool = False) -> None:
    """Triton twin of :func:`kivi_cache.reference.append_and_flush` (same arguments, in place): one launch, grid
    ``(B, H, 2)``; the lengths are read, never written. ``tuning``: as in :func:`quantize_and_write` (only its
    ``fast_launch`` applies: four warps, one program per keys or values); ``clip_keys``/``clip_values`` as there."""
    tun = _quant_tuning(tuning)
    checks.check_flush(new_k, new_v, res_k, res_v, res_lengths, sink_lengths, lengths, block_table,
                       (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), key_bits, value_bits, group_size,
                       residual_length, sink_length)
    bsz, h, cap, d = res_k.shape
    if bsz == 0:
        return
    check_settings(d, key_bits, value_bits, group_size, k_codes.shape[2])
    if new_k.dim() == 4:
        new_k, new_v = new_k.select(2, 0), new_v.select(2, 0)
    if tuple(new_k.shape) != (bsz, h, d) or tuple(new_v.shape) != (bsz, h, d):
        raise ValueError(f"new_k/new_v must be [B, H, D] = {[bsz, h, d]} (or [B, H, 1, D]); got "
                         f"{list(new_k.shape)} and {list(new_v.shape)}")
    if tuple(res_v.shape) != tuple(res_k.shape) or cap < sink_length + residual_length + group_size:
        raise ValueError(f"res_k/res_v must be [B, H, >= sink_length + residual_length + group_size, D]; got "
                         f"{list(res_k.shape)} and {list(res_v.shape)}")
    new_k = new_k if new_k.stride(-1) == 1 else new_k.contiguous()
    new_v = new_v if new_v.stride(-1) == 1 else new_v.contiguous()
    check_pool_strides((k_codes, k_scale, k_zero, v_codes, v_scale, v_zero))
    for t in (res_k, res_v, block_table):
        if t.stride(-1) != 1:
            raise ValueError("window and block-table tensors must have a contiguous last dimension")
    meta = dict(G=group_size, D=d, KBITS=key_bits, VBITS=value_bits,
                BUMP_K=k_scale.dtype != torch.float32, BUMP_V=v_scale.dtype != torch.float32,
                RECIP=res_k.device.type == "cuda", CLIP_K=bool(clip_keys), CLIP_V=bool(clip_values),
                PTX=not interpreting(), num_warps=4)
    key = (new_k.shape, new_k.stride(), new_v.stride(), new_k.dtype, res_k.shape, res_k.stride(), res_v.stride(),
           res_k.dtype, res_lengths.dtype, sink_lengths.dtype, lengths.dtype, block_table.shape, block_table.stride(),
           block_table.dtype, k_codes.shape, k_codes.stride(), k_scale.stride(), k_scale.dtype, k_zero.stride(),
           k_zero.dtype, v_codes.stride(), v_scale.stride(), v_scale.dtype, v_zero.stride(), v_zero.dtype,
           residual_length, sink_length, tuple(meta.items()))
    _APPEND(key if tun.fast_launch else None, (bsz, h, 2), (
        new_k, new_v, res_k, res_v, res_lengths, sink_lengths, lengths, block_table,
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), res_k.stride(0), res_k.stride(1),
        res_k.stride(2), res_v.stride(0), res_v.stride(1), res_v.stride(2), block_table.stride(0),
        block_table.shape[1], residual_length, sink_length, k_codes.shape[2],
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        v_codes.stride(0), v_codes.stride(1), v_codes.stride(2),
        v_scale.stride(0), v_scale.stride(1), v_scale.stride(2)), meta)


_APPEND = Launcher(_append_flush_kernel)

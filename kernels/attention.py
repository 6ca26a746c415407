"""Paged attention over the quantized pool: decode (split-K flash-decoding) and prefix.

Decode, ``paged_decode_attention``
----------------------------------
Kernel 1 (``_decode_split_kernel``), grid ``(B * Hkv, NS + 1)``. Program
``(b, h, s)`` holds all ``GROUP = Hq // Hkv`` query heads of KV head ``h`` as
one ``[GP, D]`` tile (``GP`` = GROUP padded to >= 16 for ``tl.dot``), so every
page is read once per KV head. For ``s < NS`` it walks its share of the
sequence's pages (``ceil(pages_b / NS)`` pages each, computed in-kernel from
``lengths[b]``: no host sync) one key group (G tokens) per step. Codes are
loaded as contiguous planar bytes, converted to fp16 with the magic-number
trick (no integer-to-float instructions) and dequantized elementwise with
scales broadcast in registers (keys: one [D] row per group; values: one value
per token and channel group); ``S = Q K^T`` takes one ``tl.dot`` per packed key
chunk and ``P V`` one per value sub-tile (its own accumulator), with an online
(exp2) softmax. Split ``s = NS`` handles the full-precision residual window
(attention sinks included) ``res_k/res_v[b, h, :res_lengths[b]]``. Each program
writes its partial ``(max, sum, acc)`` to an fp32 workspace ``[B * Hq, NS + 1, (D)]``.
Diagnostics (``_probe``, ``_prefetch``) are for ``eval/probe_decode.py``.

Kernel 2 (``_decode_reduce_kernel``), grid ``(B * Hq,)``, merges the
``NS + 1`` partials with the log-sum-exp rule and writes ``out`` in q's dtype.

NS is chosen from ``B * Hkv`` against the SM count and the block table's width
(an upper bound of every sequence's page count; keep it trimmed).

Prefix, ``paged_prefix_attention``
----------------------------------
Documented torch path: the quantized history is dequantized chunk by chunk
(a bounded number of pages at a time) with the Triton dequant kernel, each
chunk's attention computed in fp32 torch and merged with the log-sum-exp rule;
the residual window plus the new tokens form the last chunk.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ._util import block_tokens, check_bits, check_group, check_head_dim, interpreting, num_sms
from .dequant import dequantize_pages

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One online-softmax step over scores ``s`` [GP, N] (exp2 domain; masked entries are -inf).
    Returns the new running max and sum, the rescale factor for the accumulators, and p."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _acc_update(i: tl.constexpr, pv, alpha, a0, a1, a2, a3, a4, a5, a6, a7):
    """acc_i = acc_i * alpha + pv for value channel group i (compile-time i)."""
    if i == 0:
        a0 = a0 * alpha[:, None] + pv
    elif i == 1:
        a1 = a1 * alpha[:, None] + pv
    elif i == 2:
        a2 = a2 * alpha[:, None] + pv
    elif i == 3:
        a3 = a3 * alpha[:, None] + pv
    elif i == 4:
        a4 = a4 * alpha[:, None] + pv
    elif i == 5:
        a5 = a5 * alpha[:, None] + pv
    elif i == 6:
        a6 = a6 * alpha[:, None] + pv
    else:
        a7 = a7 * alpha[:, None] + pv
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _acc_get(i: tl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7):
    if i == 0:
        return a0
    elif i == 1:
        return a1
    elif i == 2:
        return a2
    elif i == 3:
        return a3
    elif i == 4:
        return a4
    elif i == 5:
        return a5
    elif i == 6:
        return a6
    else:
        return a7


@triton.jit
def _codes_to(c, DT: tl.constexpr, CODEC: tl.constexpr):
    """Small non-negative integer codes -> DT without integer-to-float conversion instructions
    (those run at a fraction of the FMA rate): OR the code into the mantissa of 1024.0 (fp16) or
    128.0 (bf16, codes < 128) and subtract the constant."""
    if CODEC == 1:
        return (c.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    elif CODEC == 2:
        return (c.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True) - 128.0
    else:
        return c.to(tl.float32).to(DT)


@triton.jit
def _decode_split_kernel(
    q_ptr, bt_ptr, len_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    rk_ptr, rv_ptr, rlen_ptr,
    m_ws, l_ws, o_ws,
    qk_scale, Hkv, NS,
    s_qb, s_qh, s_btb,
    s_kcp, s_kch, s_kct, s_ksp, s_ksh, s_ksg,
    s_vcp, s_vch, s_vct, s_vsp, s_vsh, s_vst,
    s_rkb, s_rkh, s_rkt, s_rvb, s_rvh, s_rvt,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, P: tl.constexpr, G: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    DOT_F32: tl.constexpr, PROBE: tl.constexpr, PREFETCH: tl.constexpr,
    KCODEC: tl.constexpr, VCODEC: tl.constexpr,
):
    """One key group (G tokens) per iteration, with the scales folded out of the tiles:

    keys:   q . (c * s + z) = (q * s) . c + q . z   -- s, z: one [D] row per group and channel
    values: sum_t p_t (c_td * s_tg + z_tg) = (p * s_g) @ c_g + p @ z_g  -- per channel group g

    so the code tiles are only converted to the dot dtype, never scaled element by element, and
    scales are loaded once per group (no broadcast loads). Planar packing: channel block k of a
    row is ``(byte >> k * bits) & mask``; a value channel group g lies in block g // (G per block)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // Hkv
    h = pid % Hkv
    b64 = b.to(tl.int64)
    if DOT_F32:
        DT: tl.constexpr = tl.float32
        PREC: tl.constexpr = "ieee"
    else:
        DT: tl.constexpr = q_ptr.dtype.element_ty
        PREC: tl.constexpr = "tf32"
    NK: tl.constexpr = 8 // KBITS
    NV: tl.constexpr = 8 // VBITS
    DK: tl.constexpr = D // NK
    DV: tl.constexpr = D // NV
    W: tl.constexpr = G if G < DV else DV  # value sub-tile width: inside one group and one packed block
    NW: tl.constexpr = D // W  # value sub-tiles (<= 8), one accumulator each
    KMASK: tl.constexpr = (1 << KBITS) - 1
    VMASK: tl.constexpr = (1 << VBITS) - 1
    offs_g = tl.arange(0, GP)
    hq = h * GROUP + offs_g
    gmask = offs_g < GROUP
    q_row = q_ptr + b64 * s_qb + hq[:, None] * s_qh

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    a0 = tl.zeros([GP, W], tl.float32)
    a1 = tl.zeros([GP, W], tl.float32)
    a2 = tl.zeros([GP, W], tl.float32)
    a3 = tl.zeros([GP, W], tl.float32)
    a4 = tl.zeros([GP, W], tl.float32)
    a5 = tl.zeros([GP, W], tl.float32)
    a6 = tl.zeros([GP, W], tl.float32)
    a7 = tl.zeros([GP, W], tl.float32)
    offs_dk = tl.arange(0, DK)
    offs_c = tl.arange(0, W)

    if split < NS:
        length = tl.load(len_ptr + b).to(tl.int32)
        npg = tl.cdiv(length, P)
        pps = tl.cdiv(npg, NS)
        t0 = split * pps * P
        t1 = tl.minimum(t0 + pps * P, length)
        kc_h = kc_ptr + h * s_kch
        ks_h = ks_ptr + h * s_ksh
        kz_h = kz_ptr + h * s_ksh
        vc_h = vc_ptr + h * s_vch
        vs_h = vs_ptr + h * s_vsh
        vz_h = vz_ptr + h * s_vsh
        offs_t = tl.arange(0, G)
        page_next = tl.load(bt_ptr + b64 * s_btb + t0 // P, mask=t0 < t1, other=0).to(tl.int64)
        for start in range(t0, t1, G):
            if PREFETCH:  # the next iteration's page id is loaded one iteration ahead
                page = page_next
                page_next = tl.load(bt_ptr + b64 * s_btb + (start + G) // P, mask=start + G < t1,
                                    other=0).to(tl.int64)
            else:
                page = tl.load(bt_ptr + b64 * s_btb + start // P).to(tl.int64)
            tp = start % P + offs_t  # token slots in the page
            tvalid = start + offs_t < t1  # the cache stores whole groups; the op accepts any length
            kraw = tl.load(kc_h + page * s_kcp + tp[:, None] * s_kct + offs_dk[None, :])
            srow = ks_h + page * s_ksp + (start % P) // G * s_ksg
            zrow = kz_h + page * s_ksp + (start % P) // G * s_ksg
            s = tl.zeros([GP, G], tl.float32)
            for k in tl.static_range(NK):
                cols = k * DK + offs_dk
                if PROBE == 1:  # diagnostics only: skip the scale and zero loads
                    ks = tl.full([DK], 1.0, DT)
                    kz = tl.zeros([DK], DT)
                else:
                    ks = tl.load(srow + cols).to(DT)
                    kz = tl.load(zrow + cols).to(DT)
                qk = tl.load(q_row + cols[None, :], mask=gmask[:, None], other=0.0).to(DT)
                kk = _codes_to((kraw >> (k * KBITS)) & KMASK, DT, KCODEC) * ks[None, :] + kz[None, :]
                s += tl.dot(qk, tl.trans(kk.to(DT)), input_precision=PREC)
            s = tl.where(tvalid[None, :], s * qk_scale, float("-inf"))
            m_i, l_i, alpha, p = _online_softmax(s, m_i, l_i)
            pd = p.to(DT)
            vrow = vc_h + page * s_vcp + tp[:, None] * s_vct
            svrow = page * s_vsp + tp * s_vst
            for gi in tl.static_range(NW if PROBE != 2 else 0):  # PROBE 2 (diagnostics): keys only
                blk_v = gi * W // DV  # packed block holding this sub-tile
                byte0 = gi * W - blk_v * DV
                grp = gi * W // G  # its value group
                vraw = tl.load(vrow + (byte0 + offs_c)[None, :])
                codes = _codes_to((vraw >> (blk_v * VBITS)) & VMASK, DT, VCODEC)
                if PROBE == 1:
                    vs = tl.where(tvalid, 1.0, 0.0).to(DT)
                    vz = tl.zeros([G], DT)
                else:
                    vs = tl.load(vs_h + svrow + grp, mask=tvalid, other=0.0).to(DT)
                    vz = tl.load(vz_h + svrow + grp, mask=tvalid, other=0.0).to(DT)
                vv = codes * vs[:, None] + vz[:, None]  # per-token scales broadcast over the channels
                pv = tl.dot(pd, vv.to(DT), input_precision=PREC)
                a0, a1, a2, a3, a4, a5, a6, a7 = _acc_update(gi, pv, alpha, a0, a1, a2, a3, a4, a5, a6, a7)
    else:
        rlen = tl.load(rlen_ptr + b).to(tl.int32)
        rk_b = rk_ptr + b64 * s_rkb + h * s_rkh
        rv_b = rv_ptr + b64 * s_rvb + h * s_rvh
        offs_d = tl.arange(0, D)
        q = tl.load(q_row + offs_d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32).to(DT)
        for start in range(0, rlen, BLOCK_R):
            tok = start + tl.arange(0, BLOCK_R)
            tvalid = tok < rlen
            kk = tl.load(rk_b + tok[:, None] * s_rkt + offs_d[None, :], mask=tvalid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kk.to(tl.float32).to(DT)), input_precision=PREC) * qk_scale
            s = tl.where(tvalid[None, :], s, float("-inf"))
            m_i, l_i, alpha, p = _online_softmax(s, m_i, l_i)
            pd = p.to(DT)
            for gi in tl.static_range(NW):
                cols = gi * W + offs_c
                vv = tl.load(rv_b + tok[:, None] * s_rvt + cols[None, :], mask=tvalid[:, None], other=0.0)
                pv = tl.dot(pd, vv.to(tl.float32).to(DT), input_precision=PREC)
                a0, a1, a2, a3, a4, a5, a6, a7 = _acc_update(gi, pv, alpha, a0, a1, a2, a3, a4, a5, a6, a7)

    row = (b64 * Hkv + h) * GROUP + offs_g  # flat (b, hq)
    ws = row * (NS + 1) + split
    tl.store(m_ws + ws, m_i, mask=gmask)
    tl.store(l_ws + ws, l_i, mask=gmask)
    for gi in tl.static_range(NW):
        acc = _acc_get(gi, a0, a1, a2, a3, a4, a5, a6, a7)
        tl.store(o_ws + ws[:, None] * D + (gi * W + offs_c)[None, :], acc, mask=gmask[:, None])


@triton.jit
def _decode_reduce_kernel(m_ws, l_ws, o_ws, out_ptr, NSP1, s_ob, s_oh, Hq,
                          D: tl.constexpr, BS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = row // Hq
    hq = row % Hq
    offs_d = tl.arange(0, D)
    m_run = tl.full([1], float("-inf"), tl.float32)
    l_run = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, NSP1, BS):
        offs = s0 + tl.arange(0, BS)
        ok = offs < NSP1
        m = tl.load(m_ws + row * NSP1 + offs, mask=ok, other=float("-inf"))
        l = tl.load(l_ws + row * NSP1 + offs, mask=ok, other=0.0)
        o = tl.load(o_ws + (row * NSP1 + offs)[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m_run - m_safe)
        w = tl.exp2(m - m_safe)
        l_run = l_run * a + tl.sum(w * l, axis=0)
        acc = acc * a + tl.sum(w[:, None] * o, axis=0)
        m_run = m_new
    denom = tl.where(l_run > 0, l_run, 1.0)
    res = acc / denom
    tl.store(out_ptr + b * s_ob + hq * s_oh + offs_d, res.to(out_ptr.dtype.element_ty))


def _codec(dtype, bits: int, dot_f32: bool) -> int:
    """How _codes_to converts codes: 1 fp16 magic number, 2 bf16 magic number (codes < 128), 0 plain."""
    if dot_f32:
        return 0
    if dtype == torch.float16:
        return 1
    # CODEC 2 (bf16 magic number) is implemented but not yet verified on a GPU (the interpreter's
    # bf16 arithmetic is wrong, so no CPU test covers it): bf16 uses the plain conversion for now.
    return 0


def _pick_splits(bsz: int, hkv: int, width_tokens: int, device) -> int:
    if interpreting() or device.type != "cuda":
        return max(1, min(2, width_tokens // 64))
    target = num_sms(device) * 8  # programs to keep every SM busy with several resident blocks
    by_fill = triton.cdiv(target, max(1, bsz * hkv))
    by_len = triton.cdiv(width_tokens, 512)  # at least ~512 tokens of work per split
    return max(1, min(by_fill, by_len, 1024))


def _check_common(q_dim, k_codes, k_scale, key_bits, value_bits, group_size):
    d = k_scale.shape[-1]
    if q_dim != d:
        raise ValueError(f"q head_dim={q_dim} does not match the pool's head_dim={d}")
    check_head_dim(d)
    check_bits(key_bits, value_bits)
    check_group(d, group_size, k_codes.shape[2])
    for t in (k_codes, k_scale):
        if t.stride(-1) != 1:
            raise ValueError("pool tensors must have a contiguous last dimension")


def paged_decode_attention(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                           res_k, res_v, res_lengths, key_bits: int, value_bits: int, group_size: int,
                           sm_scale: float, *, num_splits: int | None = None, out=None, _probe: int = 0,
                           _prefetch: bool | None = None, _force_half_dot: bool = False):
    """Triton twin of :func:`kivi_cache.reference.paged_decode_attention`.

    q ``[B, Hq, D]``; returns ``[B, Hq, D]`` in q's dtype. ``num_splits``
    overrides the automatic context split (for tests/benchmarks); ``out``
    (``[B, Hq, D]``, q's dtype, last dim contiguous) is written in place if given.
    """
    bsz, hq, d = q.shape
    _check_common(d, k_codes, k_scale, key_bits, value_bits, group_size)
    np_, hkv, p, _ = k_codes.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if out is None:
        out = torch.empty(bsz, hq, d, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (bsz, hq, d) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must be [B, Hq, D] in q's dtype with a contiguous last dimension")
    if bsz == 0 or hq == 0:
        return out
    group = hq // hkv
    sub = min(group_size, d * value_bits // 8)
    if d // sub > 8 or sub < 16 or d * key_bits // 8 < 16:
        raise ValueError(f"decode kernel needs value sub-tiles min(group_size, head_dim*value_bits/8) >= 16 "
                         f"and <= 8 of them per head; got group_size={group_size}, head_dim={d}, "
                         f"bits={key_bits}/{value_bits}")
    gp = max(16, triton.next_power_of_2(group))
    if q.stride(-1) != 1:
        q = q.contiguous()
    if res_k.stride(-1) != 1:
        res_k = res_k.contiguous()
    if res_v.stride(-1) != 1:
        res_v = res_v.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    lengths = lengths.contiguous()
    res_lengths = res_lengths.contiguous()
    interp = interpreting()
    ns = num_splits or _pick_splits(bsz, hkv, block_table.shape[1] * p, q.device)
    blk = block_tokens(p, group_size, 256 if interp else int(os.environ.get("KIVI_DECODE_BLOCK", 64 if d <= 128 else 32)))
    blk_r = 64 if interp else (32 if d <= 128 else 16)
    ws_m = torch.empty(bsz * hq, ns + 1, dtype=torch.float32, device=q.device)
    ws_l = torch.empty_like(ws_m)
    ws_o = torch.empty(bsz * hq, ns + 1, d, dtype=torch.float32, device=q.device)
    dot_f32 = (interp and not _force_half_dot) or q.dtype == torch.float32
    _decode_split_kernel[(bsz * hkv, ns + 1)](
        q, block_table, lengths,
        k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
        res_k, res_v, res_lengths,
        ws_m, ws_l, ws_o,
        float(sm_scale) * LOG2E, hkv, ns,
        q.stride(0), q.stride(1), block_table.stride(0),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        v_codes.stride(0), v_codes.stride(1), v_codes.stride(2),
        v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
        res_k.stride(0), res_k.stride(1), res_k.stride(2),
        res_v.stride(0), res_v.stride(1), res_v.stride(2),
        GROUP=group, GP=gp, D=d, P=p, G=group_size, BLOCK=blk, BLOCK_R=blk_r,
        KBITS=key_bits, VBITS=value_bits, DOT_F32=dot_f32, PROBE=_probe,
        KCODEC=_codec(q.dtype, key_bits, dot_f32), VCODEC=_codec(q.dtype, value_bits, dot_f32),
        PREFETCH=bool(int(os.environ.get("KIVI_DECODE_PREFETCH", 0))) if _prefetch is None else _prefetch,
        num_warps=int(os.environ.get("KIVI_DECODE_WARPS", 4)),
        num_stages=1 if interp else int(os.environ.get("KIVI_DECODE_STAGES", 3)),
    )
    bs = min(triton.next_power_of_2(ns + 1), 32)
    _decode_reduce_kernel[(bsz * hq,)](
        ws_m, ws_l, ws_o, out, ns + 1, out.stride(0), out.stride(1), hq,
        D=d, BS=bs, num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------- prefix

def _partial(qf, k, v, valid, sm_scale):
    """qf [B, Hkv, grp, L, D] fp32; k/v [B, Hkv, S, D]; valid [B, 1|L, S] ->
    (m, l) [B, Hkv, grp, L] and acc [B, Hkv, grp, L, D] (unnormalised)."""
    kf = k.float()
    s = torch.einsum("bhgld,bhsd->bhgls", qf, kf) * sm_scale
    s = s.masked_fill(~valid[:, None, None], float("-inf"))
    m = s.amax(-1)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe[..., None])
    return m, p.sum(-1), torch.einsum("bhgls,bhsd->bhgld", p, v.float())


def _merge(state, part):
    if state is None:
        return part
    m0, l0, a0 = state
    m1, l1, a1 = part
    m = torch.maximum(m0, m1)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w0 = torch.exp(m0 - m_safe)
    w1 = torch.exp(m1 - m_safe)
    return m, l0 * w0 + l1 * w1, a0 * w0[..., None] + a1 * w1[..., None]


def paged_prefix_attention(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                           res_k, res_v, res_lengths, new_k, new_v, new_mask, key_bits: int, value_bits: int,
                           group_size: int, sm_scale: float, *, chunk_tokens: int | None = None):
    """Triton-assisted twin of :func:`kivi_cache.reference.paged_prefix_attention`.

    The quantized history is dequantized ``chunk_tokens`` (a multiple of the
    page size) at a time by the Triton dequant kernel into a bounded buffer and
    attended in fp32 torch; partial results merge by log-sum-exp. One device
    sync (``lengths.max()``).
    """
    bsz, hq, ql, d = q.shape
    _check_common(d, k_codes, k_scale, key_bits, value_bits, group_size)
    _, hkv, p, _ = k_codes.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    grp = hq // hkv
    qf = q.float().reshape(bsz, hkv, grp, ql, d)
    if chunk_tokens is None:
        by_buf = (1 << 24) // max(1, bsz * hkv * d)  # dequant buffer <= 16M elements
        by_scores = (1 << 26) // max(1, bsz * hq * ql)  # scores <= 64M elements
        chunk_tokens = max(p, min(by_buf, by_scores) // p * p)
    chunk_pages = max(1, chunk_tokens // p)
    lengths_l = lengths.long()
    t_max = int(lengths_l.max()) if bsz else 0
    state = None
    for p0 in range(0, -(-t_max // p), chunk_pages):
        p1 = p0 + chunk_pages
        lens_c = (lengths_l - p0 * p).clamp(0, chunk_pages * p)
        bt_c = block_table[:, p0:p1]
        kk, vv = dequantize_pages(bt_c, lens_c, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                  key_bits, value_bits, group_size, max_len=bt_c.shape[1] * p)
        kk = kk.to(res_k.dtype)
        vv = vv.to(res_v.dtype)
        pos = torch.arange(kk.shape[2], device=q.device)
        valid = (pos[None, :] < lens_c[:, None])[:, None, :]
        state = _merge(state, _partial(qf, kk, vv, valid, sm_scale))
    c = res_k.shape[2]
    pos = torch.arange(c, device=q.device)
    rvalid = (pos[None, :] < res_lengths.long()[:, None])[:, None, :].expand(-1, ql, -1)
    k_last = torch.cat([res_k, new_k.to(res_k.dtype)], dim=2)
    v_last = torch.cat([res_v, new_v.to(res_v.dtype)], dim=2)
    valid = torch.cat([rvalid, new_mask.bool()], dim=2)
    m, l, acc = _merge(state, _partial(qf, k_last, v_last, valid, sm_scale))
    out = acc / l[..., None]
    return out.reshape(bsz, hq, ql, d).to(q.dtype)

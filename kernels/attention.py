"""Paged attention over the quantized pool: decode (split-K flash-decoding) and prefix.

Decode, ``paged_decode_attention``
----------------------------------
Kernel 1 (``_decode_split_kernel``), grid ``(B * Hkv, NS + NR)``, one warp per
program. Program ``(b, h, s)`` holds all ``GROUP = Hq // Hkv`` query heads of KV
head ``h``, so every page is read once per KV head. The MMAs are transposed so
that tokens and channels fill the 16-row side and the query heads the narrow
side: ``S^T = K q^T`` (``[G, GP]``) and ``acc^T += V^T P^T`` (``[W, GP]``), GP =
GROUP rounded up to a power of two (no padding to 16 rows). For ``s < NS`` the
program walks its share of the sequence's pages (``ceil(pages_b / NS)`` pages,
computed in-kernel from ``lengths[b]``: no host sync) one key group (G tokens) per
step. Codes are loaded as int32 words and dequantized in registers by
:mod:`.unpack` (inline PTX on the GPU: prmt/shift/lop3 into the mantissa of 1.0
and one packed fma with folded scales, ~1.75 instructions per code); keys give one
``[G, D/planes]`` tile per bit plane (token rows). Values are stored as channel rows
packed along tokens (:mod:`kivi_cache.quant`): a sub-tile of ``W = min(G, 32)``
channels (one value group, one accumulator each) gives one ``V^T`` tile
``[W, step / planes]`` per bit plane whose registers already hold the pairs of
consecutive tokens the MMA operand needs (ODD pairs of a word: bytes ``q, q + 2``),
so no tile is transposed through shared memory; each plane's MMA takes the rows
of ``P^T`` of its tokens (``plane_rows``), and the value scales of two tokens
come as one int32 load. Online softmax in the exp2 domain. Splits ``s = NS + c`` handle
chunk c of the full-precision residual window (attention sinks included)
``res_k/res_v[b, h, :res_lengths[b]]``: slots ``[c RCH, (c + 1) RCH)`` (``window_chunk``: the whole window in one
program, or 64-slot chunks where the pairs are few and the chunks leave the paged splits unchanged).
SASS-count details (``eval/sass_decode.py``, ``eval/SASS_CANDIDATES.md``): key pairs for 64-token groups hold
channels ``(4w + p, 4w + p + 2)`` ("ODD", one shift of the word instead of byte shuffles; q rows in
that order, ``_qrows``); whole steps run in an unmasked copy of the loop. Each
program writes its partial ``(max, sum, acc)`` to an fp32 workspace
``[B * Hq, NS + NR, (D)]``. Registers are capped (``maxnreg`` 128) only for 32-token steps; the
paged loop is software-pipelined 5 deep, the residual loop not at all (``_stages``: at fewer stages the
loop waited for every copy each step). ``_plain`` (no inline PTX) is for tests and ``eval/sweep_decode.py``.

Kernel 2 (``_decode_reduce_kernel``, launched by ``decode_reduce``), grid ``(B * Hq, D / 32)``, merges the
``NS + NR`` partials with the log-sum-exp rule and writes ``out`` in q's dtype.

NS is chosen from ``B * Hkv`` against the SM count and the block table's width
(an upper bound of every sequence's page count; keep it trimmed).

Prefix, ``paged_prefix_attention``
----------------------------------
Documented torch path, a batch slice at a time (bounded memory): the slice's
pages are dequantized by the Triton dequant kernel into one buffer with the
residual window and the new tokens, then one fused
``scaled_dot_product_attention`` call with the query heads of each KV head
stacked on the query axis.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import checks
from . import tuning as _tuning
from ._util import (
    Launcher,
    block_tokens,
    check_pool_strides,
    check_settings,
    interpreting,
    no_launch_hooks,
    num_sms,
)
from .dequant import dequantize_pages
from .sinks import SINK_CHANNELS, sink_channels
from .unpack import (
    EXACT,
    FOLD_E,
    fold_pairs_asm,
    fold_scale,
    join_planes2,
    join_planes4,
    odd_pairs_asm,
    pack2,
    pack_channel_pairs,
    pair_emulated,
    pairs_asm,
    plane,
    plane_emulated,
    plane_plain,
    plane_rows,
    plane_token_tile,
    token_plane_plain,
    unpack_half,
)

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax(s, m_i, l_i, qk_scale):
    """One online-softmax step over transposed raw scores ``s`` [N tokens, GP heads] (masked entries are
    -inf); ``qk_scale`` > 0 takes them to the exp2 domain, where the running max ``m_i`` lives. The scale
    is applied to the column max (max commutes with it) and inside one fma per score, ``s * qk_scale -
    m``, not by a separate multiply. Returns the new running max and sum, the accumulators' rescale
    factor, and p."""
    m_new = tl.maximum(m_i, tl.max(s, axis=0) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[None, :])
    return m_new, l_i * alpha + tl.sum(p, axis=0), alpha, p


@triton.jit
def _acc_update(i: tl.constexpr, pv, alpha, a0, a1, a2, a3, a4, a5, a6, a7):
    """acc_i = acc_i * alpha + pv for value sub-tile i (compile-time i); accumulators are [W, GP]."""
    if i == 0:
        a0 = a0 * alpha[None, :] + pv
    elif i == 1:
        a1 = a1 * alpha[None, :] + pv
    elif i == 2:
        a2 = a2 * alpha[None, :] + pv
    elif i == 3:
        a3 = a3 * alpha[None, :] + pv
    elif i == 4:
        a4 = a4 * alpha[None, :] + pv
    elif i == 5:
        a5 = a5 * alpha[None, :] + pv
    elif i == 6:
        a6 = a6 * alpha[None, :] + pv
    else:
        a7 = a7 * alpha[None, :] + pv
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
def _pick4(i: tl.constexpr, x0, x1, x2, x3):
    if i == 0:
        return x0
    elif i == 1:
        return x1
    elif i == 2:
        return x2
    else:
        return x3


@triton.jit
def _qrows(q, ODD: tl.constexpr):
    """q^T rows [DK, GP] in the key planes' channel order with ODD pairs when ``ODD``: row
    4w + 2b + a holds channel 4w + 2a + b (a view: reshape and permute)."""
    if ODD:
        q = tl.reshape(tl.permute(tl.reshape(q, [q.shape[0] // 4, 2, 2, q.shape[1]]), (0, 2, 1, 3)), q.shape)
    return q


@triton.jit
def _rows(x, G: tl.constexpr):
    """[GPS, W] per-group values -> [GPS * G, W], each group's row repeated for its G tokens."""
    return tl.reshape(tl.broadcast_to(x[:, None, :], [x.shape[0], G, x.shape[1]]), [x.shape[0] * G, x.shape[1]])


@triton.jit
def _fold_key_words(sw, zw, k: tl.constexpr, DK: tl.constexpr, G: tl.constexpr, BF16: tl.constexpr,
                    ODD: tl.constexpr, FK: tl.constexpr):
    """_key_pairs' ASM half: plane k's scale and zero words ``sw``/``zw`` ([GPS, DK/2] int32, pair p of word w at
    2w + p) folded by PTX into (s pair 0, s pair 1, z pair 0, z pair 1), each [GPS * G, DK/4]."""
    E0: tl.constexpr = FOLD_E[(FK * 8 + k) * 2]
    E1: tl.constexpr = FOLD_E[(FK * 8 + k) * 2 + 1]
    if E0 == E1:
        sf, zf = fold_pairs_asm(sw, zw, E0, BF16)
        s0, s1 = tl.split(tl.reshape(sf, [sf.shape[0], DK // 4, 2]))
        z0, z1 = tl.split(tl.reshape(zf, [zf.shape[0], DK // 4, 2]))
        if ODD:
            s0, s1 = odd_pairs_asm(s0, s1)
            z0, z1 = odd_pairs_asm(z0, z1)
    else:  # ODD: the pairs first, then each folded with its own power of two
        s0, s1 = odd_pairs_asm(*tl.split(tl.reshape(sw, [sw.shape[0], DK // 4, 2])))
        z0, z1 = odd_pairs_asm(*tl.split(tl.reshape(zw, [zw.shape[0], DK // 4, 2])))
        s0, z0 = fold_pairs_asm(s0, z0, E0, BF16)
        s1, z1 = fold_pairs_asm(s1, z1, E1, BF16)
    return _rows(s0, G), _rows(s1, G), _rows(z0, G), _rows(z1, G)


@triton.jit
def _key_words(srow, zrow, D: tl.constexpr):
    """The step's key scale and zero words of every key plane (``KSZ``) in one load of a [2, GPS, D/2] int32 tile
    (16-byte copies over the whole warp at head_dim 64): (sw, zw), each [GPS, D/2], plane k of NK = words
    k D/(2 NK) .. (k+1) D/(2 NK) - 1."""
    sel = tl.arange(0, 2)[:, None, None]
    rows = tl.where(sel == 0, srow.to(tl.pointer_type(tl.int32), bitcast=True)[None, :, None],
                    zrow.to(tl.pointer_type(tl.int32), bitcast=True)[None, :, None])
    w = tl.load(rows + tl.arange(0, D // 2)[None, None, :])  # [2, GPS, D/2]
    return tl.split(tl.permute(w, (1, 2, 0)))


@triton.jit
def _key_words4(srow, zrow, D: tl.constexpr):
    """_key_words split in registers into the four planes of 2-bit keys: (sw, zw) of plane 0, ..., plane 3, each
    [GPS, D/8]."""
    sw, zw = _key_words(srow, zrow, D)
    sw = tl.permute(tl.reshape(sw, [sw.shape[0], 2, 2, D // 8]), (0, 3, 1, 2))  # [GPS, D/8, hi, lo]: plane 2hi + lo
    zw = tl.permute(tl.reshape(zw, [zw.shape[0], 2, 2, D // 8]), (0, 3, 1, 2))
    s_lo0, s_lo1 = tl.split(sw)
    z_lo0, z_lo1 = tl.split(zw)
    s0, s2 = tl.split(s_lo0)
    s1, s3 = tl.split(s_lo1)
    z0, z2 = tl.split(z_lo0)
    z1, z3 = tl.split(z_lo1)
    return s0, z0, s1, z1, s2, z2, s3, z3


@triton.jit
def _key_words2(srow, zrow, D: tl.constexpr):
    """_key_words split in registers into the two planes of 4-bit keys: (sw, zw) of plane 0, plane 1, each
    [GPS, D/4]."""
    sw, zw = _key_words(srow, zrow, D)
    s0, s1 = tl.split(tl.permute(tl.reshape(sw, [sw.shape[0], 2, D // 4]), (0, 2, 1)))
    z0, z1 = tl.split(tl.permute(tl.reshape(zw, [zw.shape[0], 2, D // 4]), (0, 2, 1)))
    return s0, z0, s1, z1


@triton.jit
def _key_pairs(srow, zrow, kcols, k: tl.constexpr, DK: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
               DT: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr, ODD: tl.constexpr, FK: tl.constexpr):
    """Folded, pair-packed key scales of plane k for the step's groups (``srow``/``zrow``: [GPS] row
    pointers): (s pair 0, s pair 1, z pair 0, z pair 1), each [GPS * G, DK/4] int32 (one row per token);
    with ``ODD`` pairs of channels (4w + p, 4w + p + 2), as ``pairs_asm(..., ODD=True)`` makes the codes.
    With ``ASM`` (GPU) the pairs are loaded as int32 (the pools viewed as int32) and folded by PTX in
    packed half2 arithmetic, with no repacking; else folded in Triton and packed. Zero points are folded with
    ``fold_exp`` of each pair (the same for both pairs unless ``ODD`` and a code is read in place; ``FK``: the
    keys' ``unpack.fold_key``)."""
    if ASM:
        offs = (k * (DK // 2) + tl.arange(0, DK // 2))[None, :]  # int32 pairs of plane k: word w, pair p at 2w + p
        sw = tl.load(srow.to(tl.pointer_type(tl.int32), bitcast=True)[:, None] + offs)
        zw = tl.load(zrow.to(tl.pointer_type(tl.int32), bitcast=True)[:, None] + offs)
        r0, r1, r2, r3 = _fold_key_words(sw, zw, k, DK, G, BF16, ODD, FK)
    else:
        E0: tl.constexpr = FOLD_E[(FK * 8 + k) * 2]
        E1: tl.constexpr = FOLD_E[(FK * 8 + k) * 2 + 1]
        sl = tl.load(srow[:, None, None] + k * DK + kcols[None])
        zl = tl.load(zrow[:, None, None] + k * DK + kcols[None])
        sf, zf = fold_scale(sl, zl, E0, DT)
        if E0 != E1:  # channel 4w + b is in pair b % 2 (ODD)
            zf = tl.where((kcols % 2 == 0)[None], zf, fold_scale(sl, zl, E1, DT)[1])
        s0, s1 = pack_channel_pairs(sf, DT, ODD)
        z0, z1 = pack_channel_pairs(zf, DT, ODD)
        r0, r1, r2, r3 = _rows(s0, G), _rows(s1, G), _rows(z0, G), _rows(z1, G)
    return r0, r1, r2, r3


@triton.jit
def _pair_columns(p, WD: tl.constexpr, NV: tl.constexpr):
    """One load of a step's scale pairs of one value group (``p``: int32, two tokens' scales each; pair i = 2k + q
    of word w at 2 NV w + i, the pairs of plane k, ODD pair q of ``pairs_asm``) -> the columns (k, q) as [1, WD]
    tiles, ordered (0, 0), (0, 1), (1, 0), ... (3, 1) (planes past NV repeat plane 0 and 1)."""
    x = tl.load(p + tl.arange(0, WD * 2 * NV))
    if NV == 1:
        c00, c01 = tl.split(tl.reshape(x, [WD, 2]))
        c10, c11, c20, c21, c30, c31 = c00, c01, c00, c01, c00, c01
    elif NV == 2:
        q0, q1 = tl.split(tl.reshape(x, [WD, 2, 2]))  # [w, k, q] -> q
        c00, c10 = tl.split(q0)
        c01, c11 = tl.split(q1)
        c20, c21, c30, c31 = c00, c01, c10, c11
    else:
        q0, q1 = tl.split(tl.reshape(x, [WD, 2, 2, 2]))  # [w, k1, k0, q], k = 2 k1 + k0
        a0, b0 = tl.split(q0)  # k0 = 0, 1: [w, k1]
        a1, b1 = tl.split(q1)
        c00, c20 = tl.split(a0)
        c10, c30 = tl.split(b0)
        c01, c21 = tl.split(a1)
        c11, c31 = tl.split(b1)
    return (c00[None, :], c01[None, :], c10[None, :], c11[None, :], c20[None, :], c21[None, :], c30[None, :],
            c31[None, :])


@triton.jit
def _fold_pair(s, z, E: tl.constexpr, DT: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr):
    """A pair of two tokens' scales and zeros (int32 tiles) -> (s pair, z pair folded with ``2**E``), the fma
    operands of ``pairs_asm``: one packed fma on the GPU, else unpacked, folded in DT and packed again."""
    if ASM:
        return fold_pairs_asm(s, z, E, BF16)
    s_lo, s_hi = unpack_half(s, DT)
    z_lo, z_hi = unpack_half(z, DT)
    a, b = fold_scale(s_lo, z_lo, E, DT)
    c, d = fold_scale(s_hi, z_hi, E, DT)
    return pack2(a, c), pack2(b, d)


@triton.jit
def _decode_split_kernel(
    q_ptr, bt_ptr, len_ptr,
    kw_ptr, ks_ptr, kz_ptr, vw_ptr, vs_ptr, vz_ptr,
    rk_ptr, rv_ptr, rlen_ptr,
    m_ws, l_ws, o_ws,
    nk_ptr, nv_ptr, out_ptr, cnt_ptr, sink_ptr,
    qk_scale, Hkv, NS, RCH, SWIN,
    s_qb, s_qh, s_btb,
    s_kcp, s_kch, s_ksp, s_ksh, s_ksg,
    s_vcp, s_vch, s_vsp, s_vsh,
    s_rkb, s_rkh, s_rkt, s_rvb, s_rvh, s_rvt,
    s_nkb, s_nkh, s_nvb, s_nvh, s_ob, s_oh,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, P: tl.constexpr, G: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    DOT_F32: tl.constexpr, KASM: tl.constexpr, VASM: tl.constexpr, BF16: tl.constexpr,
    PSTAGES: tl.constexpr, RSTAGES: tl.constexpr,  # pipeline depths: from _stages() (its env and defaults)
    NEWKV: tl.constexpr = 0,  # the window's newest token (rlen - 1) is first written from nk/nv (the op's new_k/v)
    MERGE: tl.constexpr = 0,  # the last program of a (sequence, KV head) merges the partials into out (no 2nd kernel)
    BM: tl.constexpr = 1,  # MERGE: next power of two of the programs per pair (NS + window chunks)
    BSM: tl.constexpr = 1,  # MERGE: partials per merge step
    VHINT: tl.constexpr = 0,  # the value words' offset declared a multiple of a step's words (_vhint)
    KSZ: tl.constexpr = 0,  # 2/4-bit keys: every plane's scale and zero words in one load (_ksz)
    SRCMIN: tl.constexpr = EXACT,  # codes read in place from this mantissa bit up (unpack.field; EXACT: top only)
    SLIDING: tl.constexpr = 0,  # sliding-window attention: only the last SWIN stored tokens are seen
    SINK: tl.constexpr = 0,  # MERGE: learned attention sinks, one logit per query head at sink_ptr (natural log)
):
    """One key group (G tokens) per iteration. Codes are loaded as int32 words ``[G, words]``
    (``kw_ptr``/``vw_ptr`` are int32 views of the code pools, strides in words) and dequantized in
    registers by :mod:`.unpack` into one tile per channel plane: keys ``NK`` planes of ``DK``
    channels (``S = sum_k Q_k K_k^T``), values in sub-tiles of ``W = min(G, DV)`` channels, one
    accumulator each (``acc_i += P V_i``), so every value sub-tile lies inside one value group and
    one plane and its per-token scales broadcast from a ``[G, 1, 1]`` tile."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // Hkv
    h = pid % Hkv
    b64 = b.to(tl.int64)
    if DOT_F32:
        DT: tl.constexpr = tl.float32
        PREC: tl.constexpr = "ieee"
        HALF: tl.constexpr = False
    else:
        DT: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
        PREC: tl.constexpr = "tf32"
        HALF: tl.constexpr = True
    NK: tl.constexpr = 8 // KBITS
    NV: tl.constexpr = 8 // VBITS
    DK: tl.constexpr = D // NK  # channels per key plane = bytes per key row
    W: tl.constexpr = G if G < 32 else 32  # value sub-tile: W channels inside one value group (32: registers)
    NW: tl.constexpr = D // W  # value sub-tiles (<= 8), one accumulator each
    TW: tl.constexpr = 32 // VBITS  # tokens per 32-bit word of a value row
    # Key codes as ODD pairs (no byte shuffles; q's rows and the key scale pairs follow): the scale pairs
    # then cost two prmt per pair, once per key group and lane, which pays off from 64-token groups.
    KODD: tl.constexpr = HALF and G >= 64
    KFK: tl.constexpr = ((KBITS * 2 + BF16) * 2 + KODD) * 32 + SRCMIN  # unpack.fold_key of the key / value unpack
    VFK: tl.constexpr = ((VBITS * 2 + BF16) * 2 + 1) * 32 + SRCMIN
    offs_g = tl.arange(0, GP)
    hq = h * GROUP + offs_g
    gmask = offs_g < GROUP
    q_col = q_ptr + b64 * s_qb + hq[None, :] * s_qh  # q^T: [channels, GP]

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    a0 = tl.zeros([W, GP], tl.float32)
    a1 = tl.zeros([W, GP], tl.float32)
    a2 = tl.zeros([W, GP], tl.float32)
    a3 = tl.zeros([W, GP], tl.float32)
    a4 = tl.zeros([W, GP], tl.float32)
    a5 = tl.zeros([W, GP], tl.float32)
    a6 = tl.zeros([W, GP], tl.float32)
    a7 = tl.zeros([W, GP], tl.float32)
    offs_c = tl.arange(0, W)

    if split < NS:
        length = tl.load(len_ptr + b).to(tl.int32)
        npg = tl.cdiv(length, P)
        if SLIDING:  # the splits share the pages from the first one holding a visible token
            tstart = tl.maximum(length + tl.load(rlen_ptr + b).to(tl.int32) - SWIN, 0)
            p0 = tl.minimum(tstart // P, npg)
        else:
            tstart = 0
            p0 = 0
        pps = tl.cdiv(npg - p0, NS)
        t0 = (p0 + split * pps) * P
        t1 = tl.minimum(t0 + pps * P, length)
        if SLIDING:  # from the step holding tstart (steps are page-aligned): no step has only hidden tokens;
            t0 = tl.maximum(t0, tstart // BLOCK * BLOCK)
            t1 = tl.where(tstart < t1, t1, t0)  # none at all where the window starts at or past the split's end
        kw_h = kw_ptr + h * s_kch
        ks_h = ks_ptr + h * s_ksh
        kz_h = kz_ptr + h * s_ksh
        vw_h = vw_ptr + h * s_vch
        vs_h = vs_ptr + h * s_vsh
        vz_h = vz_ptr + h * s_vsh
        offs_t = tl.arange(0, BLOCK)
        offs_grp = tl.arange(0, BLOCK // G)
        wk = tl.arange(0, DK // 4)
        ww = tl.arange(0, BLOCK // TW)  # the step's words of a value row
        wr = tl.arange(0, W)  # the channel rows of a value sub-tile
        kcols = wk[:, None] * 4 + tl.arange(0, 4)[None, :]  # [DK/4, 4]: channel within a key plane
        qc = tl.arange(0, DK)
        q0 = _qrows(tl.load(q_col + qc[:, None], mask=gmask[None, :], other=0.0).to(DT), KODD)
        q1 = _qrows(tl.load(q_col + (DK % D) + qc[:, None], mask=gmask[None, :], other=0.0).to(DT), KODD)
        q2 = _qrows(tl.load(q_col + (2 * DK % D) + qc[:, None], mask=gmask[None, :], other=0.0).to(DT), KODD)
        q3 = _qrows(tl.load(q_col + (3 * DK % D) + qc[:, None], mask=gmask[None, :], other=0.0).to(DT), KODD)
        t_full = t0 + tl.maximum(t1 - t0, 0) // BLOCK * BLOCK  # t1 < t0 for splits past the end: no steps
        for phase in tl.static_range(2):  # whole steps, then at most one partial step (the only masked one)
            if phase == 0:
                lo = t0
                hi = t_full
            else:
                lo = t_full
                hi = t1
            for start in tl.range(lo, hi, BLOCK, num_stages=PSTAGES if phase == 0 else 1):
                page = tl.load(bt_ptr + b64 * s_btb + start // P).to(tl.int64)
                tp = start % P + offs_t  # token slots in the page
                if phase == 0:
                    tvalid = tl.full([BLOCK], 1, tl.int1)  # constant: selects and load masks fold away
                else:
                    tvalid = start + offs_t < t1  # the cache stores whole groups; the op accepts any length
                if SLIDING:  # tokens before the sliding window: scores only (their values are stored, finite: weight 0)
                    tvalid = tvalid & (start + offs_t >= tstart)
                kw = tl.load(kw_h + page * s_kcp + tp[:, None] * (DK // 4) + wk[None, :])
                srow = ks_h + page * s_ksp + ((start % P) // G + offs_grp) * s_ksg  # [GPS] key groups of the step
                zrow = kz_h + page * s_ksp + ((start % P) // G + offs_grp) * s_ksg
                s = tl.zeros([BLOCK, GP], tl.float32)
                if HALF:
                    if KSZ and KASM and NK >= 2:  # one load for every plane's scales and zeros (_ksz)
                        if NK == 4:
                            sw0, zw0, sw1, zw1, sw2, zw2, sw3, zw3 = _key_words4(srow, zrow, D)
                        else:
                            sw0, zw0, sw1, zw1 = _key_words2(srow, zrow, D)
                        f00, f01, g00, g01 = _fold_key_words(sw0, zw0, 0, DK, G, BF16, KODD, KFK)
                        f10, f11, g10, g11 = _fold_key_words(sw1, zw1, 1, DK, G, BF16, KODD, KFK)
                        if NK == 4:
                            f20, f21, g20, g21 = _fold_key_words(sw2, zw2, 2, DK, G, BF16, KODD, KFK)
                            f30, f31, g30, g31 = _fold_key_words(sw3, zw3, 3, DK, G, BF16, KODD, KFK)
                    else:
                        f00, f01, g00, g01 = _key_pairs(srow, zrow, kcols, 0, DK, G, KBITS, DT, BF16, KASM, KODD,
                                                        KFK)
                        if NK >= 2:
                            f10, f11, g10, g11 = _key_pairs(srow, zrow, kcols, 1, DK, G, KBITS, DT, BF16, KASM,
                                                            KODD, KFK)
                        else:
                            f10, f11, g10, g11 = f00, f01, g00, g01
                        if NK == 4:
                            f20, f21, g20, g21 = _key_pairs(srow, zrow, kcols, 2, DK, G, KBITS, DT, BF16, KASM,
                                                            KODD, KFK)
                            f30, f31, g30, g31 = _key_pairs(srow, zrow, kcols, 3, DK, G, KBITS, DT, BF16, KASM,
                                                            KODD, KFK)
                    if NK != 4:  # planes 2 and 3 exist only with 2-bit keys; the unpack's unused arguments
                        f20, f21, g20, g21, f30, f31, g30, g31 = f00, f01, g00, g01, f00, f01, g00, g01
                    if KASM:
                        kp = pairs_asm(kw, f00, g00, f01, g01, f10, g10, f11, g11,
                                       f20, g20, f21, g21, f30, g30, f31, g31, KBITS, BF16, KODD, SRCMIN)
                    for k in tl.static_range(NK):
                        if KASM:
                            kk = plane(kp[2 * k], kp[2 * k + 1], DT)
                        else:
                            kk = plane_emulated(kw, k, _pick4(k, f00, f10, f20, f30), _pick4(k, g00, g10, g20, g30),
                                                _pick4(k, f01, f11, f21, f31), _pick4(k, g01, g11, g21, g31), KBITS, DT,
                                                False, KODD, FOLD_E[(KFK * 8 + k) * 2], FOLD_E[(KFK * 8 + k) * 2 + 1])
                        s += tl.dot(kk, _pick4(k, q0, q1, q2, q3), input_precision=PREC)
                else:
                    for k in tl.static_range(NK):
                        ks = tl.reshape(tl.broadcast_to(tl.load(srow[:, None, None] + k * DK + kcols[None])[:, None],
                                                        [BLOCK // G, G, DK // 4, 4]), [BLOCK, DK // 4, 4])
                        kz = tl.reshape(tl.broadcast_to(tl.load(zrow[:, None, None] + k * DK + kcols[None])[:, None],
                                                        [BLOCK // G, G, DK // 4, 4]), [BLOCK, DK // 4, 4])
                        kk = plane_plain(kw, k, ks, kz, KBITS, DT)
                        s += tl.dot(kk, _pick4(k, q0, q1, q2, q3), input_precision=PREC)
                s = tl.where(tvalid[:, None], s, float("-inf"))
                m_i, l_i, alpha, p = _online_softmax(s, m_i, l_i, qk_scale)
                pd = p.to(DT)
                # values: channel rows packed along tokens, token-contiguous scales (kivi_cache.quant); sub-tile
                # c2 = W channels of one value group; plane k of a word holds tokens TW w + 4k + j, one MMA each
                s32 = vs_h.to(tl.pointer_type(tl.int32), bitcast=True) + (page * s_vsp + start % P) // 2
                z32 = vz_h.to(tl.pointer_type(tl.int32), bitcast=True) + (page * s_vsp + start % P) // 2
                vword = (start % P) // TW
                if VHINT:  # steps start at multiples of BLOCK (t0 is page-aligned or, sliding, step-aligned;
                    # P % BLOCK == 0): said so, Triton 3.6 copies value words 16 bytes at a time, not 4 (_vhint)
                    vword = tl.multiple_of(vword, BLOCK // TW)
                for c2 in tl.static_range(NW):
                    words = tl.load(vw_h + page * s_vcp + (c2 * W + wr)[:, None] * (P // TW) + (vword + ww)[None, :])
                    gs = ((c2 * W) // G) * P  # the group's scale row (rows of P tokens: checked by the wrapper)
                    if HALF:  # pairs of two tokens' scales (int32 loads), folded: the fma operands of the unpack
                        s00, s01, s10, s11, s20, s21, s30, s31 = _pair_columns(s32 + gs // 2, BLOCK // TW, NV)
                        z00, z01, z10, z11, z20, z21, z30, z31 = _pair_columns(z32 + gs // 2, BLOCK // TW, NV)
                        e00, h00 = _fold_pair(s00, z00, FOLD_E[(VFK * 8 + 0) * 2 + 0], DT, BF16, VASM)
                        e01, h01 = _fold_pair(s01, z01, FOLD_E[(VFK * 8 + 0) * 2 + 1], DT, BF16, VASM)
                        e10, h10, e11, h11 = e00, h00, e01, h01
                        if NV >= 2:
                            e10, h10 = _fold_pair(s10, z10, FOLD_E[(VFK * 8 + 1) * 2 + 0], DT, BF16, VASM)
                            e11, h11 = _fold_pair(s11, z11, FOLD_E[(VFK * 8 + 1) * 2 + 1], DT, BF16, VASM)
                        e20, h20, e21, h21, e30, h30, e31, h31 = e00, h00, e01, h01, e00, h00, e01, h01
                        if NV == 4:
                            e20, h20 = _fold_pair(s20, z20, FOLD_E[(VFK * 8 + 2) * 2 + 0], DT, BF16, VASM)
                            e21, h21 = _fold_pair(s21, z21, FOLD_E[(VFK * 8 + 2) * 2 + 1], DT, BF16, VASM)
                            e30, h30 = _fold_pair(s30, z30, FOLD_E[(VFK * 8 + 3) * 2 + 0], DT, BF16, VASM)
                            e31, h31 = _fold_pair(s31, z31, FOLD_E[(VFK * 8 + 3) * 2 + 1], DT, BF16, VASM)
                        if VASM:
                            vp = pairs_asm(words, e00, h00, e01, h01, e10, h10, e11, h11, e20, h20, e21, h21, e30,
                                           h30, e31, h31, VBITS, BF16, True, SRCMIN)
                    for k in tl.static_range(NV):
                        if not HALF:
                            vt = token_plane_plain(words, k, vs_h + page * s_vsp + gs + start % P,
                                                   vz_h + page * s_vsp + gs + start % P, VBITS)
                        else:
                            if VASM:
                                u0 = vp[2 * k]
                                u1 = vp[2 * k + 1]
                            else:
                                f0, g0 = _pick4(k, e00, e10, e20, e30), _pick4(k, h00, h10, h20, h30)
                                f1, g1 = _pick4(k, e01, e11, e21, e31), _pick4(k, h01, h11, h21, h31)
                                u0 = pair_emulated(words, k, 0, f0, g0, VBITS, DT, True,
                                                   FOLD_E[(VFK * 8 + k) * 2])
                                u1 = pair_emulated(words, k, 1, f1, g1, VBITS, DT, True,
                                                   FOLD_E[(VFK * 8 + k) * 2 + 1])
                            if phase == 1:  # tokens past the end (their scales may be anything: 0 * inf) -> +0.0
                                # on the packed pairs (pair q of word w: tokens TW w + 4k + 2q + half), not on the
                                # tile: a select on the tile kept Triton 3.9 from building the MMA operand in
                                # registers (it went through shared memory)
                                tw0 = start + ww[None, :] * TW + 4 * k - t1  # < 0: valid
                                u0 = u0 & (tl.where(tw0 < 0, 0xFFFF, 0) | tl.where(tw0 + 1 < 0, -65536, 0))
                                u1 = u1 & (tl.where(tw0 + 2 < 0, 0xFFFF, 0) | tl.where(tw0 + 3 < 0, -65536, 0))
                            vt = plane_token_tile(u0, u1, DT)
                        if phase == 1 and not HALF:  # tokens past the end: their scales may be anything (0 * inf)
                            it = tl.arange(0, BLOCK // NV)
                            vt = tl.where((start + (it // 4) * TW + 4 * k + it % 4 < t1)[None, :], vt, 0.0)
                        if BLOCK // NV >= 16:  # one MMA per plane with P's rows of its tokens
                            pv = tl.dot(vt.to(DT), plane_rows(pd, k, NV), input_precision=PREC)
                            if k == 0:
                                pacc = pv
                            else:
                                pacc += pv
                        else:  # a plane's tokens are fewer than an MMA's k (16): the planes joined, one MMA
                            if k == 0:
                                v0 = vt
                            elif k == 1:
                                v1 = vt
                            elif k == 2:
                                v2 = vt
                            else:
                                v3 = vt
                    if BLOCK // NV < 16:
                        if NV == 1:
                            vall = v0
                        elif NV == 2:
                            vall = join_planes2(v0, v1)
                        else:
                            vall = join_planes4(v0, v1, v2, v3)
                        pacc = tl.dot(vall.to(DT), pd, input_precision=PREC)
                    a0, a1, a2, a3, a4, a5, a6, a7 = _acc_update(c2, pacc, alpha, a0, a1, a2, a3, a4, a5, a6, a7)
    else:  # window slots [lo, lo + RCH) of (b, h): split NS + c holds chunk c
        rlen = tl.load(rlen_ptr + b).to(tl.int32)
        lo = (split - NS) * RCH
        hi = tl.minimum(lo + RCH, rlen)
        rk_b = rk_ptr + b64 * s_rkb + h * s_rkh
        rv_b = rv_ptr + b64 * s_rvb + h * s_rvh
        offs_d = tl.arange(0, D)
        if NEWKV:  # the chunk holding the newest slot stores the step's token there, then reads its slots
            if (rlen > 0) & (rlen - 1 >= lo) & (rlen - 1 < lo + RCH):
                nk = tl.load(nk_ptr + b64 * s_nkb + h * s_nkh + offs_d)
                nv = tl.load(nv_ptr + b64 * s_nvb + h * s_nvh + offs_d)
                tl.store(rk_b + (rlen - 1) * s_rkt + offs_d, nk.to(rk_ptr.dtype.element_ty))
                tl.store(rv_b + (rlen - 1) * s_rvt + offs_d, nv.to(rv_ptr.dtype.element_ty))
            tl.debug_barrier()  # the stores before any thread's window loads (one CTA: bar.sync orders them)
        if SLIDING:  # window slot j is stored token length + j: visible from slot rlen - SWIN on
            lo = tl.maximum(lo, rlen - SWIN)
        q = tl.load(q_col + offs_d[:, None], mask=gmask[None, :], other=0.0).to(tl.float32).to(DT)
        for start in tl.range(lo, hi, BLOCK_R, num_stages=RSTAGES):
            tok = start + tl.arange(0, BLOCK_R)
            tvalid = tok < hi
            kk = tl.load(rk_b + tok[:, None] * s_rkt + offs_d[None, :], mask=tvalid[:, None], other=0.0)
            s = tl.dot(kk.to(tl.float32).to(DT), q, input_precision=PREC)
            s = tl.where(tvalid[:, None], s, float("-inf"))
            m_i, l_i, alpha, p = _online_softmax(s, m_i, l_i, qk_scale)
            pd = p.to(DT)
            for gi in tl.static_range(NW):
                cols = gi * W + offs_c
                vv = tl.load(rv_b + tok[:, None] * s_rvt + cols[None, :], mask=tvalid[:, None], other=0.0)
                pv = tl.dot(tl.trans(vv.to(tl.float32).to(DT)), pd, input_precision=PREC)
                a0, a1, a2, a3, a4, a5, a6, a7 = _acc_update(gi, pv, alpha, a0, a1, a2, a3, a4, a5, a6, a7)

    NSP = tl.num_programs(1)  # NS paged splits + the window's chunks
    row = (b64 * Hkv + h) * GROUP + offs_g  # flat (b, hq)
    ws = row * NSP + split
    tl.store(m_ws + ws, m_i, mask=gmask)
    tl.store(l_ws + ws, l_i, mask=gmask)
    for gi in tl.static_range(NW):
        acc = _acc_get(gi, a0, a1, a2, a3, a4, a5, a6, a7)
        tl.store(o_ws + ws[None, :] * D + (gi * W + offs_c)[:, None], acc, mask=gmask[None, :])
    if MERGE:
        # every thread's partial stores before the arrival count (bar.sync, then a gpu-scope release); the last of
        # the pair's NSP programs to arrive (acquire) merges them, reading through L2 (.cg), and resets the count
        tl.debug_barrier()
        prev = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if prev == NSP - 1:
            _merge_pair(m_ws, l_ws, o_ws, out_ptr, row, hq, gmask, b64 * s_ob, s_oh, NSP, GP, D, BM, BSM,
                        sink_ptr, SINK)
            tl.atomic_xchg(cnt_ptr + pid, 0)


@triton.jit
def _merge_chunk(m_ws, o_ws, base, m_safe, gmask, s0, NSP1, D: tl.constexpr, BSM: tl.constexpr):
    """Partials ``[s0, s0 + BSM)`` of rows ``base`` weighted by ``exp2(m - m_safe)``, summed: ``[GP, D]``."""
    so = s0 + tl.arange(0, BSM)
    okc = gmask[:, None] & (so[None, :] < NSP1)
    w = tl.exp2(tl.load(m_ws + base[:, None] + so[None, :], mask=okc, other=float("-inf"), cache_modifier=".cg")
                - m_safe[:, None])
    o = tl.load(o_ws + ((base[:, None] + so[None, :]) * D)[:, :, None] + tl.arange(0, D)[None, None, :],
                mask=okc[:, :, None], other=0.0, cache_modifier=".cg")
    return tl.sum(w[:, :, None] * o, axis=1)


@triton.jit
def _merge_pair(m_ws, l_ws, o_ws, out_ptr, row, hq, gmask, out_off, s_oh, NSP1, GP: tl.constexpr, D: tl.constexpr,
                BM: tl.constexpr, BSM: tl.constexpr, sink_ptr, SINK: tl.constexpr):
    """The split kernel's in-place merge (MERGE): rows ``row`` ``[GP]`` (query heads ``hq`` of one sequence and KV
    head) from their ``NSP1`` (<= BM) partials, as :func:`_decode_reduce_kernel` does for one row."""
    base = row * NSP1
    offs_s = tl.arange(0, BM)
    ok = gmask[:, None] & (offs_s[None, :] < NSP1)
    m_all = tl.load(m_ws + base[:, None] + offs_s[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
    l_all = tl.load(l_ws + base[:, None] + offs_s[None, :], mask=ok, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m_all, axis=1)
    if SINK:  # one more softmax term per query head, on no value: in the maximum and the sum only
        sink = tl.load(sink_ptr + hq, mask=gmask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.sum(tl.exp2(m_all - m_safe[:, None]) * l_all, axis=1)
    if SINK:
        l_sum += tl.exp2(sink - m_safe)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([GP, D], tl.float32)
    if BM <= 16:  # a few partials: the loop unrolled (its loads issued together)
        for s0 in tl.static_range(0, BM, BSM):
            acc += _merge_chunk(m_ws, o_ws, base, m_safe, gmask, s0, NSP1, D, BSM)
    else:  # many (eager batch 1 at long context, DecodeTuning.merge_max): a loop
        for s0 in tl.range(0, NSP1, BSM):
            acc += _merge_chunk(m_ws, o_ws, base, m_safe, gmask, s0, NSP1, D, BSM)
    res = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + out_off + hq[:, None] * s_oh + offs_d[None, :], res.to(out_ptr.dtype.element_ty),
             mask=gmask[:, None])


@triton.jit
def _decode_reduce_kernel(m_ws, l_ws, o_ws, out_ptr, sink_ptr, NSP1, s_ob, s_oh, Hq,
                          D: tl.constexpr, DB: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
                          SINK: tl.constexpr = 0):
    """Program (row, dc): channels ``[dc * DB, (dc + 1) * DB)`` of one (sequence, query head).
    The global max and the sum of weights come from one load of all ``NSP1`` (<= BM) partial maxima,
    so the accumulation loop has no running rescale and its loads do not wait on each other. ``SINK``: the query
    head's learned sink logit (``sink_ptr[hq]``, natural log) joins the maximum and the sum, on no value."""
    row = tl.program_id(0).to(tl.int64)
    dc = tl.program_id(1)
    b = row // Hq
    hq = row % Hq
    base = row * NSP1
    offs_m = tl.arange(0, BM)
    ok_m = offs_m < NSP1
    m_all = tl.load(m_ws + base + offs_m, mask=ok_m, other=float("-inf"))
    l_all = tl.load(l_ws + base + offs_m, mask=ok_m, other=0.0)
    m_max = tl.max(m_all, axis=0)
    if SINK:
        sink = tl.load(sink_ptr + hq).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.sum(tl.exp2(m_all - m_safe) * l_all, axis=0)
    if SINK:
        l_sum += tl.exp2(sink - m_safe)
    offs_d = dc * DB + tl.arange(0, DB)
    acc = tl.zeros([DB], tl.float32)
    for s0 in range(0, NSP1, BS):
        offs = s0 + tl.arange(0, BS)
        ok = offs < NSP1
        w = tl.exp2(tl.load(m_ws + base + offs, mask=ok, other=float("-inf")) - m_safe)
        o = tl.load(o_ws + (base + offs)[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
    res = acc / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(out_ptr + b * s_ob + hq * s_oh + offs_d, res.to(out_ptr.dtype.element_ty))


def _reduce_launch(rows: int, nsp1: int, d: int, sink: bool = False):
    """Grid and compile-time settings of the merge kernel. Grid ``(B * Hq, D / DB)``: batch 1 still gets
    ``Hq * D / 32`` programs (one per row was 32 serial programs at batch 1, each looping over hundreds of
    splits). 32-channel programs while rows are few (batch 1: 16.8 -> 4.0 us at 257 splits); whole rows from
    512 rows on (1024 rows x 13 splits: 6.8 us split, 5.6 whole; eval/results/reduce_probe.json)."""
    db = min(d, 32) if rows < 512 else d
    bs = max(1, min(triton.next_power_of_2(nsp1), 4096 // db))
    meta = dict(D=d, DB=db, BS=bs, BM=triton.next_power_of_2(nsp1), num_warps=4, **({"SINK": 1} if sink else {}))
    return (rows, d // db), meta


def decode_reduce(ws_m, ws_l, ws_o, out, hq: int, sink_logits=None) -> None:
    """Merge ``ws_*`` (``[B * Hq, NS + NR(, D)]`` fp32 partial max / sum / output: NS paged splits, NR window
    chunks) into ``out`` ``[B, Hq, D]``; ``sink_logits`` ``[Hq]``: learned attention sinks (one more softmax term per
    query head, on no value)."""
    rows, nsp1, d = ws_o.shape
    grid, meta = _reduce_launch(rows, nsp1, d, sink_logits is not None)
    _decode_reduce_kernel[grid](ws_m, ws_l, ws_o, out, ws_m if sink_logits is None else sink_logits, nsp1,
                                out.stride(0), out.stride(1), hq, **meta)


def _use_asm(dtype, bits: int, dot_f32: bool) -> bool:
    """The inline-PTX unpack (GPU only) covers 2/4-bit codes with fp16/bf16 dots."""
    return not dot_f32 and not interpreting() and bits in (2, 4) and dtype in (torch.float16, torch.bfloat16)


def _decode_tuning(t: _tuning.DecodeTuning | None) -> _tuning.DecodeTuning:
    """``t``, or the default's decode settings (read at each call: a benchmark may replace ``tuning.DEFAULT``)."""
    return _tuning.DEFAULT.decode if t is None else t


def _step_tokens(page_size: int, group_size: int, interp: bool, t: _tuning.DecodeTuning | None = None) -> int:
    """Tokens per step of the paged loop: whole key groups inside one page, up to ``DecodeTuning.step`` (64). At
    head_dim 256 too, although that build spills under Triton 3.6: 32-token steps and two-warp programs (no spills)
    decoded slower there (eval/NOTES.md)."""
    cap = max(group_size, _decode_tuning(t).step)
    return max(g for g in (group_size * (1 << i) for i in range(8)) if g <= cap and page_size % g == 0)


def _maxnreg(interp: bool, step: int, t: _tuning.DecodeTuning | None = None) -> dict:
    """Register cap per thread (more resident warps per SM): 128 for 32-token steps, none for larger steps (they
    would spill); ``DecodeTuning.maxnreg`` overrides (0 = none)."""
    n = _decode_tuning(t).maxnreg
    if n is None:
        n = 128 if step <= 32 else 0
    return {} if interp or n <= 0 else {"maxnreg": n}


def _stages(interp: bool, t: _tuning.DecodeTuning | None = None) -> dict:
    """Software-pipelining depth of the paged loop (``PSTAGES`` and ``num_stages``: ``DecodeTuning.stages``, 5) and
    of the residual-window loop (``RSTAGES``: ``DecodeTuning.rstages``, 1). The paged loop's page index (block table)
    is itself a pipelined load that the code loads depend on, so with Triton 3.6 fewer than 5 stages make every step
    wait for *all* its copies (``cp.async.wait_group 0``: the load latency is exposed once per step); at 5 the next
    step's codes stay in flight during this step's math. The residual loop pipelined that deep spills, so it runs
    unpipelined. One stage of each under the interpreter."""
    if interp:
        return dict(PSTAGES=1, RSTAGES=1, num_stages=1)
    t = _decode_tuning(t)
    return dict(PSTAGES=t.stages, RSTAGES=t.rstages, num_stages=t.stages)


# programs per SM of each compiled decode kernel, keyed by device and compile-time settings: read from the
# kernel returned by its first launch (registers, shared memory, warps); until then RESIDENT_DEFAULT (the one-warp
# head_dim-128 kernel's count)
RESIDENT_DEFAULT = 8
_RESIDENT: dict = {}


def _srcmin(t: _tuning.DecodeTuning | None = None) -> dict:
    """``SRCMIN`` of the unpack (``DecodeTuning.srcmin``: 16 = exact, the default; 6 or 4 read codes in place from
    that mantissa bit up, with a larger rounding of the folded zero points: ``kernels.unpack.field``)."""
    return dict(SRCMIN=_decode_tuning(t).srcmin)


def _vhint(d: int, step: int, key_bits: int, value_bits: int, t: _tuning.DecodeTuning | None = None) -> dict:
    """``VHINT`` of the split kernel: its paged loop declares each step's offset into the value-word rows a multiple
    of the step's words (true: steps start at multiples of BLOCK). Triton 3.9 infers that and copies the value tiles
    in 16-byte pieces; 3.6 (the GPU image) copies them 4 bytes at a time without the hint, and with it builds what
    3.9 builds (the same cp.async widths) and decodes faster (int4, head_dim 128, bit-equal outputs). Policy
    (``DecodeTuning.vhint=None``): on for 64-token steps at head_dim >= 128, and at head_dim 64 for 2- and 4-bit keys
    and values (timed faster there under 3.6, with and without KSZ); off for 32-token steps (3.6 then spills) and for
    8-bit keys or values at head_dim 64 (not timed). Under 3.9 it changes no instruction. True/False force it.
    Timings in eval/NOTES.md."""
    v = _decode_tuning(t).vhint
    if v is None:
        v = step >= 64 and (d >= 128 or max(key_bits, value_bits) <= 4)
    return dict(VHINT=int(v))


_TRITON_36 = triton.__version__.startswith("3.6")  # the GPU image's Triton, where _ksz's bf16 rule was timed


def _ksz(d: int, key_bits: int, bf16: bool = False, t: _tuning.DecodeTuning | None = None) -> dict:
    """``KSZ`` of the split kernel (``DecodeTuning.ksz``: None, the policy, True or False; 2- and 4-bit keys with
    the inline-PTX unpack only): the step's key scale and zero words of every key plane in one [2, GPS, D/2] int32
    load (``_key_words``), split in registers, instead of two [GPS, D/2 NK] loads per plane. Those tiles are small at
    head_dim 64 and with 64-token groups, and Triton 3.6 copies them with 16-byte cp.async on a few lanes, each copy
    behind a branch (a quarter more SASS per step than 3.9 for 2/2 bits at head_dim 64, which then decoded a fifth
    slower than under 3.9). With one load 3.6's build is as lean as 3.9's (never more SASS; under 3.9 from 0.5% more
    to 4% fewer) and decodes as fast as 3.9 there, faster or equal at every timed head_dim 64 and 128 setting; outputs
    within 1e-3 relative (bit-equal where the split count is unchanged). Policy: on at head_dim 64; at 128 for fp16,
    and for bf16 under Triton 3.6 only (bf16 builds at head_dim 128 sit at the 255-register cap and the one load
    keeps more words live: they spill a few registers per step; timed faster anyway under 3.6, neutral under 3.9).
    At head_dim 256 every build spills with or without it (not timed): off. Timings in eval/NOTES.md."""
    v = _decode_tuning(t).ksz
    if v is None:
        v = d < 128 or (d == 128 and (not bf16 or _TRITON_36))
    return dict(KSZ=int(v and key_bits in (2, 4)))


def warps_by_registers(regs: int, sm_regs: int = 65536) -> int:
    """Warps an SM holds by registers alone (sm_80/sm_90): each of its 4 sub-partitions has a quarter of the
    register file, allocated per warp in units of 256 registers; at most 64."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(64, 4 * (sm_regs // 4 // per_warp)) if per_warp else 64


def resident_programs(regs: int, shared: int, warps: int, sm_regs: int = 65536, sm_shared: int = 233472,
                      sm_warps: int = 64, sm_blocks: int = 32) -> int:
    """Programs of ``warps`` warps an SM holds at once (sm_80/sm_90 limits): registers as
    :func:`warps_by_registers`, each program's shared memory costs 1 KB more (reserved by the driver)."""
    by_regs = warps_by_registers(regs, sm_regs) // warps
    by_shared = sm_shared // (shared + 1024)
    return max(1, min(by_regs, by_shared, sm_warps // warps, sm_blocks))


def _resident_of(kernel, device) -> int | None:
    try:
        limits = {}
        if device.type == "cuda":  # e.g. A100: 164 KB of shared memory per SM, H100/H200: 228 KB
            props = torch.cuda.get_device_properties(device)
            limits = dict(sm_shared=getattr(props, "shared_memory_per_multiprocessor", 233472),
                          sm_warps=getattr(props, "max_threads_per_multi_processor", 2048) // 32)
        return resident_programs(int(kernel.n_regs), int(kernel.metadata.shared), int(kernel.metadata.num_warps),
                                 **limits)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None


def _pick_splits(bsz: int, hkv: int, width_tokens: int, device, resident: int = RESIDENT_DEFAULT,
                 chunks: int = 1, t: _tuning.DecodeTuning | None = None) -> int:
    """Context splits per (sequence, KV head). The grid has ``bsz * hkv * (splits + chunks)`` one-warp programs
    (the last ``chunks`` of each read the residual window, :func:`window_chunk`); ``resident`` of them fit on an
    SM at once (from the compiled kernel's registers and shared memory: 8 for the one-warp d=128 kernel, 4 at d=256;
    ``DecodeTuning.resident`` overrides), so ``slots = SMs * resident`` programs make one wave.
    Waves: as many as splits of ``DecodeTuning.split_long`` (1024) tokens need, at most
    ``DecodeTuning.fill / resident`` (24 / 8 = 3); splits fill those waves, but none is shorter than
    ``DecodeTuning.split_min`` (256) tokens. So batch 1 x 8 KV heads at 128k runs one wave of 131 splits (faster
    than two or three waves of more), at 32k and 8k 256-token splits, and from batch 8 x 8 KV heads at >= 32k three
    waves (timings in eval/NOTES.md). Two splits at most under the interpreter or off CUDA."""
    if interpreting() or device.type != "cuda":
        return max(1, min(2, width_tokens // 64))
    return split_count(bsz, hkv, width_tokens, num_sms(device), resident, chunks, t)


def split_count(bsz: int, hkv: int, width_tokens: int, sms: int, resident: int, chunks: int = 1,
                t: _tuning.DecodeTuning | None = None) -> int:
    """The rule of :func:`_pick_splits` for ``sms`` SMs holding ``resident`` programs each (``t``'s settings)."""
    t = _decode_tuning(t)
    resident = t.resident or resident
    slots = sms * resident
    pairs = max(1, bsz * hkv)
    max_waves = max(1, t.fill // resident)
    by_long = triton.cdiv(width_tokens, t.split_long)
    waves = min(max_waves, triton.cdiv(pairs * (by_long + chunks), slots))
    by_fill = max(1, waves * slots // pairs - chunks)
    by_len = triton.cdiv(width_tokens, t.split_min)
    return max(1, min(by_fill, by_len, 1024))


# window slots per program where the (sequence, KV head) pairs are few (window_chunk): the unpipelined window loop
# spread over a few programs instead of one that outlasts the paged splits
WINDOW_CHUNK = 64


def window_chunk(pairs: int, capacity: int, block_r: int, device, t: _tuning.DecodeTuning | None = None) -> int:
    """Window slots per program: the whole window (one program) unless the pairs are few (at most ``MERGE_PAIRS``,
    small batches on a GPU), where the window's one unpipelined program is the split kernel's longest (batch 1 at
    1k: the kernel then took twice SDPA's time): then ``WINDOW_CHUNK`` slots each. The plan keeps the chunks only
    where the split rule (:func:`split_count`) gives the paged splits the same count with them as with one window
    program (split length the bound: short contexts, batch 1 up to 32k); where they would move the rule to more waves
    (batch 8 x 8 KV heads x 32k) they decoded slower. ``DecodeTuning.rchunk`` overrides both (tokens, rounded up to
    whole ``block_r`` steps; also under the interpreter, for tests). Timings in eval/NOTES.md."""
    rchunk = _decode_tuning(t).rchunk
    if rchunk:
        tokens = rchunk
    elif device.type == "cuda" and not interpreting() and pairs <= MERGE_PAIRS:
        tokens = WINDOW_CHUNK
    else:
        tokens = capacity
    return _whole_steps(tokens, capacity, block_r)


def _whole_steps(tokens: int, capacity: int, block_r: int) -> int:
    """``tokens`` (at most the window's ``capacity``) rounded up to whole ``block_r``-slot steps."""
    return max(block_r, triton.cdiv(max(1, min(tokens, capacity)), block_r) * block_r)


def _check_common(q_dim, k_codes, k_scale, key_bits, value_bits, group_size):
    d = k_scale.shape[-1]
    if q_dim != d:
        raise ValueError(f"q head_dim={q_dim} does not match the pool's head_dim={d}")
    check_settings(d, key_bits, value_bits, group_size, k_codes.shape[2])
    for t in (k_codes, k_scale):
        if t.stride(-1) != 1:
            raise ValueError("pool tensors must have a contiguous last dimension")


# at most this many partials per (sequence, KV head) merged in the split kernel by default (DecodeTuning.merge_max;
# and only while GP x BM <= 1024)
MERGE_MAX = _tuning.DecodeTuning.merge_max
# the split kernel merges by default only where (sequences x KV heads) is at most this: small batches, whose eager
# steps are bound by the host (one launch fewer); larger ones are bound by the GPU, where the merge kernel costs less
MERGE_PAIRS = 64
_PLANS: dict = {}  # plan key -> _DecodePlan; the 32 layers of a decode step share one (same shapes)
_SPLIT = Launcher(_decode_split_kernel)
_REDUCE = Launcher(_decode_reduce_kernel)


class _DecodePlan:
    """What a decode call derives from shapes, strides, dtypes and settings alone (FlashInfer's plan/run split):
    checked once, then every call with the same key only allocates its workspace and launches."""

    __slots__ = ("meta", "grid", "reduce_grid", "reduce_meta", "rows", "nsp1", "rkey", "final", "ints", "merge_meta",
                 "pairs", "counters")

    def __init__(self, q, block_table, k_codes, k_scale, v_codes, v_scale, v_zero, res_k, res_v, key_bits,
                 value_bits, group_size, num_splits, force_half_dot, plain, newkv=False, sliding_window=None,
                 sink=False, tuning: _tuning.DecodeTuning | None = None):
        t = _decode_tuning(tuning)
        if not isinstance(t, _tuning.DecodeTuning):
            raise TypeError(f"tuning must be None or a kernels.tuning.DecodeTuning, got {type(t).__name__}")
        if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                       or num_splits < 1):
            raise ValueError(f"num_splits must be None (automatic) or an int >= 1 (context splits), got {num_splits!r}")
        bsz, hq, d = q.shape
        _check_common(d, k_codes, k_scale, key_bits, value_bits, group_size)
        np_, hkv, p, _ = k_codes.shape
        if hq % hkv:
            raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
        group = hq // hkv
        sub = min(group_size, 32)
        if d // sub > 8 or sub < 16 or d * key_bits // 8 < 16 or p * value_bits % 32:
            raise ValueError(f"decode kernel needs value sub-tiles min(group_size, 32) >= 16 and <= 8 of them "
                             f"per head, and pages of whole 32-bit words of value codes; got group_size={group_size}, "
                             f"head_dim={d}, page_size={p}, bits={key_bits}/{value_bits}")
        gp = max(t.gp_min, triton.next_power_of_2(group))
        interp = interpreting()
        block_tokens(p, group_size, 256)  # page-size check
        blk = _step_tokens(p, group_size, interp, t)
        if k_codes.shape[-1] % 4 or v_codes.shape[-1] % 4:
            raise ValueError("code rows must be a whole number of 32-bit words (head_dim * bits / 8 % 4 == 0)")
        blk_r = 64 if interp else (32 if d <= 128 else 16)
        dot_f32 = (interp and not force_half_dot) or q.dtype == torch.float32
        kw = k_codes.view(torch.int32)
        vw = v_codes.view(torch.int32)
        if kw.stride(2) != kw.shape[3] or vw.stride(2) != vw.shape[3] or v_scale.stride(2) != v_scale.shape[3]:
            raise ValueError("pool tensors must be contiguous within a page (rows back to back)")
        if not dot_f32 and (v_scale.element_size() != 2 or any(
                x % 2 for t in (v_scale, v_zero) for x in (*t.stride()[:3], t.storage_offset()))):
            raise ValueError("fp16/bf16 decode reads value scales and zeros in pairs of tokens: they must be "
                             "fp16/bf16 with even strides and offsets (as the page pool allocates them)")
        meta = dict(GROUP=group, GP=gp, D=d, P=p, G=group_size, BLOCK=blk, BLOCK_R=blk_r,
                    KBITS=key_bits, VBITS=value_bits, DOT_F32=dot_f32,
                    KASM=not plain and _use_asm(q.dtype, key_bits, dot_f32),
                    VASM=not plain and _use_asm(q.dtype, value_bits, dot_f32), BF16=q.dtype == torch.bfloat16,
                    num_warps=t.warps, **_stages(interp, t), **_maxnreg(interp, blk, t),
                    **_srcmin(t), **_vhint(d, blk, key_bits, value_bits, t),
                    **_ksz(d, key_bits, q.dtype == torch.bfloat16, t),
                    **({"SLIDING": 1} if sliding_window else {}))
        rkey = (q.device.index, *meta.items())
        cap = res_k.shape[2]
        rch = window_chunk(bsz * hkv, cap, blk_r, q.device, t)
        chunks = max(1, triton.cdiv(cap, rch))
        if num_splits:
            ns = num_splits
        else:
            width, resident = block_table.shape[1] * p, _RESIDENT.get(rkey, RESIDENT_DEFAULT)
            if sliding_window:  # the pages a window spans
                width = min(width, (triton.cdiv(sliding_window, p) + 1) * p)
            ns = _pick_splits(bsz, hkv, width, q.device, resident, chunks, t)
            if chunks > 1 and not t.rchunk:
                ns1 = _pick_splits(bsz, hkv, width, q.device, resident, 1, t)
                if ns != ns1:  # the chunks would change the paged splits (and waves): one window program
                    rch, chunks, ns = _whole_steps(cap, cap, blk_r), 1, ns1
        self.meta = dict(meta, **({"NEWKV": 1} if newkv else {}))
        self.grid = (bsz * hkv, ns + chunks)
        self.rows, self.nsp1, self.rkey = bsz * hq, ns + chunks, rkey
        # the split kernel's integer arguments: fixed by the key (its strides, head counts, splits, window chunk)
        self.ints = (hkv, ns, rch, sliding_window or 0, q.stride(0), q.stride(1), block_table.stride(0), kw.stride(0),
                     kw.stride(1),
                     k_scale.stride(0), k_scale.stride(1), k_scale.stride(2), vw.stride(0), vw.stride(1),
                     v_scale.stride(0), v_scale.stride(1), *res_k.stride()[:3], *res_v.stride()[:3])
        self.reduce_grid, self.reduce_meta = _reduce_launch(self.rows, self.nsp1, d, sink)
        # the split kernel merges its own partials (no merge kernel) where a pair has at most merge_max of them (one
        # one-warp program merges them all: more GPU time than the merge kernel at a hundred partials, hidden behind
        # the host in eager steps) and, by default, where there are few pairs (MERGE_PAIRS: small batches, whose eager
        # steps are host-bound: one launch fewer). Never while a CUDA graph is captured (there the GPU time counts:
        # the merge kernel). DecodeTuning.fuse_merge True: at any batch; False: never.
        self.merge_meta = None
        fuse = t.fuse_merge
        bm = triton.next_power_of_2(self.nsp1)
        if ((fuse or (fuse is None and bsz * hkv <= MERGE_PAIRS)) and self.nsp1 <= t.merge_max
                and gp * bm <= 1024):  # the merging program holds all [GP, BM] partial maxima and sums in registers
            self.merge_meta = dict(self.meta, MERGE=1, BM=bm, BSM=max(1, min(bm, 2048 // (gp * d))),
                                   **({"SINK": 1} if sink else {}))
        self.pairs, self.counters = bsz * hkv, {}  # MERGE: arrival counts per stream, zero between calls
        self.final = interp or rkey in _RESIDENT  # else: planned again once the kernel's residency is known


def _check_new_token(new_k, new_v, q, res_k, res_v):
    """``new_k``/``new_v`` as ``[B, Hkv, D]`` views with a contiguous last dim (checked by
    :func:`.checks.check_new_token`); the window they are written into checked."""
    if new_k.dim() == 4:
        new_k, new_v = new_k.select(2, 0), new_v.select(2, 0)
    if res_k.stride(-1) != 1 or res_v.stride(-1) != 1:
        raise ValueError("with new_k/new_v the window (res_k/res_v) is written in place: its last dim must be "
                         "contiguous")
    return (new_k if new_k.stride(-1) == 1 else new_k.contiguous(),
            new_v if new_v.stride(-1) == 1 else new_v.contiguous())


def _plan_key(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v, res_lengths,
              out, key_bits, value_bits, group_size, num_splits, force_half_dot, plain, new_k, new_v,
              sliding_window=None, sink_logits=None, tuning=None):
    # every tensor's device (each checked on a new key only; new_k/new_v, sink_logits and out on every call)
    return (out.stride(), q.device, block_table.device, lengths.device, res_lengths.device, k_codes.device,
            k_scale.device, k_zero.device, v_codes.device, v_scale.device, v_zero.device, res_k.device, res_v.device,
            q.dtype, q.shape, q.stride(), block_table.shape, block_table.stride(),
            block_table.dtype, lengths.shape, lengths.dtype, res_lengths.shape, res_lengths.dtype, k_codes.shape,
            k_codes.stride(), k_codes.dtype, k_scale.shape, k_scale.stride(), k_scale.dtype, k_zero.shape,
            k_zero.stride(), k_zero.dtype, v_codes.shape, v_codes.stride(), v_scale.shape, v_scale.stride(),
            v_scale.dtype, v_scale.storage_offset() % 2, v_zero.shape, v_zero.stride(), v_zero.dtype,
            v_zero.storage_offset() % 2, res_k.shape, res_k.stride(), res_k.dtype, res_v.shape, res_v.stride(),
            res_v.dtype, key_bits, value_bits, group_size, num_splits, force_half_dot, plain,
            type(key_bits), type(value_bits), type(group_size),  # 4.0 == 4: a float is checked (and rejected)
            None if new_k is None else (new_k.stride(), new_k.dtype, new_v.stride(), new_v.dtype), tuning,
            sliding_window, None if sink_logits is None else (sink_logits.dtype, sink_logits.stride()))


_SHARED_WS: dict = {}  # (device index, stream, floats) -> the workspace that DecodeRunners launching there share


def _workspace(plan: _DecodePlan, d: int, device, shared: bool = False):
    """One fp32 workspace for a call: partial outputs first (16-byte aligned), then maxima and sums, each padded to
    4 floats (so all three are 16-byte aligned). ``shared``: one buffer per device, stream and size, kept for the
    :class:`DecodeRunner` s that launch on that stream only (their kernels run one after another there, each
    reading its partials before the next writes them), so a runner's step allocates none."""
    rows, nsp1 = plan.rows, plan.nsp1
    pad = -(-rows * nsp1 // 4) * 4
    n = rows * nsp1 * d + 2 * pad
    if shared:
        stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
        key = (device.index, stream, n)
        ws = _SHARED_WS.get(key)
        if ws is None:
            if len(_SHARED_WS) > 64:  # shapes seen by a long-lived process: keep it bounded (runners keep theirs)
                _SHARED_WS.clear()
            ws = _SHARED_WS[key] = torch.empty(n, dtype=torch.float32, device=device)
    else:
        ws = torch.empty(n, dtype=torch.float32, device=device)
    ws_o = ws[:rows * nsp1 * d].view(rows, nsp1, d)
    ws_m = ws[rows * nsp1 * d:rows * nsp1 * d + rows * nsp1].view(rows, nsp1)
    ws_l = ws[rows * nsp1 * d + pad:rows * nsp1 * d + pad + rows * nsp1].view(rows, nsp1)
    return ws_m, ws_l, ws_o


def _counts(plan: _DecodePlan, device):
    """The merge's arrival counts for the current stream (a kernel leaves them at zero)."""
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    cnt = plan.counters.get(stream)
    if cnt is None:
        cnt = plan.counters[stream] = torch.zeros(plan.pairs, dtype=torch.int32, device=device)
    return cnt


# positions in _split_args' tuple of the tensors that change from call to call (DecodeRunner fills them in)
_A_Q, _A_RLEN, _A_WSM, _A_WSL, _A_WSO, _A_NK, _A_NV, _A_OUT, _A_CNT, _A_SINK = 0, 11, 12, 13, 14, 15, 16, 17, 18, 19


def _split_args(plan, q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v,
                res_lengths, ws_m, ws_l, ws_o, new_k, new_v, out, cnt, sm_scale, sink_logits=None) -> tuple:
    """The split kernel's runtime arguments, in its parameter order (placeholders for the pointers it does not
    read: the window for a missing step token, the window lengths for the merge's counts, the sequence lengths for
    missing sink logits)."""
    return (q, block_table, lengths, k_codes.view(torch.int32), k_scale, k_zero, v_codes.view(torch.int32), v_scale,
            v_zero, res_k, res_v, res_lengths, ws_m, ws_l, ws_o,
            res_k if new_k is None else new_k, res_v if new_k is None else new_v, out, cnt,
            lengths if sink_logits is None else sink_logits, float(sm_scale) * LOG2E,
            *plan.ints,
            *((0, 0, 0, 0) if new_k is None else (new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1))),
            out.stride(0), out.stride(1))


def _reduce_args(plan, ws_m, ws_l, ws_o, out, hq: int, sink_logits=None) -> tuple:
    return (ws_m, ws_l, ws_o, out, ws_m if sink_logits is None else sink_logits, plan.nsp1, out.stride(0),
            out.stride(1), hq)


def paged_decode_attention(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                           res_k, res_v, res_lengths, key_bits: int, value_bits: int, group_size: int,
                           sm_scale: float, *, num_splits: int | None = None, out=None, new_k=None, new_v=None,
                           merge: bool = True, sliding_window: int | None = None, sink_logits=None,
                           tuning: _tuning.DecodeTuning | None = None, _force_half_dot: bool = False,
                           _plain: bool = False):
    """Triton twin of :func:`kivi_cache.reference.paged_decode_attention`.

    ``sliding_window``: attention over the last ``sliding_window`` stored tokens only (the splits share only the pages
    holding them; the others are not read). ``sink_logits`` (``[Hq]``): learned attention sinks, added where the
    partials are merged (the split kernel's loop is the same).

    ``new_k``/``new_v`` (``[B, Hkv, D]`` or ``[B, Hkv, 1, D]``): the step's own token, which the kernel writes into the
    window at ``res_lengths[b] - 1`` (the lengths already count it) before attending (the cache's decode step then
    needs no separate window writes).

    q ``[B, Hq, D]``; returns ``[B, Hq, D]`` in q's dtype. ``num_splits`` (an int >= 1)
    overrides the automatic context split (for tests/benchmarks); ``out``
    (``[B, Hq, D]``, q's dtype, last dim contiguous) is written in place if given.
    ``tuning`` (a :class:`~kivi_cache.kernels.tuning.DecodeTuning`; None: ``tuning.DEFAULT.decode``, read at each
    call): the launch settings and policies. ``_force_half_dot`` (interpreter) and ``_plain`` (GPU: no inline-PTX
    unpack) are for tests and benchmarks. Everything that depends only on shapes and settings is planned once per key
    (:class:`_DecodePlan`, the tuning part of the key); a call then allocates one workspace and makes two launches, or
    one where the split kernel's last program of each (sequence, KV head) merges the partials: at most
    ``merge_max`` (``MERGE_MAX``) of them and, unless ``fuse_merge`` is True (False: never), at most ``MERGE_PAIRS``
    pairs; not while a CUDA graph is captured, nor with ``merge=False``. The in-kernel merge keeps one small tensor of
    arrival counts per plan and stream (allocated by its first call): a caller whose allocations must not outlive the
    call passes ``merge=False``, e.g. a step compiled by ``torch.compile`` with CUDA graphs, whose warm-up runs
    allocate from the graphs' private pool and whose recording fails on a tensor of that pool kept alive
    (``StaticQuantizedPagedCache`` does).
    :class:`DecodeRunner` plans once for many calls.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {list(q.shape)}")
    t = _tuning.DEFAULT.decode if tuning is None else tuning
    checks.check_sliding_window(sliding_window)
    checks.check_sm_scale(sm_scale)
    if sink_logits is not None:
        checks.check_sink_logits(sink_logits, q)
        if sink_logits.stride(-1) != 1:
            sink_logits = sink_logits.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    token = (new_k, new_v)  # checked after the plan's checks (checks.check_new_token)
    if new_k is not None or new_v is not None:
        if new_k is None or new_v is None:
            checks.check_new_token(new_k, new_v, q, k_codes)  # raises: one without the other
        new_k, new_v = _check_new_token(new_k, new_v, q, res_k, res_v)
    if res_k.stride(-1) != 1:
        res_k = res_k.contiguous()
    if res_v.stride(-1) != 1:
        res_v = res_v.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if lengths.stride(-1) != 1:
        lengths = lengths.contiguous()
    if res_lengths.stride(-1) != 1:
        res_lengths = res_lengths.contiguous()
    bsz, hq, d = q.shape
    if out is None:
        out = torch.empty(bsz, hq, d, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (bsz, hq, d) or out.dtype != q.dtype or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"out must be [B, Hq, D] in q's dtype on q's device with a contiguous last dimension, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}, strides {tuple(out.stride())}")
    key = _plan_key(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v,
                    res_lengths, out, key_bits, value_bits, group_size, num_splits, _force_half_dot, _plain, new_k,
                    new_v, sliding_window, sink_logits, t)
    plan = _PLANS.get(key)
    if plan is None:  # shapes, dtypes and devices: once per key (their values below, where that needs no sync)
        pool = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
        checks.check_attention(q, block_table, lengths, pool, res_k, res_v, res_lengths, key_bits, value_bits,
                               group_size, values=False)
        check_pool_strides(pool)
        plan = _DecodePlan(q, block_table, k_codes, k_scale, v_codes, v_scale, v_zero, res_k, res_v, key_bits,
                           value_bits, group_size, num_splits, _force_half_dot, _plain, new_k is not None,
                           sliding_window, sink_logits is not None, t)
        if plan.final:
            if len(_PLANS) > 4096:  # shapes seen by a long-lived process: keep the cache bounded
                _PLANS.clear()
            _PLANS[key] = plan
    if not q.is_cuda or checks.CHECK_INDICES:
        checks.attention_values(block_table, lengths, k_codes, res_k, res_lengths)
    if token[0] is not None or token[1] is not None:
        checks.check_new_token(*token, q, k_codes)
    if bsz == 0 or hq == 0:
        return out
    ws_m, ws_l, ws_o = _workspace(plan, d, q.device)
    merge = merge and plan.merge_meta is not None and not (q.is_cuda and torch.cuda.is_current_stream_capturing())
    cnt = _counts(plan, q.device) if merge else res_lengths  # res_lengths: a placeholder pointer unless merging
    fast_key = (key, merge) if plan.final and t.fast_launch else None
    kernel = _SPLIT(fast_key, plan.grid, _split_args(
        plan, q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v, res_lengths,
        ws_m, ws_l, ws_o, new_k, new_v, out, cnt, sm_scale, sink_logits), plan.merge_meta if merge else plan.meta)
    if not plan.final:
        _RESIDENT.setdefault(plan.rkey, _resident_of(kernel, q.device) or RESIDENT_DEFAULT)
    if not merge:
        _REDUCE(fast_key, plan.reduce_grid, _reduce_args(plan, ws_m, ws_l, ws_o, out, hq, sink_logits),
                plan.reduce_meta)
    return out


def _cuda_index(t: torch.Tensor) -> int:
    """The CUDA device index of ``t``, -1 on the CPU."""
    return t.get_device()


class _Ready:
    """What :class:`DecodeRunner` keeps from a first run to launch the same kernels again."""

    __slots__ = ("qshape", "qstride", "dtype", "index", "stream", "scale", "tuning", "new", "nk", "nv", "rl_dtype",
                 "align", "split", "reduce", "grid", "reduce_grid", "oshape", "keep", "sink")


class DecodeRunner:
    """The decode op split into plan and run (FlashInfer's style), for a caller that attends over the same pages
    again and again: the cache's layer between two changes of its block table, i.e. every decode step but a flush.

    Built for one block table, lengths, page pool and window (``res_k``/``res_v``); :meth:`run` takes what changes
    per step: the queries, the window lengths, the softmax scale and optionally the step's token (``new_k``/
    ``new_v``) and learned sink logits (``sink_logits``), as in :func:`paged_decode_attention`. The first run is an
    ordinary call of :func:`paged_decode_attention` (it plans, compiles and checks everything). Later runs with the
    same shapes, strides, dtypes, settings, stream and pointer alignment launch the compiled kernels directly with
    the first run's argument list, only the changing pointers replaced: no plan key, no checks of the fixed tensors.
    Otherwise (a CUDA graph being captured, a profiler's launch hook, the interpreter, ``fast_launch`` off,
    ``KIVI_CHECK_INDICES=1``, a change, of the default tuning too) a run is the ordinary call. ``tuning``: as in
    :func:`paged_decode_attention` (None: ``tuning.DEFAULT.decode`` at each run). The fixed tensors may be written
    to, not replaced or resized: build a new runner then (the cache does, whenever its block table or pool tensors
    change).
    """

    def __init__(self, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v,
                 key_bits: int, value_bits: int, group_size: int, sliding_window: int | None = None, *,
                 tuning: _tuning.DecodeTuning | None = None):
        checks.check_sliding_window(sliding_window)
        self.fixed = (block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v)
        self.bits = (key_bits, value_bits, group_size)
        self.sliding_window = sliding_window
        self.tuning = tuning
        # the first runs' launches, one with and one without the step's token (the cache's decode steps pass it, its
        # flush steps do not: one template would be replaced, with an ordinary call, twice per flush)
        self._ready: dict[tuple, _Ready] = {}
        self.fast_runs = 0  # for tests

    def run(self, q, res_lengths, sm_scale: float, new_k=None, new_v=None, sink_logits=None):
        """Attention of one query token per sequence, ``q`` ``[B, Hq, D]``; returns ``[B, Hq, D]``."""
        which = (new_k is None, sink_logits is None)
        t = _tuning.DEFAULT.decode if self.tuning is None else self.tuning
        r = self._ready.get(which)
        if r is not None and r.tuning is t:
            out = self._launch(r, q, res_lengths, sm_scale, new_k, new_v, sink_logits)
            if out is not None:
                return out
        bt, ql, kc, ks, kz, vc, vs, vz, rk, rv = self.fixed
        out = paged_decode_attention(q, bt, ql, kc, ks, kz, vc, vs, vz, rk, rv, res_lengths, *self.bits, sm_scale,
                                     new_k=new_k, new_v=new_v, sliding_window=self.sliding_window,
                                     sink_logits=sink_logits, tuning=t)
        r = self._prepare(q, res_lengths, sm_scale, new_k, new_v, out, sink_logits, t)
        if r is None:
            self._ready.pop(which, None)
        else:
            self._ready[which] = r
        return out

    def _launch(self, r: _Ready, q, rl, sm_scale, new_k, new_v, sink=None):
        """The direct launch, or None where the first run's kernels and arguments do not apply."""
        if (q.shape != r.qshape or q.stride() != r.qstride or q.dtype != r.dtype or sm_scale != r.scale
                or rl.dtype != r.rl_dtype or rl.stride(-1) != 1 or (new_k is None) != (r.new is None)
                or (new_v is None) != (r.new is None) or _cuda_index(rl) != r.index):
            return None  # (a tensor on another device goes the ordinary way, whose checks name it)
        if (sink is None) != (r.sink is None) or (sink is not None and (
                sink.dtype != r.sink[0] or sink.shape != r.sink[1] or sink.stride(-1) != 1
                or _cuda_index(sink) != r.index)):
            return None
        if new_k is not None and (new_v is None or new_k.shape != r.new or new_v.shape != r.new
                                  or new_k.stride() != r.nk or new_v.stride() != r.nv or new_k.dtype != r.dtype
                                  or new_v.dtype != r.dtype or _cuda_index(new_k) != r.index
                                  or _cuda_index(new_v) != r.index):
            return None
        if (torch.cuda.current_device() != r.index or _cuda_index(q) != r.index
                or torch.cuda.is_current_stream_capturing() or not no_launch_hooks()):
            return None
        stream = torch._C._cuda_getCurrentRawStream(r.index)
        if stream != r.stream:
            return None
        qp, rp = q.data_ptr(), rl.data_ptr()
        nkp, nvp = (new_k.data_ptr(), new_v.data_ptr()) if new_k is not None else (0, 0)
        sp = sink.data_ptr() if sink is not None else 0
        if (qp % 16 == 0, rp % 16 == 0, nkp % 16 == 0, nvp % 16 == 0, sp % 16 == 0) != r.align:
            return None
        out = torch.empty(r.oshape, dtype=r.dtype, device=q.device)
        op = out.data_ptr()
        kernel, call, consts = r.split  # the workspace pointers are fixed (the shared workspace of r.stream)
        call[_A_Q], call[_A_RLEN], call[_A_OUT] = qp, rp, op
        if new_k is not None:
            call[_A_NK], call[_A_NV] = nkp, nvp
        if sink is not None:
            call[_A_SINK] = sp
        g0, g1 = r.grid
        kernel.run(g0, g1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *call, *consts)
        if r.reduce is not None:
            kernel, call, consts = r.reduce
            call[3] = op
            if sink is not None:
                call[4] = sp
            g0, g1 = r.reduce_grid
            kernel.run(g0, g1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *call, *consts)
        self.fast_runs += 1
        return out

    def _prepare(self, q, rl, sm_scale, new_k, new_v, out, sink=None, t=None) -> _Ready | None:
        """After an ordinary run under the decode settings ``t``: the compiled kernels and argument lists it used,
        when a direct launch can repeat it (else None: every run stays ordinary)."""
        index = _cuda_index(q)
        t = _decode_tuning(t)
        if (not t.fast_launch or checks.CHECK_INDICES or interpreting() or index < 0
                or torch.cuda.is_current_stream_capturing()):
            return None  # (KIVI_CHECK_INDICES=1: the index values are checked by the ordinary call, on every run)
        bt, ql, kc, ks, kz, vc, vs, vz, rk, rv = self.fixed
        nk3, nv3 = new_k, new_v
        if new_k is not None and new_k.dim() == 4:
            nk3, nv3 = new_k.select(2, 0), new_v.select(2, 0)
        contiguous = (q, bt, ql, rk, rv, rl) + (() if new_k is None else (nk3, nv3)) + (() if sink is None else (sink,))
        if any(t.stride(-1) != 1 for t in contiguous) or index != torch.cuda.current_device():
            return None  # the ordinary call made contiguous copies: nothing to repeat
        key = _plan_key(q, bt, ql, kc, ks, kz, vc, vs, vz, rk, rv, rl, out, *self.bits, None, False, False, nk3, nv3,
                        self.sliding_window, sink, t)
        plan = _PLANS.get(key)
        if plan is None or not plan.final or q.shape[0] == 0 or q.shape[1] == 0:
            return None
        merge = plan.merge_meta is not None
        d = q.shape[2]
        ws_m, ws_l, ws_o = _workspace(plan, d, q.device, shared=True)
        cnt = _counts(plan, q.device) if merge else rl
        args = _split_args(plan, q, bt, ql, kc, ks, kz, vc, vs, vz, rk, rv, rl, ws_m, ws_l, ws_o, nk3, nv3, out, cnt,
                           sm_scale, sink)
        split = _SPLIT.compiled((key, merge), args)
        rargs = _reduce_args(plan, ws_m, ws_l, ws_o, out, q.shape[1], sink)
        red = None if merge else _REDUCE.compiled((key, merge), rargs)
        if split is None or (red is None and not merge):
            return None
        r = _Ready()
        r.qshape, r.qstride, r.dtype, r.index = q.shape, q.stride(), q.dtype, index
        r.stream = torch._C._cuda_getCurrentRawStream(r.index)
        r.scale, r.tuning, r.rl_dtype, r.oshape = sm_scale, t, rl.dtype, out.shape
        r.new = None if new_k is None else new_k.shape
        r.nk, r.nv = (None, None) if new_k is None else (new_k.stride(), new_v.stride())
        nkp, nvp = (new_k.data_ptr(), new_v.data_ptr()) if new_k is not None else (0, 0)
        sp = sink.data_ptr() if sink is not None else 0
        r.align = (q.data_ptr() % 16 == 0, rl.data_ptr() % 16 == 0, nkp % 16 == 0, nvp % 16 == 0, sp % 16 == 0)
        r.sink = None if sink is None else (sink.dtype, sink.shape)
        r.keep = (cnt, ws_o)  # the merge's counts and the workspace: their addresses are in the argument lists
        r.grid, r.reduce_grid = plan.grid, plan.reduce_grid

        def template(launch, launch_args):  # the argument list with every tensor as its address
            positions, kernel, consts = launch
            call = list(launch_args)
            for i in positions:
                call[i] = call[i].data_ptr()
            return kernel, call, consts

        r.split = template(split, args)
        r.reduce = None if merge else template(red, rargs)
        return r


# ----------------------------------------------------------------------------- prefix

PREFIX_SLICE_BYTES = 512 << 20  # working set of one batch slice of the prefix path


def paged_prefix_attention(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                           res_k, res_v, res_lengths, new_k, new_v, new_mask, key_bits: int, value_bits: int,
                           group_size: int, sm_scale: float, *, batch_slice: int | None = None,
                           sliding_window: int | None = None, sink_logits=None):
    """Triton-assisted twin of :func:`kivi_cache.reference.paged_prefix_attention` (several query tokens
    per sequence over the quantized past: chunked prefill, continued generation, assisted decoding).

    A slice of the batch at a time: its pages are dequantized by the Triton dequant kernel into a
    buffer of that slice's history only, the residual window and the new tokens are appended, and
    ``torch.nn.functional.scaled_dot_product_attention`` (a fused kernel on the GPU: no score matrix
    in memory) runs over it with the query heads of each KV head stacked along the query axis
    (grouped-query attention without repeating keys). Slices hold at most ``PREFIX_SLICE_BYTES``
    (512 MiB) of keys, values and mask; ``batch_slice`` fixes the sequences per slice instead.
    One device sync (``lengths.max()``). ``sliding_window``: as in the reference. ``sink_logits`` (``[Hq]``, learned
    attention sinks): one more key per sequence that every query sees, on extra channels that only it and the queries
    fill (:func:`.sinks.sink_channels`: its logit is the sink to fp32 accuracy, the other keys' are
    unchanged), with a zero value: the fused kernel then normalizes by the sum with the sink's term included.
    """
    checks.check_sliding_window(sliding_window)
    checks.check_sm_scale(sm_scale)
    checks.check_sink_logits(sink_logits, q)
    checks.check_attention(q, block_table, lengths, (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), res_k,
                           res_v, res_lengths, key_bits, value_bits, group_size)
    checks.check_prefix_chunk(q, new_k, new_v, new_mask, k_codes.shape[1])
    check_pool_strides((k_codes, k_scale, k_zero, v_codes, v_scale, v_zero))
    bsz, hq, ql, d = q.shape
    _check_common(d, k_codes, k_scale, key_bits, value_bits, group_size)
    _, hkv, p, _ = k_codes.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if batch_slice is not None and (isinstance(batch_slice, bool) or not isinstance(batch_slice, int)
                                    or batch_slice < 1):
        raise ValueError(f"batch_slice must be None (by memory) or an int >= 1 (sequences per slice), got "
                         f"{batch_slice!r}")
    out = torch.empty_like(q)
    if bsz == 0 or ql == 0:
        return out
    grp = hq // hkv
    dt = q.dtype
    t_max = int(lengths.max())
    c = res_k.shape[2]
    s_len = t_max + c + ql
    sink = sink_logits is not None
    d2 = d + SINK_CHANNELS if sink else d  # the sink key's channels (zeros for every other key and value)
    s_pad = -(-(s_len + sink) // 16) * 16  # aligned key axis for the fused kernels' mask; pads are masked out
    if batch_slice is None:
        elt = torch.finfo(dt).bits // 8
        per_seq = 2 * hkv * s_pad * d2 * elt + grp * ql * s_pad * (1 + elt) + hq * ql * (d + d2) * elt
        batch_slice = max(1, PREFIX_SLICE_BYTES // per_seq)
    pos = torch.arange(s_pad, device=q.device)
    if sink:  # the query heads' halves of sink / scale (the sum is the sink to fp32 accuracy)
        q_sink = sink_channels(sink_logits, sm_scale, dt)
        q_sink = q_sink.reshape(hkv, grp, 1, d2 - d).expand(hkv, grp, ql, d2 - d)
    for b0 in range(0, bsz, batch_slice):
        sl = slice(b0, min(bsz, b0 + batch_slice))
        n = sl.stop - sl.start
        k = torch.zeros(n, hkv, s_pad, d2, dtype=dt, device=q.device)
        v = torch.zeros_like(k)
        if t_max:  # straight into the slice's buffer (the kernel converts to the buffer's dtype)
            dequantize_pages(block_table[sl], lengths[sl], k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                             key_bits, value_bits, group_size, max_len=t_max,
                             out=(k[:, :, :t_max, :d], v[:, :, :t_max, :d]))
        # the window's slots past res_lengths hold no token (anything: NaN would pass through a zero weight): zeros
        win = (torch.arange(c, device=q.device)[None, :] < res_lengths[sl].long()[:, None])[:, None, :, None]
        k[:, :, t_max:t_max + c, :d] = torch.where(win, res_k[sl], 0)
        v[:, :, t_max:t_max + c, :d] = torch.where(win, res_v[sl], 0)
        k[:, :, t_max + c:s_len, :d] = new_k[sl]
        v[:, :, t_max + c:s_len, :d] = new_v[sl]
        if sink:
            k[:, :, s_len, d:d + 2] = 1
        hist = pos[None, :] < lengths[sl].long()[:, None]
        hist |= ((pos[None, :] >= t_max) & (pos[None, :] < t_max + res_lengths[sl].long()[:, None]))
        if sliding_window is None:
            mask = hist[:, None, :].expand(n, ql, s_pad).clone()
        else:  # stored token index of each key (pages, then the window) against each query's (after them)
            index = torch.where(pos[None, :] < t_max, pos[None, :], lengths[sl].long()[:, None] + pos[None, :] - t_max)
            first = lengths[sl].long() + res_lengths[sl].long()
            queries = first[:, None] + torch.arange(ql, device=q.device)[None, :]
            mask = hist[:, None, :] & (queries[:, :, None] - index[:, None, :] < sliding_window)
        mask[:, :, t_max + c:s_len] = new_mask[sl]
        nothing = None
        if sink:
            mask[:, :, s_len] = True  # every query sees the sink (so none has nothing to attend to)
        else:  # a query with nothing to attend to (padding): a defined softmax here, zeros out (as the reference)
            nothing = ~mask.any(-1)
            mask[:, :, 0] |= nothing
        mask = mask[:, None].expand(n, grp, ql, s_pad).reshape(n, 1, grp * ql, s_pad)
        if sink:
            qs = torch.cat([q[sl].reshape(n, hkv, grp, ql, d), q_sink.expand(n, hkv, grp, ql, d2 - d)],
                           dim=-1).reshape(n, hkv, grp * ql, d2)
        else:
            qs = q[sl].reshape(n, hkv, grp * ql, d)
        o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=float(sm_scale))
        o = o[..., :d].reshape(n, hq, ql, d)
        out[sl] = o if nothing is None else o.masked_fill(nothing[:, None, :, None], 0)
    return out

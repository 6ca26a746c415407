"""The decode op's split (flash-decoding) kernel, ``_decode_split_kernel``, and the ``@triton.jit`` helpers only it
uses (online softmax, accumulators, key and value scale-pair loads).

What it computes: for each sequence ``b`` and KV head ``h``, the attention of the ``GROUP = Hq // Hkv`` query heads
of ``h`` over a share of the sequence's tokens, as one partial ``(max, sum, acc)`` per query head (exp2 domain,
unnormalized) in an fp32 workspace ``[B * Hq, NS + NR, (D)]``. :mod:`.decode_merge` merges the partials; with
``MERGE`` the last program of each ``(b, h)`` to finish merges them itself (:func:`.decode_merge._merge_pair`).

Grid ``(B * Hkv, NS + NR)``, one warp per program by default. Program ``(b, h, s)`` holds all query heads of KV head
``h``, so every page is read once per KV head. For ``s < NS`` it walks its share of the sequence's pages
(``ceil(pages_b / NS)`` pages, computed in-kernel from ``lengths[b]``: no host sync; with ``SLIDING`` shares of the
pages from the first one holding a visible token) one step of ``BLOCK`` tokens (whole key groups of ``G`` tokens
inside one page) at a time. Programs ``s = NS + c`` read chunk ``c`` of the full-precision residual window
(attention sinks included): slots ``[c RCH, (c + 1) RCH)`` of ``res_k/res_v[b, h, :res_lengths[b]]``
(:func:`.decode_plan.window_chunk`: the whole window in one program, or chunks where the pairs are few).

What it reads (``P`` tokens per page; the packed layouts are :mod:`kivi_cache.quant`'s, the shapes those
:func:`.checks.check_pool` checks):

* ``q`` ``[B, Hq, D]``; ``block_table`` ``[B, pages]``; ``lengths`` ``[B]``, the tokens stored in pages;
* key codes ``[NP, Hkv, P, D * KBITS / 8]``, read as int32 words: one row per token, planar (bits
  ``[k KBITS, (k + 1) KBITS)`` of byte ``j`` hold channel ``j + k D / planes``, ``planes = 8 / KBITS``), so each bit
  plane gives one ``[BLOCK, D / planes]`` tile (token rows); key scales and zeros ``[NP, Hkv, P / G, D]``, one row
  per key group of ``G`` tokens;
* value codes ``[NP, Hkv, D, P * VBITS / 8]``, read as int32 words: one row per channel, packed along the page's
  tokens; value scales and zeros ``[NP, Hkv, D / G, P]``, one row per value group of ``G`` channels, token-contiguous
  (two tokens' scales are one int32 load);
* the window ``res_k``/``res_v`` ``[B, Hkv, C, D]`` and ``res_lengths`` ``[B]``; with ``NEWKV`` the step's token
  ``nk``/``nv`` ``[B, Hkv, D]``, which the program of the chunk holding slot ``res_lengths[b] - 1`` stores there
  before reading its slots.

The MMAs are transposed so that tokens and channels fill the 16-row side and the query heads the narrow side:
``S^T = K q^T`` (``[BLOCK, GP]``) and ``acc^T += V^T P^T`` (``[W, GP]``), GP = GROUP rounded up to a power of two
(no padding to 16 rows). Codes are dequantized in registers by :mod:`.unpack` (inline PTX on the GPU: prmt/shift/lop3
into the mantissa of 1.0 and one packed fma with folded scales). A value sub-tile of ``W = min(G, 32)`` channels (one
value group, one accumulator each) gives one ``V^T`` tile ``[W, BLOCK / planes]`` per bit plane whose registers
already hold the pairs of consecutive tokens the MMA operand needs (ODD pairs of a word: bytes ``q, q + 2``), so no
tile is transposed through shared memory; each plane's MMA takes the rows of ``P^T`` of its tokens (``plane_rows``).
Key pairs for 64-token groups hold channels ``(4w + p, 4w + p + 2)`` ("ODD": one shift of the word instead of byte
shuffles; q's rows in that order, ``_qrows``). Whole steps run in an unmasked copy of the loop, a last partial step in
a masked one. Online softmax in the exp2 domain. ``KASM``/``VASM`` off (under the interpreter, with fp32 dots or
8-bit codes, and with ``DecodeTuning(unpack="plain")``): no inline PTX. ``tests/sass/sass_decode.py`` compiles
this kernel alone to read its SASS.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_merge import _merge_pair
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
    q_ptr,  # [B, Hq, D] queries
    bt_ptr,  # [B, W] int32 block table (page ids; entries past a sequence's pages are never read)
    len_ptr,  # [B] int32 quantized tokens per sequence (in pages)
    kw_ptr,  # [NP, Hkv, P, D * KBITS / 32] int32 words of key codes (k_codes viewed as int32)
    ks_ptr, kz_ptr,  # [NP, Hkv, P / G, D] key scales and zero points
    vw_ptr,  # [NP, Hkv, D, P * VBITS / 32] int32 words of value codes (channel rows packed along tokens)
    vs_ptr, vz_ptr,  # [NP, Hkv, D / G, P] value scales and zero points
    rk_ptr, rv_ptr,  # [B, Hkv, C, D] full-precision window (sinks first)
    rlen_ptr,  # [B] int32 window tokens per sequence
    m_ws, l_ws, o_ws,  # [B * Hq, NS + NR(, D)] fp32 partial max, sum and output of every program
    nk_ptr, nv_ptr,  # [B, Hkv, D] the step's token, written into the window first (NEWKV)
    out_ptr,  # [B, Hq, D] output (MERGE)
    cnt_ptr,  # [B * Hkv] int32 arrival counts of the programs of each pair (MERGE)
    sink_ptr,  # [Hq] learned sink logits (SINK)
    qk_scale, Hkv, NS, RCH, SWIN,  # softmax scale * log2(e); KV heads; paged splits; window slots per program;
    # sliding window (tokens)
    s_qb, s_qh, s_btb,  # strides (in elements) of q's batch and head dims, the block table's rows
    s_kcp, s_kch, s_ksp, s_ksh, s_ksg,  # key words: page, head; key scales: page, head, group
    s_vcp, s_vch, s_vsp, s_vsh,  # value words: page, head; value scales: page, head
    s_rkb, s_rkh, s_rkt, s_rvb, s_rvh, s_rvt,  # window keys / values: batch, head, token
    s_nkb, s_nkh, s_nvb, s_nvh, s_ob, s_oh,  # the step's key / value: batch, head; out: batch, head
    GROUP: tl.constexpr,  # query heads per KV head
    GP: tl.constexpr,  # query-head rows of the transposed MMAs: GROUP rounded up to a power of two
    D: tl.constexpr, P: tl.constexpr, G: tl.constexpr,  # head_dim, tokens per page, group size
    BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    DOT_F32: tl.constexpr, KASM: tl.constexpr, VASM: tl.constexpr, BF16: tl.constexpr,
    PSTAGES: tl.constexpr, RSTAGES: tl.constexpr,  # pipeline depths of the paged and window loops (_stages)
    NEWKV: tl.constexpr = 0,  # the window's newest token (rlen - 1) is first written from nk/nv (the op's new_k/v)
    MERGE: tl.constexpr = 0,  # the last program of a (sequence, KV head) merges the partials into out (no 2nd kernel)
    BM: tl.constexpr = 1,  # MERGE: next power of two of the programs per pair (NS + window chunks)
    BSM: tl.constexpr = 1,  # MERGE: partials per merge step
    VHINT: tl.constexpr = 0,  # value alignment hint: the value words' offset declared a multiple of a step's words
    KSZ: tl.constexpr = 0,  # key scale+zero: 2/4-bit keys' scale and zero words of every plane in one load (_ksz)
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

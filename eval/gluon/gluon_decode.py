"""Gluon spike: the paged int4 decode loop with the packed codes loaded from global memory straight into
registers in the mma_v2 B-operand layout (no shared memory, no cp.async).

Fixed configuration: 4/4 bits, group 32, head_dim 128, page 64, 64-token steps, GQA 4 query rows (padded to
16: the MMA's M), one warp per program. Layout of the stores as in kivi_cache (kernels/attention.py):
  keys   kw int32 [pages, Hkv, P, 16]  (token row of 64 bytes; byte j: channel j (low nibble), j + 64 (high))
         ks/kz fp16 [pages, Hkv, P/G, D] (per channel, per 32-token group)
  values vw int32 [pages, Hkv, D, P/8] (channel rows packed along tokens: word w, byte q + 2h, nibble k holds
         token 8w + 4k + 2q + h, kivi_cache.quant.pack_tokens)
         vs/vz fp16 [pages, Hkv, D/G, P] (per token, per 32-channel group)

The MMAs are FA2-style (not transposed): S = Q K^T (A = q [16, 128], B = K^T [128, 64]) and O += P V (A = P
[16, 64], taken from S's accumulator registers with no data movement, B = V [64, 128]).

Each lane's B-operand slots are assigned to codes so that every lane loads exactly the words whose codes
it needs, and each word unpacks with its ODD pairs (bytes q, q + 2 in the two halves of one register):
* K^T: k-slot k = e + 2c + 8h + 16wt + 64p (c = lane % 4; e, h, wt, p register bits) holds channel
  64p + 4(4c + wt) + h + 2e (word 4c + wt of the token row: lane c loads words 4c..4c+3, one 16-byte load);
  q's columns are permuted the same way (once, before the loop).
* V: k-slot k = e + 2c + 8h + 16p + 32u holds token 8(2c + u) + 4p + 2h + e (word 2c + u of a channel row:
  one 8-byte load of words 2c, 2c + 1). S's column n is token pi(n) with the same formula (n = k), so P's
  A-operand registers (= S's accumulator registers) already hold the right tokens; the key rows are loaded in
  that token order (column n = 8j + 4g + nl of K^T: lane nl + 4g of its quad row; g = bit 2 of n = the key
  group of token pi(n), so every lane needs the key scales of one group only).
"""

import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
QA = gl.constexpr(gl.DotOperandLayout(0, MMA, 2))
OPB = gl.constexpr(gl.DotOperandLayout(1, MMA, 2))
# key words of one plane-pair: [J = 8 (n8,n16,n32), G = 2 (n4), NL = 4 (n1,n2), W = 16 words]
LK = gl.constexpr(gl.BlockedLayout([1, 1, 1, 4], [1, 2, 4, 4], [1, 1, 1, 1], [3, 2, 1, 0]))
# value words of one 32-channel group: [JL = 4 (n8,n16), R = 8 (n1,n2,n4), C = 4, U = 2]: word 2c + u
LV = gl.constexpr(gl.BlockedLayout([1, 1, 1, 2], [1, 8, 4, 1], [1, 1, 1, 1], [3, 2, 1, 0]))
LV8 = gl.constexpr(gl.BlockedLayout([1, 1, 1, 8], [1, 8, 4, 1], [1, 1, 1, 1], [3, 2, 1, 0]))  # value scale runs
LK32 = gl.constexpr(gl.BlockedLayout([1, 1, 1, 8], [1, 2, 4, 4], [1, 1, 1, 1], [3, 2, 1, 0]))  # key scale runs
VEC = gl.constexpr(int(os.environ.get("GD_VEC", 1)))
# VEC: vectorized scale loads. PF: 1 prefetches the next page index, 2 also its key words
PF = gl.constexpr(int(os.environ.get("GD_PF", 0)))
LQ = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0]))  # q load (outside the loop)


@gluon.constexpr_function
def _slice_to(layout, d, rank):
    for i in reversed(range(rank)):
        if i != d:
            layout = gl.SliceLayout(i, layout)
    return layout


@gluon.jit
def _idx(n: gl.constexpr, d: gl.constexpr, L: gl.constexpr, R: gl.constexpr):
    """arange(0, n) along dim d of a rank-R tensor of layout L (size 1 in the other dims)."""
    x = gl.arange(0, n, layout=_slice_to(L, d, R))
    for i in gl.static_range(R):
        if i != d:
            x = gl.expand_dims(x, i)
    return x


# one word -> 8 fp16 (4 ODD pairs), dequantized: pair (q, k) = bytes (q, q + 2), nibble k, its code moved to
# mantissa bits 6..9 of 16.0 (v = 16 + c exactly) and v * s + (z - 16 s) (zero points folded outside).
# outputs: q0k0 lo/hi, q1k0 lo/hi, q0k1 lo/hi, q1k1 lo/hi (each pair: low half = byte q, high half = byte q + 2)
_UNPACK = gl.constexpr("""{
.reg .b32 t<4>, v<4>, r<4>;
shl.b32 t0, $8, 6;
shr.u32 t1, $8, 2;
shl.b32 t2, $8, 2;
shr.u32 t3, $8, 6;
lop3.b32 v0, t0, 0x03C003C0, 0x4C004C00, 0xEA;
lop3.b32 v1, t1, 0x03C003C0, 0x4C004C00, 0xEA;
lop3.b32 v2, t2, 0x03C003C0, 0x4C004C00, 0xEA;
lop3.b32 v3, t3, 0x03C003C0, 0x4C004C00, 0xEA;
fma.rn.f16x2 r0, v0, $9, $10;
fma.rn.f16x2 r1, v1, $11, $12;
fma.rn.f16x2 r2, v2, $13, $14;
fma.rn.f16x2 r3, v3, $15, $16;
mov.b32 {$0, $1}, r0;
mov.b32 {$2, $3}, r1;
mov.b32 {$4, $5}, r2;
mov.b32 {$6, $7}, r3;
}""")
_UNPACK_CON = gl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r,r,r")

# key scales: natural pairs a = (4w, 4w+1), b = (4w+2, 4w+3) of s and z -> ODD pairs x = 0: (4w, 4w+2),
# x = 1: (4w+1, 4w+3), zero points folded: z - 16 s. outputs s0, z0, s1, z1
_KSC = gl.constexpr("""{
.reg .b32 z0, z1, m;
mov.b32 m, 0xCC00CC00;
prmt.b32 $0, $4, $5, 0x5410;
prmt.b32 $2, $4, $5, 0x7632;
prmt.b32 z0, $6, $7, 0x5410;
prmt.b32 z1, $6, $7, 0x7632;
fma.rn.f16x2 $1, $0, m, z0;
fma.rn.f16x2 $3, $2, m, z1;
}""")
# value scales: one natural pair (two consecutive tokens) of s and z -> (s, z - 16 s)
_VSC = gl.constexpr("{.reg .b32 m; mov.b32 m, 0xCC00CC00; fma.rn.f16x2 $0, $1, m, $2;}")


@gluon.jit
def _unpack(w, s00, z00, s10, z10, s01, z01, s11, z11):
    """word tile -> 8 fp16 tiles: (q0k0 lo, hi, q1k0 lo, hi, q0k1 lo, hi, q1k1 lo, hi); (sqk, zqk) the folded
    scale pairs of pair q, nibble k (broadcast to w)."""
    return gl.inline_asm_elementwise(_UNPACK, _UNPACK_CON, [w, s00, z00, s10, z10, s01, z01, s11, z11],
                                     dtype=(gl.float16, ) * 8, is_pure=True, pack=1)


@gluon.jit
def _j3(a0, a1, b0, b1, c0, c1, d0, d1):
    """(x[e=0], x[e=1]) for (h, p) = (0,0), (1,0), (0,1), (1,1) -> x[..., e, h, p]"""
    e00 = gl.join(a0, a1)
    e10 = gl.join(b0, b1)
    e01 = gl.join(c0, c1)
    e11 = gl.join(d0, d1)
    return gl.join(gl.join(e00, e10), gl.join(e01, e11))


@gluon.jit
def _key_tile(kw, s00, z00, s10, z10, s01, z01, s11, z11):
    """key words [8, 2, 4, 16] (LK) -> K^T [128, 64] fp16 in the B-operand layout."""
    a0, a1, b0, b1, c0, c1, d0, d1 = _unpack(kw, s00, z00, s10, z10, s01, z01, s11, z11)
    x = _j3(a0, a1, b0, b1, c0, c1, d0, d1)  # [j, g, nl, w, e, h, p]
    x = gl.reshape(x, [8, 2, 4, 4, 4, 2, 2, 2])  # [j, g, nl, c, wt, e, h, p]
    x = gl.permute(x, [7, 4, 6, 3, 5, 0, 1, 2])  # [p, wt, h, c, e, j, g, nl]
    x = gl.reshape(x, [128, 64])
    return gl.convert_layout(x, OPB, assert_trivial=TRIVIAL)


@gluon.jit
def _value_tile(vw, s00, z00, s10, z10, s01, z01, s11, z11):
    """value words of one 32-channel group [4, 8, 4, 2] (LV) -> V [64 token slots, 32 channels] fp16, B operand."""
    a0, a1, b0, b1, c0, c1, d0, d1 = _unpack(vw, s00, z00, s10, z10, s01, z01, s11, z11)
    x = _j3(a0, a1, b0, b1, c0, c1, d0, d1)  # [jl, r, c, u, e, h, p]
    x = gl.permute(x, [3, 6, 5, 2, 4, 0, 1])  # [u, p, h, c, e, jl, r]
    x = gl.reshape(x, [64, 32])
    return gl.convert_layout(x, OPB, assert_trivial=TRIVIAL)


TRIVIAL = gl.constexpr(True)
# PAD: drop the MMA's padding rows 8..15 from the softmax and the rescale
PAD = gl.constexpr(int(os.environ.get("GD_PAD", 1)))
# PADQ: q's padding rows as constant zeros (ptxas then copies operand quads: more MOVs)
PADQ = gl.constexpr(int(os.environ.get("GD_PADQ", 0)))
# PADP: P's padding rows: 0 constant zeros, 1 a copy of rows 0..7 (no zero registers to build)
PADP = gl.constexpr(int(os.environ.get("GD_PADP", 1)))


@gluon.jit
def _top(x):
    """[16, N] (MMA rows r, r + 8 per lane) -> rows 0..7 [8, N] (a register subset, no data movement)."""
    x = gl.permute(gl.reshape(x, [2, 8, x.shape[1]]), [1, 2, 0])
    top, bot = gl.split(x)
    return top


@gluon.jit
def _dup(top, layout: gl.constexpr):
    """rows 0..7 [8, N] -> [16, N] in ``layout``, rows 8..15 a copy of rows 0..7."""
    x = gl.join(top, top)
    x = gl.reshape(gl.permute(x, [2, 0, 1]), [16, top.shape[1]])
    return gl.convert_layout(x, layout, assert_trivial=TRIVIAL)


@gluon.jit
def _pad(top, fill: gl.constexpr, layout: gl.constexpr):
    """rows 0..7 [8, N] -> [16, N] in ``layout`` with rows 8..15 = fill (constants)."""
    x = gl.join(top, gl.full(top.shape, fill, top.dtype, top.type.layout))
    x = gl.reshape(gl.permute(x, [2, 0, 1]), [16, top.shape[1]])
    return gl.convert_layout(x, layout, assert_trivial=TRIVIAL)


@gluon.jit
def _value_group(gi: gl.constexpr, acc, pa, vw_pg, vs_pg, vz_pg):
    """acc [16, 32] += P V_g for value group gi (channels 32 gi ..), codes and scales at the page's row
    pointers: vw_pg int32 words (channel rows of 8 words: the step is one page), vs_pg/vz_pg int32 pairs."""
    jl = _idx(4, 0, LV, 4)
    r = _idx(8, 1, LV, 4)
    c = _idx(4, 2, LV, 4)
    u = _idx(2, 3, LV, 4)
    ch = gi * 32 + jl * 8 + r
    w = gl.load(vw_pg + ch * 8 + (c * 2 + u))
    # scales of value group gi: token pairs; word 2c + u, pair (q, k): tokens 8w + 4k + 2q + {0, 1}: pair index
    # 4w + 2k + q of the group's row of 32 pairs
    if VEC:  # 8 consecutive pairs per lane (words 2c, 2c + 1): one 32-byte run, split in registers
        c8 = _idx(4, 2, LV8, 4)
        i8 = _idx(8, 3, LV8, 4)
        pr8 = gi * 32 + c8 * 8 + i8  # [1, 1, 4, 8]: pair 4(2c + u) + 2k + q
        s00, s10, s01, s11 = _split4(gl.load(vs_pg + pr8))
        z00, z10, z01, z11 = _split4(gl.load(vz_pg + pr8))
    else:
        pr = gi * 32 + (c * 2 + u) * 4  # [1, 1, 4, 2]
        s00 = gl.load(vs_pg + pr)
        s10 = gl.load(vs_pg + pr + 1)
        s01 = gl.load(vs_pg + pr + 2)
        s11 = gl.load(vs_pg + pr + 3)
        z00 = gl.load(vz_pg + pr)
        z10 = gl.load(vz_pg + pr + 1)
        z01 = gl.load(vz_pg + pr + 2)
        z11 = gl.load(vz_pg + pr + 3)
    z00 = gl.inline_asm_elementwise(_VSC, "=r,r,r", [s00, z00], dtype=gl.int32, is_pure=True, pack=1)
    z10 = gl.inline_asm_elementwise(_VSC, "=r,r,r", [s10, z10], dtype=gl.int32, is_pure=True, pack=1)
    z01 = gl.inline_asm_elementwise(_VSC, "=r,r,r", [s01, z01], dtype=gl.int32, is_pure=True, pack=1)
    z11 = gl.inline_asm_elementwise(_VSC, "=r,r,r", [s11, z11], dtype=gl.int32, is_pure=True, pack=1)
    v = _value_tile(w, s00, z00, s10, z10, s01, z01, s11, z11)
    return gl.nvidia.ampere.mma_v2(pa, v, acc)


@gluon.jit
def _split4(x):
    """[1, 1, 4, 8] pairs (u, k, q) -> (q0k0, q1k0, q0k1, q1k1) as [1, 1, 4, 2] (LV)"""
    x = gl.reshape(x, [1, 1, 4, 2, 2, 2])  # [.., c, u, k, q]
    xq0, xq1 = gl.split(x)  # the last dim (q) first: [.., c, u, k] each
    q0k0, q0k1 = gl.split(xq0)
    q1k0, q1k1 = gl.split(xq1)
    return (gl.convert_layout(q0k0, LV, assert_trivial=TRIVIAL), gl.convert_layout(q1k0, LV, assert_trivial=TRIVIAL),
            gl.convert_layout(q0k1, LV, assert_trivial=TRIVIAL), gl.convert_layout(q1k1, LV, assert_trivial=TRIVIAL))


@gluon.jit
def _split2(x):
    """[1, 2, 1, 32] natural pairs -> (a, b) = pairs 2w, 2w + 1 as [1, 2, 1, 16] (LK)"""
    a, b = gl.split(gl.reshape(x, [1, 2, 1, 16, 2]))
    return gl.convert_layout(a, LK, assert_trivial=TRIVIAL), gl.convert_layout(b, LK, assert_trivial=TRIVIAL)


@gluon.jit
def _key_scales(ks_pg, kz_pg, wq, wq32, p: gl.constexpr):
    """folded ODD scale pairs of key plane p: (s00, z00, s10, z10) of x = 0, 1 as [1, 2, 1, 16] int32 (LK)."""
    if VEC:  # the lane's 8 pairs (4 words) in one 32-byte run
        sa, sb = _split2(gl.load(ks_pg + p * 32 + wq32))
        za, zb = _split2(gl.load(kz_pg + p * 32 + wq32))
    else:
        sa = gl.load(ks_pg + p * 32 + wq)
        sb = gl.load(ks_pg + p * 32 + wq + 1)
        za = gl.load(kz_pg + p * 32 + wq)
        zb = gl.load(kz_pg + p * 32 + wq + 1)
    return gl.inline_asm_elementwise(_KSC, "=r,=r,=r,=r,r,r,r,r", [sa, sb, za, zb], dtype=(gl.int32, ) * 4,
                                     is_pure=True, pack=1)


@gluon.jit
def gluon_decode_kernel(q_ptr, bt_ptr, len_ptr, kw_ptr, ks_ptr, kz_ptr, vw_ptr, vs_ptr, vz_ptr,
                        m_ws, l_ws, o_ws, qk_scale, Hkv, NS, s_qb, s_qh, s_btb, s_kcp, s_kch, s_ksp, s_ksh,
                        s_vcp, s_vch, s_vsp, s_vsh, GROUP: gl.constexpr, VALUES: gl.constexpr):
    """grid (B * Hkv, NS): partial (m, l, o) of split s over the paged tokens (whole 64-token steps only: the
    partial last step and the residual window are not in the spike)."""
    P: gl.constexpr = 64
    D: gl.constexpr = 128
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // Hkv
    h = pid % Hkv
    # q rows of the KV head, columns in the K^T slot order: slot k -> channel 64p + 16c + 4wt + h + 2e
    qr = gl.arange(0, 16, layout=gl.SliceLayout(1, LQ))
    k = gl.arange(0, D, layout=gl.SliceLayout(0, LQ))
    ch = (k // 64) * 64 + ((k // 2) % 4) * 16 + ((k // 16) % 4) * 4 + (k // 8) % 2 + 2 * (k % 2)
    qv = gl.load(q_ptr + b * s_qb + (h * GROUP + qr)[:, None] * s_qh + ch[None, :], mask=(qr < GROUP)[:, None],
                 other=0.0)
    qa = gl.convert_layout(qv.to(gl.float16), QA)
    if PADQ:
        qa = _pad(_top(qa), 0.0, QA)

    length = gl.load(len_ptr + b)
    npg = gl.cdiv(length, P)
    pps = gl.cdiv(npg, NS)
    t0 = split * pps * P
    t1 = gl.minimum(t0 + pps * P, length)
    t_full = t0 + gl.maximum(t1 - t0, 0) // P * P

    # key row offsets (loop-invariant): column n = 8j + 4g + nl holds token pi(n) = 8(2c + u) + 4p + 2h + e
    j = _idx(8, 0, LK, 4)
    g = _idx(2, 1, LK, 4)
    nl = _idx(4, 2, LK, 4)
    wk = _idx(16, 3, LK, 4)
    n = j * 8 + g * 4 + nl
    tok = 8 * (2 * ((n // 2) % 4) + n // 32) + 4 * ((n // 16) % 2) + 2 * ((n // 8) % 2) + n % 2
    koff = tok * 16 + wk  # [8, 2, 4, 16]
    # key scale pairs: group g, plane p, word w: natural pairs 2w, 2w + 1 of the plane's 64 channels
    wq = g * (D // 2) + wk * 2  # [1, 2, 1, 16] in int32 pairs (scales [P/G, D] per page: group row of D)
    wq32 = _idx(2, 1, LK32, 4) * (D // 2) + _idx(32, 3, LK32, 4)  # [1, 2, 1, 32]: the same pairs, a and b

    if PAD:
        m_i = gl.max(_top(gl.full([16, 64], float("-inf"), gl.float32, layout=MMA)), axis=1)
        l_i = gl.sum(_top(gl.zeros([16, 64], gl.float32, layout=MMA)), axis=1)
    else:
        m_i = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
        l_i = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, MMA))
    a0 = gl.zeros([16, 32], gl.float32, layout=MMA)
    a1 = gl.zeros([16, 32], gl.float32, layout=MMA)
    a2 = gl.zeros([16, 32], gl.float32, layout=MMA)
    a3 = gl.zeros([16, 32], gl.float32, layout=MMA)
    kw_h = kw_ptr + h * s_kch
    ks_h = (ks_ptr + h * s_ksh).to(gl.pointer_type(gl.int32), bitcast=True)
    kz_h = (kz_ptr + h * s_ksh).to(gl.pointer_type(gl.int32), bitcast=True)
    vw_h = vw_ptr + h * s_vch
    vs_h = (vs_ptr + h * s_vsh).to(gl.pointer_type(gl.int32), bitcast=True)
    vz_h = (vz_ptr + h * s_vsh).to(gl.pointer_type(gl.int32), bitcast=True)
    bt_b = bt_ptr + b * s_btb
    last = gl.maximum(t_full // P - 1, 0)
    if PF >= 1:  # software prefetch (Gluon does not pipeline): the next step's page index (and key words)
        page_n = gl.load(bt_b + gl.minimum(t0 // P, last)).to(gl.int64)
        if PF >= 2:
            kw_n = gl.load(kw_h + page_n * s_kcp + koff)
    for start in range(t0, t_full, P):
        if PF >= 1:
            page = page_n
            page_n = gl.load(bt_b + gl.minimum(start // P + 1, last)).to(gl.int64)
            if PF >= 2:
                kw = kw_n
                kw_n = gl.load(kw_h + page_n * s_kcp + koff)
            else:
                kw = gl.load(kw_h + page * s_kcp + koff)
        else:
            page = gl.load(bt_b + start // P).to(gl.int64)
            kw = gl.load(kw_h + page * s_kcp + koff)
        ks_pg = ks_h + page * (s_ksp // 2)
        kz_pg = kz_h + page * (s_ksp // 2)
        s00, z00, s10, z10 = _key_scales(ks_pg, kz_pg, wq, wq32, 0)
        s01, z01, s11, z11 = _key_scales(ks_pg, kz_pg, wq, wq32, 1)
        kt = _key_tile(kw, s00, z00, s10, z10, s01, z01, s11, z11)
        s = gl.nvidia.ampere.mma_v2(qa, kt, gl.zeros([16, 64], gl.float32, layout=MMA))
        if PAD:
            s = _top(s)
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        if PAD:
            if PADP == 1:
                p16 = _dup(p.to(gl.float16), QA)
            else:
                p16 = _pad(p.to(gl.float16), 0.0, QA)
            al = _pad(alpha[:, None], 1.0, MMA)  # [16, 1]: 1.0 on the padding rows (x * 1.0 folds away)
        else:
            p16 = gl.convert_layout(p.to(gl.float16), QA, assert_trivial=TRIVIAL)
            al = alpha[:, None]
        if VALUES:
            vw_pg = vw_h + page * s_vcp
            vs_pg = vs_h + page * (s_vsp // 2)
            vz_pg = vz_h + page * (s_vsp // 2)
            a0 = _value_group(0, a0 * al, p16, vw_pg, vs_pg, vz_pg)
            a1 = _value_group(1, a1 * al, p16, vw_pg, vs_pg, vz_pg)
            a2 = _value_group(2, a2 * al, p16, vw_pg, vs_pg, vz_pg)
            a3 = _value_group(3, a3 * al, p16, vw_pg, vs_pg, vz_pg)
        else:  # keys only (p stays alive through l_i)
            a0 = a0 * al

    # partials of the GROUP real rows: m, l [B * Hq, NS], o [B * Hq, NS, D]
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    hq = (b * Hkv + h) * GROUP + rows
    rmask = rows < GROUP
    if PAD:
        m_i = gl.max(_pad(m_i[:, None], 0.0, MMA), axis=1)
        l_i = gl.max(_pad(l_i[:, None], 0.0, MMA), axis=1)
    gl.store(m_ws + hq * NS + split, m_i, mask=rmask)
    gl.store(l_ws + hq * NS + split, l_i, mask=rmask)
    cols = gl.arange(0, 32, layout=gl.SliceLayout(0, MMA))
    ob = o_ws + (hq * NS + split)[:, None] * D + cols[None, :]
    gl.store(ob, a0, mask=rmask[:, None])
    gl.store(ob + 32, a1, mask=rmask[:, None])
    gl.store(ob + 64, a2, mask=rmask[:, None])
    gl.store(ob + 96, a3, mask=rmask[:, None])


# ----------------------------------------------------------------------------------------------------------------
# Transposed variant (as kernels/attention.py): S^T = K q^T (A = K [64 tokens, 128 slots], B = q^T [128, 8]) and
# O^T += V^T P^T (A = V^T [32 channels, 64 token slots] per value group, B = P^T [64, 8]). The query heads are the
# MMA's N = 8 (4 real): the padding is in lanes, not registers, and half the HMMAs. P^T goes from S^T's accumulator
# registers to the B-operand registers with one movmatrix.trans per 8x8 block (inline PTX; the accumulator fragment
# of a block is movmatrix's source fragment, its result the B fragment of the transposed block), then relabelled
# (reshape/permute: no data movement) so that Triton sees the B-operand layout.

_MOVT = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")
LQT = gl.constexpr(gl.BlockedLayout([8, 1], [4, 8], [1, 1], [0, 1]))  # q^T load (outside the loop)


@gluon.jit
def _key_tile_t(kw, s00, z00, s10, z10, s01, z01, s11, z11):
    """key words [8, 2, 4, 16] (LK) -> K [64 token rows, 128 slots] fp16 in the A-operand layout."""
    a0, a1, b0, b1, c0, c1, d0, d1 = _unpack(kw, s00, z00, s10, z10, s01, z01, s11, z11)
    x = _j3(a0, a1, b0, b1, c0, c1, d0, d1)  # [j, g, nl, w, e, h, p]
    x = gl.reshape(x, [8, 2, 4, 4, 4, 2, 2, 2])  # [j, g, nl, c, wt, e, h, p]
    x = gl.permute(x, [0, 1, 2, 7, 4, 6, 3, 5])  # [j, g, nl, p, wt, h, c, e]
    x = gl.reshape(x, [64, 128])
    return gl.convert_layout(x, QA, assert_trivial=TRIVIAL)


@gluon.jit
def _value_tile_t(vw, s00, z00, s10, z10, s01, z01, s11, z11):
    """value words of one 32-channel group [4, 8, 4, 2] (LV) -> V^T [32 channels, 64 token slots], A operand."""
    a0, a1, b0, b1, c0, c1, d0, d1 = _unpack(vw, s00, z00, s10, z10, s01, z01, s11, z11)
    x = _j3(a0, a1, b0, b1, c0, c1, d0, d1)  # [jl, r, c, u, e, h, p]
    x = gl.permute(x, [0, 1, 3, 6, 5, 2, 4])  # [jl, r, u, p, h, c, e]
    x = gl.reshape(x, [32, 64])
    return gl.convert_layout(x, QA, assert_trivial=TRIVIAL)


@gluon.jit
def _mask_pairs(x, t, lim):
    """int32 pairs of tokens (t, t + 1): halves of tokens >= lim -> 0 (the partial last step)."""
    return x & (gl.where(t < lim, 0xFFFF, 0) | gl.where(t + 1 < lim, -65536, 0))


@gluon.jit
def _value_words(gi: gl.constexpr, vw_pg):
    """value words of group gi: [4, 8, 4, 2] int32 (LV), channel 32 gi + 8 jl + r, word 2c + u of its row."""
    jl = _idx(4, 0, LV, 4)
    r = _idx(8, 1, LV, 4)
    c = _idx(4, 2, LV, 4)
    u = _idx(2, 3, LV, 4)
    return gl.load(vw_pg + (gi * 32 + jl * 8 + r) * 8 + (c * 2 + u))


@gluon.jit
def _value_group_t(gi: gl.constexpr, acc, pb, w, vs_pg, vz_pg, lim, MASK: gl.constexpr):
    """acc^T [32, 8] += V_g^T P^T for value group gi (see _value_group), w its words (_value_words); MASK: tokens
    >= lim of the step are zeroed (their scale and folded zero pairs: their values may be anything, and 0 * inf is
    NaN)."""
    c = _idx(4, 2, LV, 4)
    u = _idx(2, 3, LV, 4)
    c8 = _idx(4, 2, LV8, 4)
    i8 = _idx(8, 3, LV8, 4)
    pr8 = gi * 32 + c8 * 8 + i8
    s00, s10, s01, s11 = _split4(gl.load(vs_pg + pr8))
    z00, z10, z01, z11 = _split4(gl.load(vz_pg + pr8))
    z00 = gl.inline_asm_elementwise(_VSC, "=r,r,r", [s00, z00], dtype=gl.int32, is_pure=True, pack=1)
    z10 = gl.inline_asm_elementwise(_VSC, "=r,r,r", [s10, z10], dtype=gl.int32, is_pure=True, pack=1)
    z01 = gl.inline_asm_elementwise(_VSC, "=r,r,r", [s01, z01], dtype=gl.int32, is_pure=True, pack=1)
    z11 = gl.inline_asm_elementwise(_VSC, "=r,r,r", [s11, z11], dtype=gl.int32, is_pure=True, pack=1)
    if MASK:  # word 2c + u, pair (q, k): tokens 8w + 4k + 2q + {0, 1}
        tw = (c * 2 + u) * 8
        s00 = _mask_pairs(s00, tw, lim)
        z00 = _mask_pairs(z00, tw, lim)
        s10 = _mask_pairs(s10, tw + 2, lim)
        z10 = _mask_pairs(z10, tw + 2, lim)
        s01 = _mask_pairs(s01, tw + 4, lim)
        z01 = _mask_pairs(z01, tw + 4, lim)
        s11 = _mask_pairs(s11, tw + 6, lim)
        z11 = _mask_pairs(z11, tw + 6, lim)
    v = _value_tile_t(w, s00, z00, s10, z10, s01, z01, s11, z11)
    return gl.nvidia.ampere.mma_v2(v, pb, acc)


@gluon.jit
def _pt_operand(p):
    """P^T [64, 8] fp16 in S^T's accumulator layout -> the B-operand layout: movmatrix.trans per 8x8 block, then a
    relabelling (block-local transpose of the indices) that moves no data."""
    y = gl.inline_asm_elementwise(_MOVT, "=r,r", [p], dtype=gl.float16, is_pure=True, pack=2)
    y = gl.reshape(gl.permute(gl.reshape(y, [8, 8, 8]), [0, 2, 1]), [64, 8])
    return gl.convert_layout(y, OPB, assert_trivial=TRIVIAL)


# ----------------------------------------------------------------------------------------------------------------
# 2-bit codes (transposed kernel, KBITS/VBITS = 2, group 32). One word = 4 bytes x 4 fields of 2 bits; ODD pairs
# (bytes x, x + 2: the two halves of the word) per field k: 8 pairs = 16 codes. The code goes to mantissa bits 8..9
# of 4.0 (v = 4 + c exactly; z folded as z - 4 s); field k of byte x sits at bit 8x + 2k of its half, so the shift is
# 8 - 8x - 2k (x = 1, k = 0: none). One asm block per (word, x): 4 pairs, outputs (k0 lo, hi, k1 lo, hi, ...).
# * keys: token row = 32 bytes = 8 words; byte j holds channels j + 32k (pack). Lane c reads words 2c, 2c + 1 (one
#   8-byte load); slot s = e + 2c + 8h + 16wt + 32k holds channel 8c + 4wt + h + 2e + 32k (word 2c + wt, byte pair
#   x = h, field k). The key rows are loaded in the same token order pi as the 4-bit kernel.
# * values: channel row = 16 bytes = 4 words; word w holds tokens 16w + 4k + 2q + h (pack_tokens) in byte q + 2h,
#   field k. Lane c reads word c (one 4-byte load); slot s = e + 2c + 8h + 16k holds token 16c + 4k + 2h + e, which
#   is pi(s) (k = p + 2u of the 4-bit map): P^T needs nothing new.
def _unpack2_asm(x):
    lines = ["{", ".reg .b32 u<4>, r<4>;"]
    for k in range(4):
        sh = 8 - 8 * x - 2 * k
        if sh > 0:
            lines.append(f"shl.b32 u{k}, $8, {sh};")
        elif sh < 0:
            lines.append(f"shr.u32 u{k}, $8, {-sh};")
        else:
            lines.append(f"mov.b32 u{k}, $8;")
    for k in range(4):
        lines.append(f"lop3.b32 u{k}, u{k}, 0x03000300, 0x44004400, 0xEA;")
    for k in range(4):
        lines.append(f"fma.rn.f16x2 r{k}, u{k}, ${9 + 2 * k}, ${10 + 2 * k};")
    for k in range(4):
        lines.append(f"mov.b32 {{${2 * k}, ${2 * k + 1}}}, r{k};")
    lines.append("}")
    return "\n".join(lines)


_UNPACK2_X0 = gl.constexpr(_unpack2_asm(0))
_UNPACK2_X1 = gl.constexpr(_unpack2_asm(1))
# key scales of 2-bit codes: as _KSC with the fold z - 4 s
_KSC2 = gl.constexpr("""{
.reg .b32 z0, z1, m;
mov.b32 m, 0xC400C400;
prmt.b32 $0, $4, $5, 0x5410;
prmt.b32 $2, $4, $5, 0x7632;
prmt.b32 z0, $6, $7, 0x5410;
prmt.b32 z1, $6, $7, 0x7632;
fma.rn.f16x2 $1, $0, m, z0;
fma.rn.f16x2 $3, $2, m, z1;
}""")
_VSC2 = gl.constexpr("{.reg .b32 m; mov.b32 m, 0xC400C400; fma.rn.f16x2 $0, $1, m, $2;}")
# key words of 2-bit codes [J = 8, G = 2, NL = 4, W = 8] (lane c: words 2c, 2c + 1), their scale pairs per plane
# [1, 2, 1, 16] (lane c: pairs 4c .. 4c + 3 of the plane's 32 channels: one 16-byte run)
LK2 = gl.constexpr(gl.BlockedLayout([1, 1, 1, 2], [1, 2, 4, 4], [1, 1, 1, 1], [3, 2, 1, 0]))
LK2S = gl.constexpr(gl.BlockedLayout([1, 1, 1, 4], [1, 2, 4, 4], [1, 1, 1, 1], [3, 2, 1, 0]))
# value words of one 32-channel group, 2-bit codes: [JL = 4, R = 8, C = 4, 1]: word c of channel 32 gi + 8 jl + r
LV2 = gl.constexpr(gl.BlockedLayout([1, 1, 1, 1], [1, 8, 4, 1], [1, 1, 1, 1], [3, 2, 1, 0]))


@gluon.jit
def _unpack2(w, X: gl.constexpr, s0, z0, s1, z1, s2, z2, s3, z3):
    """2-bit word tile, byte pair X -> 8 fp16 tiles (k0 lo, hi, k1 lo, hi, k2 .., k3 ..); (sk, zk) the folded scale
    pairs of field k (broadcast to w)."""
    if X == 0:
        r = gl.inline_asm_elementwise(_UNPACK2_X0, _UNPACK_CON, [w, s0, z0, s1, z1, s2, z2, s3, z3],
                                      dtype=(gl.float16, ) * 8, is_pure=True, pack=1)
    else:
        r = gl.inline_asm_elementwise(_UNPACK2_X1, _UNPACK_CON, [w, s0, z0, s1, z1, s2, z2, s3, z3],
                                      dtype=(gl.float16, ) * 8, is_pure=True, pack=1)
    return r


@gluon.jit
def _j4(x0, x1):
    """x_h = (k0 lo, hi, k1 lo, hi, k2 lo, hi, k3 lo, hi) of byte pairs h = 0, 1 -> x[..., e, h, k0, k1]"""
    a0, a1, b0, b1, c0, c1, d0, d1 = x0
    e0, e1, f0, f1, g0, g1, i0, i1 = x1
    k0 = gl.join(gl.join(a0, a1), gl.join(e0, e1))  # [.., e, h]
    k1 = gl.join(gl.join(b0, b1), gl.join(f0, f1))
    k2 = gl.join(gl.join(c0, c1), gl.join(g0, g1))
    k3 = gl.join(gl.join(d0, d1), gl.join(i0, i1))
    return gl.join(gl.join(k0, k1), gl.join(k2, k3))


@gluon.jit
def _key_tile2_t(kw, sc0, sc1):
    """2-bit key words [8, 2, 4, 8] (LK2) -> K [64 token rows, 128 slots] fp16 in the A-operand layout; sc0/sc1 the
    folded scale pairs of byte pairs x = 0, 1: (s, z) per field k."""
    s0, z0, s1, z1, s2, z2, s3, z3 = sc0
    x0 = _unpack2(kw, 0, s0, z0, s1, z1, s2, z2, s3, z3)
    s0, z0, s1, z1, s2, z2, s3, z3 = sc1
    x1 = _unpack2(kw, 1, s0, z0, s1, z1, s2, z2, s3, z3)
    x = _j4(x0, x1)  # [j, g, nl, w, e, h, k0, k1]
    x = gl.reshape(x, [8, 2, 4, 4, 2, 2, 2, 2, 2])  # [j, g, nl, c, wt, e, h, k0, k1]
    x = gl.permute(x, [0, 1, 2, 8, 7, 4, 6, 3, 5])  # [j, g, nl, k1, k0, wt, h, c, e]
    x = gl.reshape(x, [64, 128])
    return gl.convert_layout(x, QA, assert_trivial=TRIVIAL)


@gluon.jit
def _key_scales2(ks_pg, kz_pg, wq16, k: gl.constexpr):
    """folded ODD scale pairs of plane k (channels 32k ..) of 2-bit keys: (s_x0, z_x0, s_x1, z_x1), [1, 2, 1, 8]."""
    sa, sb = _split2_2(gl.load(ks_pg + k * 16 + wq16))
    za, zb = _split2_2(gl.load(kz_pg + k * 16 + wq16))
    return gl.inline_asm_elementwise(_KSC2, "=r,=r,=r,=r,r,r,r,r", [sa, sb, za, zb], dtype=(gl.int32, ) * 4,
                                     is_pure=True, pack=1)


@gluon.jit
def _split2_2(x):
    """[1, 2, 1, 16] natural pairs -> (a, b) = pairs 2w, 2w + 1 as [1, 2, 1, 8] (LK2)"""
    a, b = gl.split(gl.reshape(x, [1, 2, 1, 8, 2]))
    return gl.convert_layout(a, LK2, assert_trivial=TRIVIAL), gl.convert_layout(b, LK2, assert_trivial=TRIVIAL)


@gluon.jit
def _value_words2(gi: gl.constexpr, vw_pg):
    """2-bit value words of group gi: [4, 8, 4, 1] int32 (LV2), channel 32 gi + 8 jl + r, word c of its row."""
    jl = _idx(4, 0, LV2, 4)
    r = _idx(8, 1, LV2, 4)
    c = _idx(4, 2, LV2, 4)
    return gl.load(vw_pg + (gi * 32 + jl * 8 + r) * 4 + c)


@gluon.jit
def _split8(x):
    """[1, 1, 4, 8] pairs 8c + 2k + q -> 8 tiles [1, 1, 4, 1] (LV2): (q0k0, q0k1, q0k2, q0k3, q1k0, .., q1k3)"""
    xq0, xq1 = gl.split(gl.reshape(x, [1, 1, 4, 2, 2, 2]))  # [.., c, k1, k0, q]: q first
    a0, a1 = gl.split(xq0)  # k0
    b0, b1 = gl.split(xq1)
    a00, a10 = gl.split(a0)  # k1: a<k1><k0> (k in binary)
    a01, a11 = gl.split(a1)
    b00, b10 = gl.split(b0)
    b01, b11 = gl.split(b1)
    return (_lv2(a00), _lv2(a01), _lv2(a10), _lv2(a11), _lv2(b00), _lv2(b01), _lv2(b10), _lv2(b11))


@gluon.jit
def _lv2(x):
    return gl.convert_layout(gl.reshape(x, [1, 1, 4, 1]), LV2, assert_trivial=TRIVIAL)


@gluon.jit
def _vfold2(s, z):
    return gl.inline_asm_elementwise(_VSC2, "=r,r,r", [s, z], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _value_group2_t(gi: gl.constexpr, acc, pb, w, vs_pg, vz_pg, lim, MASK: gl.constexpr):
    """_value_group_t for 2-bit values: acc^T [32, 8] += V_g^T P^T, w the group's words (_value_words2)."""
    c = _idx(4, 2, LV2, 4)
    c8 = _idx(4, 2, LV8, 4)
    i8 = _idx(8, 3, LV8, 4)
    pr8 = gi * 32 + c8 * 8 + i8  # pair 8c + 2k + q of the group's row of 32 token pairs
    s00, s01, s02, s03, s10, s11, s12, s13 = _split8(gl.load(vs_pg + pr8))
    z00, z01, z02, z03, z10, z11, z12, z13 = _split8(gl.load(vz_pg + pr8))
    z00 = _vfold2(s00, z00)
    z01 = _vfold2(s01, z01)
    z02 = _vfold2(s02, z02)
    z03 = _vfold2(s03, z03)
    z10 = _vfold2(s10, z10)
    z11 = _vfold2(s11, z11)
    z12 = _vfold2(s12, z12)
    z13 = _vfold2(s13, z13)
    if MASK:  # word c, pair (q, k): tokens 16c + 4k + 2q + {0, 1}
        tw = c * 16
        s00 = _mask_pairs(s00, tw, lim)
        z00 = _mask_pairs(z00, tw, lim)
        s01 = _mask_pairs(s01, tw + 4, lim)
        z01 = _mask_pairs(z01, tw + 4, lim)
        s02 = _mask_pairs(s02, tw + 8, lim)
        z02 = _mask_pairs(z02, tw + 8, lim)
        s03 = _mask_pairs(s03, tw + 12, lim)
        z03 = _mask_pairs(z03, tw + 12, lim)
        s10 = _mask_pairs(s10, tw + 2, lim)
        z10 = _mask_pairs(z10, tw + 2, lim)
        s11 = _mask_pairs(s11, tw + 6, lim)
        z11 = _mask_pairs(z11, tw + 6, lim)
        s12 = _mask_pairs(s12, tw + 10, lim)
        z12 = _mask_pairs(z12, tw + 10, lim)
        s13 = _mask_pairs(s13, tw + 14, lim)
        z13 = _mask_pairs(z13, tw + 14, lim)
    x0 = _unpack2(w, 0, s00, z00, s01, z01, s02, z02, s03, z03)
    x1 = _unpack2(w, 1, s10, z10, s11, z11, s12, z12, s13, z13)
    x = _j4(x0, x1)  # [jl, r, c, 1, e, h, k0, k1]
    x = gl.reshape(x, [4, 8, 4, 2, 2, 2, 2])  # [jl, r, c, e, h, k0, k1]
    x = gl.permute(x, [0, 1, 6, 5, 4, 2, 3])  # [jl, r, k1, k0, h, c, e]
    v = gl.convert_layout(gl.reshape(x, [32, 64]), QA, assert_trivial=TRIVIAL)
    return gl.nvidia.ampere.mma_v2(v, pb, acc)


VFOLD = gl.constexpr(int(os.environ.get("GD_VFOLD", 0)))
# VFOLD: value scales folded into P^T (raw 16 + c codes); VEARLY (transposed): value words loaded before the key half
VEARLY = gl.constexpr(int(os.environ.get("GD_VEARLY", 0)))
_UNPACK_RAW = gl.constexpr("""{
.reg .b32 t<4>, r<4>;
shl.b32 t0, $8, 6;
shr.u32 t1, $8, 2;
shl.b32 t2, $8, 2;
shr.u32 t3, $8, 6;
lop3.b32 r0, t0, 0x03C003C0, 0x4C004C00, 0xEA;
lop3.b32 r1, t1, 0x03C003C0, 0x4C004C00, 0xEA;
lop3.b32 r2, t2, 0x03C003C0, 0x4C004C00, 0xEA;
lop3.b32 r3, t3, 0x03C003C0, 0x4C004C00, 0xEA;
mov.b32 {$0, $1}, r0;
mov.b32 {$2, $3}, r1;
mov.b32 {$4, $5}, r2;
mov.b32 {$6, $7}, r3;
}""")
_HMUL2 = gl.constexpr("mul.rn.f16x2 $0, $1, $2;")
_FOLD2 = gl.constexpr("{.reg .b32 m; mov.b32 m, 0xCC00CC00; fma.rn.f16x2 $0, $1, m, $2;}")
# natural-token tiles whose relabelling (token 16c + 8u + 4p + 2h + e -> slot e + 2c + 8h + 16p + 32u) is the
# B operand [64 slots, 8] / the A operand [16, 64 slots] (up to a register permutation, which Gluon accepts as
# trivial): 16 consecutive tokens per lane in consecutive registers (two 16-byte loads)
LSB = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0]],
                                              lane_bases=[[16, 0], [32, 0], [0, 1], [0, 2], [0, 4]], warp_bases=[],
                                              block_bases=[], shape=[64, 8]))
LZA = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
                                              lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[],
                                              block_bases=[], shape=[16, 64]))


@gluon.jit
def _value_tile_raw_t(vw):
    """value words of one group (LV) -> V^T [32, 64 slots] of 16 + code (exact), A operand."""
    a0, a1, b0, b1, c0, c1, d0, d1 = gl.inline_asm_elementwise(_UNPACK_RAW, "=h,=h,=h,=h,=h,=h,=h,=h,r", [vw],
                                                               dtype=(gl.float16, ) * 8, is_pure=True, pack=1)
    x = _j3(a0, a1, b0, b1, c0, c1, d0, d1)  # [jl, r, c, u, e, h, p]
    x = gl.permute(x, [0, 1, 3, 6, 5, 2, 4])  # [jl, r, u, p, h, c, e]
    x = gl.reshape(x, [32, 64])
    return gl.convert_layout(x, QA, assert_trivial=TRIVIAL)


@gluon.jit
def _slots_b(x):
    """[64 tokens (natural), 8] in LSB -> [64 slots, 8] in the B-operand layout (relabelling only)."""
    x = gl.permute(gl.reshape(x, [4, 2, 2, 2, 2, 8]), [1, 2, 3, 0, 4, 5])
    return gl.convert_layout(gl.reshape(x, [64, 8]), OPB, assert_trivial=TRIVIAL)


@gluon.jit
def _slots_a(x):
    """[16, 64 tokens (natural)] in LZA -> [16, 64 slots] in the A-operand layout (relabelling only)."""
    x = gl.permute(gl.reshape(x, [16, 4, 2, 2, 2, 2]), [0, 2, 3, 4, 1, 5])
    return gl.convert_layout(gl.reshape(x, [16, 64]), QA, assert_trivial=TRIVIAL)


@gluon.jit
def _value_group_fold_t(gi: gl.constexpr, acc, pb, vw_pg, vs16, tokb, lim, MASK: gl.constexpr):
    """acc^T [32, 8] += V_g^T (16 + c) (P^T * s_g): the group's per-token scales multiply P^T's rows (8 HMUL2 per
    lane) instead of every code; the zero points go through the separate bias product."""
    jl = _idx(4, 0, LV, 4)
    r = _idx(8, 1, LV, 4)
    c = _idx(4, 2, LV, 4)
    u = _idx(2, 3, LV, 4)
    ch = gi * 32 + jl * 8 + r
    w = gl.load(vw_pg + ch * 8 + (c * 2 + u))
    if MASK:
        sg = _slots_b(gl.load(vs16 + gi * 64 + tokb, mask=tokb < lim, other=0.0))
    else:
        sg = _slots_b(gl.load(vs16 + gi * 64 + tokb))  # [64 slots, 8] fp16 scales (broadcast over the heads)
    ps = gl.inline_asm_elementwise(_HMUL2, "=r,r,r", [pb, sg], dtype=gl.float16, is_pure=True, pack=2)
    return gl.nvidia.ampere.mma_v2(_value_tile_raw_t(w), ps, acc)


@gluon.jit
def gluon_decode_t_kernel(q_ptr, bt_ptr, len_ptr, kw_ptr, ks_ptr, kz_ptr, vw_ptr, vs_ptr, vz_ptr,
                          m_ws, l_ws, o_ws, qk_scale, Hkv, NS, s_qb, s_qh, s_btb, s_kcp, s_kch, s_ksp, s_ksh,
                          s_vcp, s_vch, s_vsp, s_vsh, GROUP: gl.constexpr, VALUES: gl.constexpr,
                          KBITS: gl.constexpr = 4, VBITS: gl.constexpr = 4):
    """gluon_decode_kernel with transposed MMAs (same arguments, same outputs); KBITS/VBITS 4 or 2 (group 32)."""
    gl.static_assert((KBITS == 4) or (KBITS == 2))
    gl.static_assert((VBITS == 4) or (VBITS == 2))
    gl.static_assert((VBITS == 4) or (not VFOLD))
    gl.static_assert((VBITS == 4) or (not VEARLY))
    P: gl.constexpr = 64
    D: gl.constexpr = 128
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // Hkv
    h = pid % Hkv
    k = gl.arange(0, D, layout=gl.SliceLayout(1, LQT))
    hd = gl.arange(0, 8, layout=gl.SliceLayout(0, LQT))
    if KBITS == 4:
        ch = (k // 64) * 64 + ((k // 2) % 4) * 16 + ((k // 16) % 4) * 4 + (k // 8) % 2 + 2 * (k % 2)
    else:  # slot e + 2c + 8h + 16wt + 32k -> channel 32k + 8c + 4wt + h + 2e
        ch = (k // 32) * 32 + ((k // 2) % 4) * 8 + ((k // 16) % 2) * 4 + (k // 8) % 2 + 2 * (k % 2)
    qv = gl.load(q_ptr + b * s_qb + (h * GROUP + hd)[None, :] * s_qh + ch[:, None], mask=(hd < GROUP)[None, :],
                 other=0.0)
    qb = gl.convert_layout(qv.to(gl.float16), OPB)

    length = gl.load(len_ptr + b)
    npg = gl.cdiv(length, P)
    pps = gl.cdiv(npg, NS)
    t0 = split * pps * P
    t1 = gl.minimum(t0 + pps * P, length)
    t_full = t0 + gl.maximum(t1 - t0, 0) // P * P

    if KBITS == 4:
        j = _idx(8, 0, LK, 4)
        g = _idx(2, 1, LK, 4)
        nl = _idx(4, 2, LK, 4)
        wk = _idx(16, 3, LK, 4)
        n = j * 8 + g * 4 + nl  # S^T row m
        tok = 8 * (2 * ((n // 2) % 4) + n // 32) + 4 * ((n // 16) % 2) + 2 * ((n // 8) % 2) + n % 2
        koff = tok * 16 + wk
        wq = g * (D // 2) + wk * 2
        wq32 = _idx(2, 1, LK32, 4) * (D // 2) + _idx(32, 3, LK32, 4)
    else:  # 2-bit key rows of 8 words, the same token order
        j = _idx(8, 0, LK2, 4)
        g = _idx(2, 1, LK2, 4)
        nl = _idx(4, 2, LK2, 4)
        wk = _idx(8, 3, LK2, 4)
        n = j * 8 + g * 4 + nl
        tok = 8 * (2 * ((n // 2) % 4) + n // 32) + 4 * ((n // 16) % 2) + 2 * ((n // 8) % 2) + n % 2
        koff = tok * 8 + wk
        wq16 = _idx(2, 1, LK2S, 4) * (D // 2) + _idx(16, 3, LK2S, 4)  # plane k's pairs: + 16k

    m_i = gl.full([8], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    a0 = gl.zeros([32, 8], gl.float32, layout=MMA)
    a1 = gl.zeros([32, 8], gl.float32, layout=MMA)
    a2 = gl.zeros([32, 8], gl.float32, layout=MMA)
    a3 = gl.zeros([32, 8], gl.float32, layout=MMA)
    bacc = gl.zeros([16, 8], gl.float32, layout=MMA)  # VFOLD: sum_t P z'_g, row g = value group g
    tokb = gl.arange(0, 64, layout=gl.SliceLayout(1, LSB))[:, None] + gl.zeros([1, 8], gl.int32, layout=LSB)
    zrow = gl.arange(0, 16, layout=gl.SliceLayout(1, LZA))[:, None]
    zoff = (zrow % 4) * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, LZA))[None, :]  # rows 4..15 repeat 0..3
    kw_h = kw_ptr + h * s_kch
    ks_h = (ks_ptr + h * s_ksh).to(gl.pointer_type(gl.int32), bitcast=True)
    kz_h = (kz_ptr + h * s_ksh).to(gl.pointer_type(gl.int32), bitcast=True)
    vw_h = vw_ptr + h * s_vch
    vs_h = (vs_ptr + h * s_vsh).to(gl.pointer_type(gl.int32), bitcast=True)
    vz_h = (vz_ptr + h * s_vsh).to(gl.pointer_type(gl.int32), bitcast=True)
    bt_b = bt_ptr + b * s_btb
    last = gl.maximum(t_full // P - 1, 0)
    if PF >= 1:
        page_n = gl.load(bt_b + gl.minimum(t0 // P, last)).to(gl.int64)
        if PF >= 2:
            kw_n = gl.load(kw_h + page_n * s_kcp + koff)
    mtok = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    mtok = 8 * (2 * ((mtok // 2) % 4) + mtok // 32) + 4 * ((mtok // 16) % 2) + 2 * ((mtok // 8) % 2) + mtok % 2
    ztok = gl.arange(0, 64, layout=gl.SliceLayout(0, LZA))[None, :] + zrow * 0
    for phase in gl.static_range(2):  # whole steps, then at most one partial step (the only masked one)
        if phase == 0:
            lo = t0
            hi = t_full
        else:
            lo = t_full
            hi = t1
        for start in range(lo, hi, P):
            lim = t1 - start
            if phase == 0 and PF >= 1:
                page = page_n
                page_n = gl.load(bt_b + gl.minimum(start // P + 1, last)).to(gl.int64)
                if PF >= 2:
                    kw = kw_n
                    kw_n = gl.load(kw_h + page_n * s_kcp + koff)
                else:
                    kw = gl.load(kw_h + page * s_kcp + koff)
            else:
                page = gl.load(bt_b + start // P).to(gl.int64)
                kw = gl.load(kw_h + page * s_kcp + koff)
            if VEARLY and VALUES and not VFOLD:  # the step's value words issued before the key half
                vw0 = _value_words(0, vw_h + page * s_vcp)
                vw1 = _value_words(1, vw_h + page * s_vcp)
                vw2 = _value_words(2, vw_h + page * s_vcp)
                vw3 = _value_words(3, vw_h + page * s_vcp)
            ks_pg = ks_h + page * (s_ksp // 2)
            kz_pg = kz_h + page * (s_ksp // 2)
            if KBITS == 4:
                s00, z00, s10, z10 = _key_scales(ks_pg, kz_pg, wq, wq32, 0)
                s01, z01, s11, z11 = _key_scales(ks_pg, kz_pg, wq, wq32, 1)
                kt = _key_tile_t(kw, s00, z00, s10, z10, s01, z01, s11, z11)
            else:
                s00, z00, s10, z10 = _key_scales2(ks_pg, kz_pg, wq16, 0)
                s01, z01, s11, z11 = _key_scales2(ks_pg, kz_pg, wq16, 1)
                s02, z02, s12, z12 = _key_scales2(ks_pg, kz_pg, wq16, 2)
                s03, z03, s13, z13 = _key_scales2(ks_pg, kz_pg, wq16, 3)
                kt = _key_tile2_t(kw, (s00, z00, s01, z01, s02, z02, s03, z03),
                                  (s10, z10, s11, z11, s12, z12, s13, z13))
            s = gl.nvidia.ampere.mma_v2(kt, qb, gl.zeros([64, 8], gl.float32, layout=MMA))  # S^T [64 tokens, 8 heads]
            if phase == 1:
                s = gl.where((mtok < lim)[:, None], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=0) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s * qk_scale - m_new[None, :])
            l_i = l_i * alpha + gl.sum(p, axis=0)
            m_i = m_new
            pb = _pt_operand(p.to(gl.float16))
            if VALUES:
                vw_pg = vw_h + page * s_vcp
                vs_pg = vs_h + page * (s_vsp // 2)
                vz_pg = vz_h + page * (s_vsp // 2)
                if VFOLD:
                    vs16 = vs_ptr + h * s_vsh + page * s_vsp
                    vz16 = vz_ptr + h * s_vsh + page * s_vsp
                    if phase == 1:
                        zs = gl.load(vs16 + zoff, mask=ztok < lim, other=0.0)
                        zz = gl.load(vz16 + zoff, mask=ztok < lim, other=0.0)
                    else:
                        zs = gl.load(vs16 + zoff)
                        zz = gl.load(vz16 + zoff)
                    zf = gl.inline_asm_elementwise(_FOLD2, "=r,r,r", [zs, zz], dtype=gl.float16, is_pure=True,
                                                   pack=2)  # z - 16 s, [16 rows, 64]
                    bacc = gl.nvidia.ampere.mma_v2(_slots_a(zf), pb, bacc * alpha[None, :])
                    a0 = _value_group_fold_t(0, a0 * alpha[None, :], pb, vw_pg, vs16, tokb, lim,
                                                    phase == 1)
                    a1 = _value_group_fold_t(1, a1 * alpha[None, :], pb, vw_pg, vs16, tokb, lim,
                                                    phase == 1)
                    a2 = _value_group_fold_t(2, a2 * alpha[None, :], pb, vw_pg, vs16, tokb, lim,
                                                    phase == 1)
                    a3 = _value_group_fold_t(3, a3 * alpha[None, :], pb, vw_pg, vs16, tokb, lim,
                                                    phase == 1)
                elif VBITS == 2:
                    vw0 = _value_words2(0, vw_pg)
                    vw1 = _value_words2(1, vw_pg)
                    vw2 = _value_words2(2, vw_pg)
                    vw3 = _value_words2(3, vw_pg)
                    a0 = _value_group2_t(0, a0 * alpha[None, :], pb, vw0, vs_pg, vz_pg, lim, phase == 1)
                    a1 = _value_group2_t(1, a1 * alpha[None, :], pb, vw1, vs_pg, vz_pg, lim, phase == 1)
                    a2 = _value_group2_t(2, a2 * alpha[None, :], pb, vw2, vs_pg, vz_pg, lim, phase == 1)
                    a3 = _value_group2_t(3, a3 * alpha[None, :], pb, vw3, vs_pg, vz_pg, lim, phase == 1)
                else:
                    if not VEARLY:
                        vw0 = _value_words(0, vw_pg)
                        vw1 = _value_words(1, vw_pg)
                        vw2 = _value_words(2, vw_pg)
                        vw3 = _value_words(3, vw_pg)
                    a0 = _value_group_t(0, a0 * alpha[None, :], pb, vw0, vs_pg, vz_pg, lim,
                                               phase == 1)
                    a1 = _value_group_t(1, a1 * alpha[None, :], pb, vw1, vs_pg, vz_pg, lim,
                                               phase == 1)
                    a2 = _value_group_t(2, a2 * alpha[None, :], pb, vw2, vs_pg, vz_pg, lim,
                                               phase == 1)
                    a3 = _value_group_t(3, a3 * alpha[None, :], pb, vw3, vs_pg, vz_pg, lim,
                                               phase == 1)
            else:
                a0 = a0 * alpha[None, :] + gl.sum(p, axis=0)[None, :]  # keys only (P^T's movmatrix not counted)

    if VFOLD:  # the zero points' sum_t P z'_g (row g of bacc) joins every channel of value group g
        br = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))[:, None]
        a0 = a0 + gl.sum(gl.where(br == 0, bacc, 0.0), axis=0)[None, :]
        a1 = a1 + gl.sum(gl.where(br == 1, bacc, 0.0), axis=0)[None, :]
        a2 = a2 + gl.sum(gl.where(br == 2, bacc, 0.0), axis=0)[None, :]
        a3 = a3 + gl.sum(gl.where(br == 3, bacc, 0.0), axis=0)[None, :]
    hds = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    hq = (b * Hkv + h) * GROUP + hds
    hmask = hds < GROUP
    gl.store(m_ws + hq * NS + split, m_i, mask=hmask)
    gl.store(l_ws + hq * NS + split, l_i, mask=hmask)
    rows = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))
    ob = o_ws + (hq * NS + split)[None, :] * D + rows[:, None]
    gl.store(ob, a0, mask=hmask[None, :])
    gl.store(ob + 32, a1, mask=hmask[None, :])
    gl.store(ob + 64, a2, mask=hmask[None, :])
    gl.store(ob + 96, a3, mask=hmask[None, :])

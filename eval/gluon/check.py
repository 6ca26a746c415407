"""Correctness and timing of the Gluon decode spike (eval/gluon/gluon_decode.py).

    python eval/gluon/check.py --emulate     # CPU: a torch emulation of the kernels' index maps and unpack
                                             # arithmetic against kivi_cache.reference (no Gluon)
    python eval/gluon/check.py --sabotage    # CPU: emulate_t with broken 2-bit maps must miss the reference
    python eval/gluon/check.py [--bench]     # GPU (Triton 3.6): both Gluon kernels against the reference, and the
                                             # existing kivi_cache.kernels.paged_decode_attention; --bench times them
    python eval/gluon/check.py --all [--bench]   # the same under every variant of VARIANTS (subprocesses)
    env GD_PF=0|1|2, GD_VFOLD, GD_PAD, GD_PADP, ... select the kernel variants (gluon_decode.py's flags), R=168 caps
    the registers (12 one-warp programs per SM)

Scope of the spike: 4/4 bits (the transposed kernel also 2/2, 4/2, 2/4: KBITS/VBITS), group 32, head_dim 128,
page 64, GQA 4 (32 query heads / 8 KV heads), fp16, no residual window (res_lengths = 0); the partials are merged in
torch. The FA2-form kernel handles whole 64-token steps only (lengths multiples of 64); the transposed kernel also
the partial last step. --emulate: tile_algebra_check (the kernel's join/reshape/permute/split sequences on labelled
tensors), emulate (FA2 form, 4-bit, as before) and emulate_t (transposed kernel, 4- and 2-bit codes, partial steps).
"""

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kivi_cache import reference  # noqa: E402

D, P, G, BITS, GROUP = 128, 64, 32, 4, 4
VARIANTS = ({}, {"GD_PF": "1"}, {"GD_PF": "1", "R": "168"}, {"GD_PF": "2"}, {"GD_VFOLD": "1"}, {"GD_PAD": "0"})
LOG2E = 1.4426950408889634


def make_case(bsz=4, hkv=8, pages_per_seq=8, device="cpu", seed=0, lengths=None, kbits=BITS, vbits=BITS):
    gen = torch.Generator().manual_seed(seed)
    npool = bsz * pages_per_seq + 3
    hq = hkv * GROUP

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    k_codes = torch.randint(0, 256, (npool, hkv, P, D * kbits // 8), generator=gen, dtype=torch.uint8)
    v_codes = torch.randint(0, 256, (npool, hkv, D, P * vbits // 8), generator=gen, dtype=torch.uint8)
    k_scale = (rnd(npool, hkv, P // G, D).abs() * 0.1 + 0.02).half()
    k_zero = (rnd(npool, hkv, P // G, D) * 0.5).half()
    v_scale = (rnd(npool, hkv, D // G, P).abs() * 0.1 + 0.02).half()
    v_zero = (rnd(npool, hkv, D // G, P) * 0.5).half()
    perm = torch.randperm(npool, generator=gen)[:bsz * pages_per_seq].to(torch.int32)
    block_table = perm.reshape(bsz, pages_per_seq).contiguous()
    if lengths is None:
        lengths = torch.tensor([P * max(1, pages_per_seq - i) for i in range(bsz)], dtype=torch.int32)
    q = rnd(bsz, hq, D).half()
    res_k = torch.zeros(bsz, hkv, 1, D, dtype=torch.float16)
    res_v = torch.zeros(bsz, hkv, 1, D, dtype=torch.float16)
    res_len = torch.zeros(bsz, dtype=torch.int32)
    t = dict(q=q, block_table=block_table, lengths=lengths, k_codes=k_codes, k_scale=k_scale, k_zero=k_zero,
             v_codes=v_codes, v_scale=v_scale, v_zero=v_zero, res_k=res_k, res_v=res_v, res_lengths=res_len)
    t = {k: v.to(device) for k, v in t.items()}
    t["bits"] = (kbits, vbits)
    return t


def ref_out(c, sm_scale):
    args = [c[k] for k in ("q", "block_table", "lengths", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale",
                           "v_zero", "res_k", "res_v", "res_lengths")]
    f32 = [a.float() if a.is_floating_point() else a for a in args]
    kb, vb = c.get("bits", (BITS, BITS))
    return reference.paged_decode_attention(*f32, kb, vb, G, sm_scale).float()


# ---------------------------------------------------------------------------------------------- index maps (kernel)
def key_token(n):
    """S column / S^T row n -> token of the step (pi)."""
    return 8 * (2 * ((n // 2) % 4) + n // 32) + 4 * ((n // 16) % 2) + 2 * ((n // 8) % 2) + n % 2


def key_slot_channel(k):
    """K^T (K) slot k -> channel (q's columns are permuted by it)."""
    return (k // 64) * 64 + ((k // 2) % 4) * 16 + ((k // 16) % 4) * 4 + (k // 8) % 2 + 2 * (k % 2)


def unpack_pairs(words, s, zf):
    """The kernel's unpack: int32 words [...] -> dict (x, p) -> (lo, hi) fp16 values, v = 16 + code (bits 6..9 of
    the half after the shift), v * s + zf with one rounding (fp32 math then fp16). s, zf: dict (x, p) -> (lo, hi)."""
    out = {}
    for x in (0, 1):
        for p in (0, 1):
            lo = (words >> (8 * x + 4 * p)) & 15
            hi = (words >> (16 + 8 * x + 4 * p)) & 15
            sl, sh = s[(x, p)]
            zl, zh = zf[(x, p)]
            out[(x, p)] = (((16 + lo).float() * sl.float() + zl.float()).half(),
                           ((16 + hi).float() * sh.float() + zh.float()).half())
    return out


def fold(s, z):
    return (z.float() - 16 * s.float()).half()  # fma(s, -16, z) rounded once


def emulate(c, sm_scale, ns, vfold=False):
    """The kernel's arithmetic per (b, h, split) with its index maps, in torch (CPU); returns [B, Hq, D].
    ``vfold``: GD_VFOLD=1 (value scales on P^T, raw 16 + c value codes, zero points through a bias product)."""
    q, bt, lengths = c["q"], c["block_table"], c["lengths"]
    kw = c["k_codes"].view(torch.int32)  # [NP, H, P, 16]
    vw = c["v_codes"].view(torch.int32)  # [NP, H, D, 8]
    bsz, hq, _ = q.shape
    hkv = kw.shape[1]
    qk = sm_scale * LOG2E
    out = torch.zeros(bsz, hq, D)
    n = torch.arange(64)
    tok = key_token(n)
    ks = torch.arange(D)
    chk = key_slot_channel(ks)
    # V slot k = e + 2c + 8x + 16p + 32u -> token 8(2c + u) + 4p + 2x + e (= key_token(k)); word 2c + u
    for b in range(bsz):
        for h in range(hkv):
            qrows = q[b, h * GROUP:(h + 1) * GROUP].half()  # [4, D]
            qperm = qrows[:, chk]  # [4, 128 slots]
            ms, ls, os_ = [], [], []
            npg = -(-int(lengths[b]) // P)
            pps = -(-npg // ns)
            for sp in range(ns):
                t0 = sp * pps * P
                t1 = min(t0 + pps * P, int(lengths[b]))
                m = torch.full((GROUP,), -math.inf)
                l_ = torch.zeros(GROUP)
                o = torch.zeros(GROUP, D)
                bias = torch.zeros(GROUP, D // G)
                for start in range(t0, t0 + max(t1 - t0, 0) // P * P, P):
                    page = int(bt[b, start // P])
                    # keys: K^T [128 slots, 64 columns]; column n reads token row key_token(n), lane c words 4c..4c+3
                    kt = torch.empty(D, 64, dtype=torch.float16)
                    for col in range(64):
                        t = int(tok[col])
                        g = t // G
                        sc = c["k_scale"][page, h, g]
                        zc = c["k_zero"][page, h, g]
                        words = kw[page, h, t]  # [16]
                        for w in range(16):
                            cc, wt = w // 4, w % 4
                            s_, z_ = {}, {}
                            for x in (0, 1):
                                for p in (0, 1):
                                    ch0 = 64 * p + 4 * w + x
                                    s_[(x, p)] = (sc[ch0], sc[ch0 + 2])
                                    z_[(x, p)] = (fold(sc[ch0], zc[ch0]), fold(sc[ch0 + 2], zc[ch0 + 2]))
                            pr = unpack_pairs(words[w], s_, z_)
                            for x in (0, 1):
                                for p in (0, 1):
                                    for e in (0, 1):
                                        slot = e + 2 * cc + 8 * x + 16 * wt + 64 * p
                                        kt[slot, col] = pr[(x, p)][e]
                    s = qperm.float() @ kt.float()  # [4, 64] (fp32 accumulation of fp16 products)
                    m_new = torch.maximum(m, s.max(1).values * qk)
                    alpha = torch.exp2(m - m_new)
                    pm = torch.exp2(s * qk - m_new[:, None])
                    l_ = l_ * alpha + pm.sum(1)
                    m = m_new
                    p16 = pm.half()  # P [4, 64 slots], slot k = column k (token key_token(k))
                    # values: V [64 slots, 128 channels]
                    v = torch.empty(64, D, dtype=torch.float16)
                    for ch in range(D):
                        gi = ch // G
                        sv = c["v_scale"][page, h, gi]
                        zv = c["v_zero"][page, h, gi]
                        for cc in range(4):
                            for u in range(2):
                                w = 2 * cc + u
                                s_, z_ = {}, {}
                                for x in (0, 1):
                                    for p in (0, 1):
                                        t = 8 * w + 4 * p + 2 * x
                                        s_[(x, p)] = (sv[t], sv[t + 1])
                                        z_[(x, p)] = (fold(sv[t], zv[t]), fold(sv[t + 1], zv[t + 1]))
                                pr = unpack_pairs(vw[page, h, ch, w], s_, z_)
                                for x in (0, 1):
                                    for p in (0, 1):
                                        for e in (0, 1):
                                            slot = e + 2 * cc + 8 * x + 16 * p + 32 * u
                                            v[slot, ch] = pr[(x, p)][e]
                    if vfold:
                        ks_ = torch.arange(64)
                        tk = key_token(ks_)  # slot -> token
                        vraw = torch.empty(64, D)
                        for ch in range(D):
                            for cc in range(4):
                                for u in range(2):
                                    w = int(vw[page, h, ch, 2 * cc + u])
                                    for x in (0, 1):
                                        for p in (0, 1):
                                            for e in (0, 1):
                                                code = (w >> (16 * e + 8 * x + 4 * p)) & 15
                                                vraw[e + 2 * cc + 8 * x + 16 * p + 32 * u, ch] = 16 + code
                        sv = c["v_scale"][page, h][:, tk]  # [groups, 64 slots]
                        zf = fold(c["v_scale"][page, h][:, tk], c["v_zero"][page, h][:, tk])
                        pv = torch.empty(GROUP, D)
                        for gi in range(D // G):
                            pg = (p16.float() * sv[gi].float()[None, :]).half()  # mul.rn.f16x2
                            pv[:, gi * G:(gi + 1) * G] = pg.float() @ vraw[:, gi * G:(gi + 1) * G]
                        o = o * alpha[:, None] + pv
                        bias = bias * alpha[:, None] + p16.float() @ zf.float().T
                    else:
                        o = o * alpha[:, None] + p16.float() @ v.float()
                if vfold:
                    o = o + bias.repeat_interleave(G, dim=1)
                ms.append(m)
                ls.append(l_)
                os_.append(o)
            mm = torch.stack(ms)  # [ns, 4]
            top = mm.max(0).values
            wgt = torch.exp2(mm - top)
            wgt = torch.where(torch.isnan(wgt), torch.zeros_like(wgt), wgt)
            num = (wgt[:, :, None] * torch.stack(os_)).sum(0)
            den = (wgt * torch.stack(ls)).sum(0)
            out[b, h * GROUP:(h + 1) * GROUP] = num / den[:, None]
    return out


# ------------------------------------------------------------------------- transposed kernel, 4- and 2-bit codes
def t_key_slots(kbits):
    """The transposed kernel's K slot s -> (word of the token row, bit shift of the code, channel), as its tile
    algebra builds them (_key_tile_t / _key_tile2_t): the code of slot s is (word >> shift) & (2**bits - 1)."""
    s = torch.arange(D)
    e, c, x = s % 2, (s // 2) % 4, (s // 8) % 2
    if kbits == 4:  # s = e + 2c + 8x + 16wt + 64p: word 4c + wt, nibble p of bytes (x, x + 2)
        wt, pl = (s // 16) % 4, s // 64
        word = 4 * c + wt
        return word, 16 * e + 8 * x + 4 * pl, 64 * pl + 4 * word + x + 2 * e
    # s = e + 2c + 8x + 16wt + 32k: word 2c + wt, field k of bytes (x, x + 2)
    wt, k = (s // 16) % 2, s // 32
    word = 2 * c + wt
    return word, 16 * e + 8 * x + 2 * k, 32 * k + 4 * word + x + 2 * e


def t_value_slots(vbits):
    """V^T slot s -> (word of the channel row, bit shift, token of the step) (_value_tile_t / _value_group2_t)."""
    s = torch.arange(P)
    e, c, x = s % 2, (s // 2) % 4, (s // 8) % 2
    if vbits == 4:  # s = e + 2c + 8x + 16p + 32u: word 2c + u
        pl, u = (s // 16) % 2, s // 32
        word = 2 * c + u
        return word, 16 * e + 8 * x + 4 * pl, 8 * word + 4 * pl + 2 * x + e
    k = s // 16  # s = e + 2c + 8x + 16k: word c
    return c, 16 * e + 8 * x + 2 * k, 16 * c + 4 * k + 2 * x + e


def t_deq(codes, bits, s, z):
    """The unpack's arithmetic: (2**bits + c) * s + (z - 2**bits s), the fold and the fma each rounded to fp16."""
    zf = (z.float() - (1 << bits) * s.float()).half()
    return (((1 << bits) + codes).float() * s.float() + zf.float()).half()


def emulate_t(c, sm_scale, ns):
    """The transposed kernel (gluon_decode_t_kernel, default flags) per (b, h, split) with its index maps, for the
    case's bits (4 or 2): whole steps, then the masked partial step; the partials merged as decode_reduce does."""
    kb, vb = c["bits"]
    q, bt, lengths = c["q"], c["block_table"], c["lengths"]
    kw = c["k_codes"].view(torch.int32)  # [NP, H, P, D * kb / 32]
    vw = c["v_codes"].view(torch.int32)  # [NP, H, D, P * vb / 32]
    bsz, hq, _ = q.shape
    hkv = kw.shape[1]
    qk = sm_scale * LOG2E
    kword, kshift, kch = t_key_slots(kb)
    vword, vshift, vtok = t_value_slots(vb)
    rows = torch.arange(64)
    tok = key_token(rows)  # S^T row n (= P^T row = value slot n) -> token
    out = torch.zeros(bsz, hq, D)
    for b in range(bsz):
        n_len = int(lengths[b])
        npg = -(-n_len // P)
        pps = -(-npg // ns)
        for h in range(hkv):
            qperm = q[b, h * GROUP:(h + 1) * GROUP].half()[:, kch]  # q's columns in slot order
            ms, ls, os_ = [], [], []
            for sp in range(ns):
                t0 = sp * pps * P
                t1 = min(t0 + pps * P, n_len)
                t_full = t0 + max(t1 - t0, 0) // P * P
                m = torch.full((GROUP,), -math.inf)
                l_ = torch.zeros(GROUP)
                o = torch.zeros(GROUP, D)
                starts = list(range(t0, t_full, P)) + ([t_full] if t1 > t_full else [])
                for start in starts:
                    lim = t1 - start
                    page = int(bt[b, start // P])
                    words = kw[page, h][tok][:, kword]  # [64 rows, 128 slots]: row n's token, slot s's word
                    codes = (words >> kshift[None, :]) & ((1 << kb) - 1)
                    grp = (tok // G)[:, None]
                    kt = t_deq(codes, kb, c["k_scale"][page, h][grp, kch[None, :]],
                               c["k_zero"][page, h][grp, kch[None, :]])  # K [64 rows, 128 slots]
                    st = qperm.float() @ kt.float().T  # S [4, 64 rows]
                    if lim < P:
                        st = torch.where((tok < lim)[None, :], st, -math.inf)
                    m_new = torch.maximum(m, st.max(1).values * qk)
                    alpha = torch.exp2(m - m_new)
                    pm = torch.exp2(st * qk - m_new[:, None])
                    l_ = l_ * alpha + pm.sum(1)
                    m = m_new
                    p16 = pm.half()  # P^T row n = value slot n
                    vwd = vw[page, h][:, vword]  # [128 channels, 64 slots]
                    vcodes = (vwd >> vshift[None, :]) & ((1 << vb) - 1)
                    gch = (torch.arange(D) // G)[:, None]
                    vsc = c["v_scale"][page, h][gch, vtok[None, :]]
                    vzz = c["v_zero"][page, h][gch, vtok[None, :]]
                    if lim < P:  # the masked step zeroes the scale and zero pairs of tokens past the end
                        keep = (vtok < lim)[None, :]
                        vsc = torch.where(keep, vsc, torch.zeros_like(vsc))
                        vzz = torch.where(keep, vzz, torch.zeros_like(vzz))
                    vt = t_deq(vcodes, vb, vsc, vzz)  # V^T [128, 64 slots]
                    o = o * alpha[:, None] + p16.float() @ vt.float().T
                ms.append(m)
                ls.append(l_)
                os_.append(o)
            mm = torch.stack(ms)
            top = mm.max(0).values
            top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
            wgt = torch.exp2(mm - top)
            num = (wgt[:, :, None] * torch.stack(os_)).sum(0)
            den = (wgt * torch.stack(ls)).sum(0)
            out[b, h * GROUP:(h + 1) * GROUP] = num / den[:, None]
    return out


def tile_algebra_check():
    """The kernel's join/reshape/permute/split sequences (gluon_decode.py's _key_tile_t, _key_tile2_t,
    _value_tile_t, _value_group2_t, _split8, _split4) replayed on labelled torch tensors (gl.join = stack on a new
    last dim, gl.split = the two halves of the last dim, reshape row-major): every (row, slot) of each operand tile
    must hold the (word, bit shift) that t_key_slots / t_value_slots say, every scale tile the right pair. Checks the
    order conventions that Gluon's trivial-conversion asserts do not (they only prove the layouts are consistent)."""
    join = torch.stack

    def unpack4(w):  # _UNPACK outputs: (x, p) = q0k0, q1k0, q0k1, q1k1, each (lo, hi); label word * 64 + shift
        return [w * 64 + 16 * e + 8 * x + 4 * pl for pl in (0, 1) for x in (0, 1) for e in (0, 1)]

    def unpack2(w, x):  # _UNPACK2_X<x> outputs: k0 lo, hi, k1 lo, hi, ...
        return [w * 64 + 16 * e + 8 * x + 2 * k for k in range(4) for e in (0, 1)]

    def j3(a0, a1, b0, b1, c0, c1, d0, d1):
        return join([join([join([a0, a1], -1), join([b0, b1], -1)], -1),
                     join([join([c0, c1], -1), join([d0, d1], -1)], -1)], -1)

    def j4(x0, x1):
        a0, a1, b0, b1, c0, c1, d0, d1 = x0
        e0, e1, f0, f1, g0, g1, i0, i1 = x1
        kk = [join([join([a0, a1], -1), join([e0, e1], -1)], -1), join([join([b0, b1], -1), join([f0, f1], -1)], -1),
              join([join([c0, c1], -1), join([g0, g1], -1)], -1), join([join([d0, d1], -1), join([i0, i1], -1)], -1)]
        return join([join([kk[0], kk[1]], -1), join([kk[2], kk[3]], -1)], -1)

    rows = torch.arange(64)
    # keys, 4 bits: words [8 j, 2 g, 4 nl, 16 w]
    w = torch.arange(16).expand(8, 2, 4, 16)
    x = j3(*unpack4(w))
    x = x.reshape(8, 2, 4, 4, 4, 2, 2, 2).permute(0, 1, 2, 7, 4, 6, 3, 5).reshape(64, 128)
    word, shift, _ = t_key_slots(4)
    assert torch.equal(x, (word * 64 + shift).expand(64, 128)), "4-bit key tile"
    # keys, 2 bits: words [8 j, 2 g, 4 nl, 8 w]
    w = torch.arange(8).expand(8, 2, 4, 8)
    x = j4(unpack2(w, 0), unpack2(w, 1))
    x = x.reshape(8, 2, 4, 4, 2, 2, 2, 2, 2).permute(0, 1, 2, 8, 7, 4, 6, 3, 5).reshape(64, 128)
    word, shift, _ = t_key_slots(2)
    assert torch.equal(x, (word * 64 + shift).expand(64, 128)), "2-bit key tile"
    # the rows: n = 8j + 4g + nl of the word tiles, the token order of their loads (key_token) is the kernel's
    assert torch.equal(torch.arange(8)[:, None, None] * 8 + torch.arange(2)[None, :, None] * 4
                       + torch.arange(4)[None, None, :], rows.reshape(8, 2, 4)), "key rows"
    # values, 4 bits: words [4 jl, 8 r, 4 c, 2 u] = word 2c + u of channel row 8 jl + r
    w = (torch.arange(4)[:, None] * 2 + torch.arange(2)[None, :]).expand(4, 8, 4, 2)
    x = j3(*unpack4(w)).permute(0, 1, 3, 6, 5, 2, 4).reshape(32, 64)
    word, shift, tok = t_value_slots(4)
    assert torch.equal(x, (word * 64 + shift).expand(32, 64)), "4-bit value tile"
    assert torch.equal(tok, key_token(rows)), "4-bit value slots -> tokens = pi (P^T rows)"
    # values, 2 bits: words [4 jl, 8 r, 4 c, 1] = word c
    w = torch.arange(4)[:, None].expand(4, 8, 4, 1)
    x = j4(unpack2(w, 0), unpack2(w, 1)).reshape(4, 8, 4, 2, 2, 2, 2).permute(0, 1, 6, 5, 4, 2, 3).reshape(32, 64)
    word, shift, tok = t_value_slots(2)
    assert torch.equal(x, (word * 64 + shift).expand(32, 64)), "2-bit value tile"
    assert torch.equal(tok, key_token(rows)), "2-bit value slots -> tokens = pi (P^T rows)"

    def split(t):
        return t[..., 0], t[..., 1]

    # value scale pairs of a lane: [1, 1, 4 c, 8] runs of pairs 8c + i (a pair = tokens 2i, 2i + 1 of the row)
    run = (torch.arange(4)[:, None] * 8 + torch.arange(8)[None, :]).reshape(1, 1, 4, 8)
    # _split4 (4 bits): (q0k0, q1k0, q0k1, q1k1) as [1, 1, 4, 2 u]: word 2c + u, pair (q, k) = pair 4(2c + u) + 2k + q
    xq0, xq1 = split(run.reshape(1, 1, 4, 2, 2, 2))
    q0k0, q0k1 = split(xq0)
    q1k0, q1k1 = split(xq1)
    wd = (torch.arange(4)[:, None] * 2 + torch.arange(2)[None, :]).reshape(1, 1, 4, 2)
    for t, (q, k) in zip((q0k0, q1k0, q0k1, q1k1), ((0, 0), (1, 0), (0, 1), (1, 1)), strict=True):
        assert torch.equal(t, 4 * wd + 2 * k + q), "_split4"
    # _split8 (2 bits): (q0k0..q0k3, q1k0..q1k3) as [1, 1, 4, 1]: word c, pair (q, k) = pair 8c + 2k + q
    xq0, xq1 = split(run.reshape(1, 1, 4, 2, 2, 2))
    out = []
    for xq in (xq0, xq1):
        a0, a1 = split(xq)
        a00, a10 = split(a0)
        a01, a11 = split(a1)
        out += [a00, a01, a10, a11]
    c4 = torch.arange(4).reshape(1, 1, 4)
    for i, t in enumerate(out):
        q, k = i // 4, i % 4
        assert torch.equal(t, 8 * c4 + 2 * k + q), "_split8"
    # the unpack takes, for byte pair x and field k, the scale pair of tokens (.., 2x + 4k ..) of its word: pair
    # 2k + x of the word's 8 pairs (2 bits; 4 bits: 2p + x), as _value_group2_t / _value_group_t pass them
    print("tile algebra OK: operand tiles, value slot -> token maps and scale splits as the index maps say")


def sabotage_check(sm_scale):
    """emulate_t with one 2-bit index map broken on purpose at a time: each must miss the reference by far more than
    the 1e-2 the checks allow (the emulation is sensitive to the maps it vouches for)."""
    global t_key_slots, t_value_slots
    ok_k, ok_v = t_key_slots, t_value_slots
    s = torch.arange(D)
    e, c, x, wt, k = s % 2, (s // 2) % 4, (s // 8) % 2, (s // 16) % 2, s // 32
    sv = torch.arange(P)
    ev, cv, xv, kv = sv % 2, (sv // 2) % 4, (sv // 8) % 2, sv // 16
    broken = {  # name -> (key map, value map) for 2-bit codes
        "key words c + 4wt": (lambda kb: (c + 4 * wt, ok_k(kb)[1], ok_k(kb)[2]), ok_v),
        "q permutation (x, e swapped)": (lambda kb: (ok_k(kb)[0], ok_k(kb)[1], 32 * k + 4 * (2 * c + wt) + 2 * x + e),
                                         ok_v),
        "key field shift 4k": (lambda kb: (ok_k(kb)[0], 16 * e + 8 * x + 4 * (k % 2), ok_k(kb)[2]), ok_v),
        "value token of the scales (e flipped)": (
            ok_k, lambda vb: (cv, ok_v(vb)[1], 16 * cv + 4 * kv + 2 * xv + 1 - ev)),
        "value fields/byte pairs swapped (slot != pi)": (
            ok_k, lambda vb: (cv, 16 * ev + 8 * (kv % 2) + 2 * (2 * (kv // 2) + xv), ok_v(vb)[2])),
    }
    lens = torch.tensor([3 * P, 2 * P - 17], dtype=torch.int32)
    case = make_case(bsz=2, hkv=2, pages_per_seq=3, lengths=lens, kbits=2, vbits=2)
    ref = ref_out(case, sm_scale)
    try:
        for name, (km, vm) in broken.items():
            t_key_slots, t_value_slots = km, vm
            err = ((emulate_t(case, sm_scale, 2) - ref).abs().max() / ref.abs().max()).item()
            print(f"sabotage: {name}: relative error {err:.3f}")
            assert err > 5e-2, (name, err)
    finally:
        t_key_slots, t_value_slots = ok_k, ok_v
    print("sabotage OK: every broken 2-bit map is caught")


# ---------------------------------------------------------------------------------------------------- GPU launch
def gluon_decode(c, sm_scale, ns, transposed):
    import gluon_decode as gd
    q, bt, lengths = c["q"], c["block_table"], c["lengths"]
    kw = c["k_codes"].view(torch.int32)
    vw = c["v_codes"].view(torch.int32)
    ks, kz, vs, vz = c["k_scale"], c["k_zero"], c["v_scale"], c["v_zero"]
    bsz, hq, _ = q.shape
    hkv = kw.shape[1]
    m_ws = torch.empty(bsz * hq, ns, device=q.device, dtype=torch.float32)
    l_ws = torch.empty_like(m_ws)
    o_ws = torch.empty(bsz * hq, ns, D, device=q.device, dtype=torch.float32)
    fn = gd.gluon_decode_t_kernel if transposed else gd.gluon_decode_kernel
    extra = {"maxnreg": int(os.environ["R"])} if os.environ.get("R") else {}  # env R: register cap (as sass_gluon)
    kb, vb = c.get("bits", (BITS, BITS))
    if transposed:
        extra.update(KBITS=kb, VBITS=vb)
    else:
        assert (kb, vb) == (4, 4), "the FA2-form kernel: 4/4 bits only"

    def launch():
        fn[(bsz * hkv, ns)](q, bt, lengths, kw, ks, kz, vw, vs, vz, m_ws, l_ws, o_ws, sm_scale * LOG2E, hkv, ns,
                            q.stride(0), q.stride(1), bt.stride(0), kw.stride(0), kw.stride(1), ks.stride(0),
                            ks.stride(1), vw.stride(0), vw.stride(1), vs.stride(0), vs.stride(1),
                            GROUP=GROUP, VALUES=1, num_warps=1, **extra)

    def merge():
        top = m_ws.max(1, keepdim=True).values
        wgt = torch.exp2(m_ws - top).nan_to_num(0.0)
        return ((wgt[:, :, None] * o_ws).sum(1) / (wgt * l_ws).sum(1)[:, None]).reshape(bsz, hq, D)

    return launch, merge


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--emulate", action="store_true")
    ap.add_argument("--sabotage", action="store_true", help="CPU: emulate_t with broken 2-bit maps must fail")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--all", action="store_true", help="re-run (check, and --bench) under every variant's env")
    a = ap.parse_args()
    if a.all:
        import subprocess
        for env in VARIANTS:
            print(f"=== {env or 'defaults'}", flush=True)
            r = subprocess.run([sys.executable, __file__] + (["--bench"] if a.bench else []), env={**os.environ, **env})
            print(f"=== {env or 'defaults'}: rc {r.returncode}", flush=True)
        return
    sm_scale = 1 / math.sqrt(D)
    if a.sabotage:
        sabotage_check(sm_scale)
        return
    if a.emulate:
        tile_algebra_check()
        c = make_case(bsz=2, hkv=2, pages_per_seq=3)
        ref = ref_out(c, sm_scale)
        for ns, vf in ((1, False), (2, False), (2, True)):
            emu = emulate(c, sm_scale, ns, vf)
            err = (emu - ref).abs().max().item()
            print(f"emulation NS={ns} VFOLD={int(vf)}: max |emu - ref| = {err:.3e} "
                  f"(ref max {ref.abs().max().item():.3f})")
            assert err < 2e-2, err
        # the transposed kernel's maps for 4- and 2-bit codes, partial last steps included (emulate_t)
        lens = torch.tensor([3 * P, 2 * P - 17], dtype=torch.int32)
        for kb, vb in ((4, 4), (2, 2), (4, 2), (2, 4)):
            c = make_case(bsz=2, hkv=2, pages_per_seq=3, lengths=lens, kbits=kb, vbits=vb)
            ref = ref_out(c, sm_scale)
            for ns in (1, 2):
                err = (emulate_t(c, sm_scale, ns) - ref).abs().max().item() / ref.abs().max().item()
                print(f"emulation (transposed) {kb}/{vb} bits NS={ns} lengths {lens.tolist()}: max |emu - ref| / "
                      f"max |ref| = {err:.3e}")
                assert err < 1e-2, err
        print("emulation OK: index maps and unpack arithmetic match kivi_cache.reference")
        return
    from kivi_cache.kernels import paged_decode_attention
    dev = "cuda"
    cases = [(2, 3, 1, None), (4, 8, 2, None), (3, 16, 4, None),
             # partial last steps (transposed kernel only): a multiple of G (as the cache flushes), and any length
             (3, 8, 2, [8 * P - 32, 5 * P + 32, 32]), (2, 8, 3, [7 * P - 17, 3 * P + 1])]
    # 2-bit codes (transposed kernel only): 2/2 on every case, 4/2 and 2/4 on two; relative errors
    runs = [(cs, (4, 4)) for cs in cases] + [(cs, (2, 2)) for cs in cases] + [
        (cases[1], (4, 2)), (cases[4], (4, 2)), (cases[1], (2, 4)), (cases[4], (2, 4))]
    if os.environ.get("GD_VFOLD", "0") != "0" or os.environ.get("GD_VEARLY", "0") != "0":
        runs = [r for r in runs if r[1][1] == 4]  # VFOLD / VEARLY: 4-bit values only
    for (bsz, pps, ns, lens), (kb, vb) in runs:
        lens = None if lens is None else torch.tensor(lens, dtype=torch.int32)
        c = make_case(bsz=bsz, pages_per_seq=pps, device=dev, lengths=lens, kbits=kb, vbits=vb)
        ref = ref_out(c, sm_scale)
        rmax = ref.abs().max().item()
        args = [c[k] for k in ("q", "block_table", "lengths", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale",
                               "v_zero", "res_k", "res_v", "res_lengths")]
        base = paged_decode_attention(*args, kb, vb, G, sm_scale, num_splits=ns).float()
        line = (f"{kb}/{vb} bits B={bsz} pages={pps} NS={ns}: existing kernel rel err "
                f"{(base - ref).abs().max().item() / rmax:.2e}")
        for tr in ((False, True) if lens is None and (kb, vb) == (4, 4) else (True,)):
            launch, merge = gluon_decode(c, sm_scale, ns, tr)
            launch()
            out = merge()
            err = (out - ref).abs().max().item() / rmax
            line += f"; gluon{'-T' if tr else ''} rel err {err:.2e}"
            assert err < 1e-2, (tr, kb, vb, err)
        print(line)
    print("GPU check OK")
    if a.bench:
        from triton.testing import do_bench
        for bsz, pps in ((8, 64), (32, 64), (64, 32), (16, 256)):
            c = make_case(bsz=bsz, pages_per_seq=pps, device=dev,
                          lengths=torch.full((bsz,), pps * P, dtype=torch.int32))
            args = [c[k] for k in ("q", "block_table", "lengths", "k_codes", "k_scale", "k_zero", "v_codes",
                                   "v_scale", "v_zero", "res_k", "res_v", "res_lengths")]
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            ns = max(1, min(pps, (4 * sms) // (bsz * 8)))
            t_base = do_bench(lambda args=args, ns=ns: paged_decode_attention(*args, BITS, BITS, G, sm_scale,
                                                                              num_splits=ns))
            res = f"B={bsz} ctx={pps * P} NS={ns}: existing op {t_base * 1e3:.1f} us"
            for tr in (False, True):
                launch, merge = gluon_decode(c, sm_scale, ns, tr)
                t = do_bench(launch)
                res += f"; gluon{'-T' if tr else ''} split kernel {t * 1e3:.1f} us"
            print(res, "(gluon: split kernel only; the merge is in torch and not timed)")


if __name__ == "__main__":
    main()

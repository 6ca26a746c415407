"""kernels/quantize.py: quantize_and_write, and append_and_flush (a compiled decode step's window write and flush),
against the torch reference: the same scales and zero points, codes equal but at rounding ties, nothing else
written; with clipping (``clip_keys``/``clip_values``) the same bytes but at near ties of the range search. Builders:
kernel_cases.py."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import BITS, DEV, ON_GPU, make_pool, rel_err

from kivi_cache import quant as Q
from kivi_cache import reference as R
from kivi_cache.kernels import api as K
from kivi_cache.kernels import tuning as KT
from kivi_cache.kernels.checks import CLIP_STEPS
from kivi_cache.quant import unpack, unpack_tokens


def _check_quantized(pool_k, pool_r, kb, vb, g, pages, slots, tag):
    kc_k, ks_k, kz_k, vc_k, vs_k, vz_k = pool_k
    kc_r, ks_r, kz_r, vc_r, vs_r, vz_r = pool_r
    # scales and zeros: identical computation -> identical values (NaN poison everywhere else too)
    for a, b_ in ((ks_k, ks_r), (kz_k, kz_r), (vs_k, vs_r), (vz_k, vz_r)):
        assert torch.equal(a.isnan(), b_.isnan()), f"{tag}: scale/zero written at the wrong places"
        torch.testing.assert_close(a.nan_to_num(), b_.nan_to_num(), rtol=0, atol=0)
    # codes: exact except at rounding ties (off by one step)
    for bits, a, b_ in ((kb, kc_k, kc_r), (vb, vc_k, vc_r)):
        ua, ub = unpack(a, bits).int(), unpack(b_, bits).int()
        diff = (ua - ub).abs()
        assert diff.max() <= 1, f"{tag}: code differs by more than one step"
        frac = (diff == 0).double().mean().item()
        assert frac > 0.999, f"{tag}: only {frac:.5f} of codes match"


@pytest.mark.parametrize("kb,vb", BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_quantize_and_write(kb, vb, dtype):
    n, h, g, d, p, np_ = 5, 2, 32, 64, 64, 6
    k = torch.randn(n, h, g, d, device=DEV).to(dtype) * 2
    v = torch.randn(n, h, g, d, device=DEV).to(dtype)
    k[1, 0, :, 3] = 0.75  # constant key channel -> scale 0, codes 0
    v[2, 1, 5, :] = -1.25  # constant value groups
    pages = torch.tensor([0, 3, 3, 5, 1], device=DEV)
    slots = torch.tensor([32, 0, 32, 0, 32], device=DEV)
    base = make_pool(np_, h, p, d, g, kb, vb, dtype)
    base = tuple(t.fill_(float("nan")) if t.is_floating_point() else t for t in base)
    pool_k = tuple(t.clone() for t in base)
    pool_r = tuple(t.clone() for t in base)
    K.quantize_and_write(k, v, pages, slots, *pool_k, kb, vb, g)
    R.quantize_and_write(k, v, pages, slots, *pool_r, kb, vb, g)
    _check_quantized(pool_k, pool_r, kb, vb, g, pages, slots, f"quant {kb}/{vb} {dtype}")
    # round trip through the kernels' own dequantization: within half a step (+ rounding)
    bt = torch.tensor([[3, 5]], device=DEV, dtype=torch.int32)  # fully written: page 3, first group of page 5
    n_tok = torch.tensor([96], device=DEV)
    kk, vv = K.dequantize_pages(bt, n_tok, *pool_k, kb, vb, g)
    kr, vr = R.dequantize_pages(bt, n_tok, *pool_r, kb, vb, g)
    assert torch.isfinite(kk).all() and torch.isfinite(vv).all()
    orig_k = torch.cat([k[1], k[2], k[3]], dim=1)[None].float()  # [1, H, 96, D]
    step = kr.float().sub(kk.float()).abs().max().item()
    rel_err(kk.float(), orig_k, f"quant-roundtrip-k {kb}b {dtype}")
    # within one quantization step of the reference dequantization
    assert (step <= pool_r[1][3].float().max().item() * 1.01 + 1e-3
            or step <= pool_r[1][5, :, 0].float().max().item() * 1.01)


@pytest.mark.parametrize("split", [False, True])
def test_quantize_and_write_programs(split):
    """Keys and values in separate programs (the default, ``QuantTuning.split``) or one program for both: the same
    bytes as the reference, other pages untouched."""
    n, h, g, d, p = 3, 3, 32, 64, 64
    k = torch.randn(n, h, g, d, device=DEV).to(torch.float16)
    v = torch.randn(n, h, g, d, device=DEV).to(torch.float16)
    pages, slots = torch.tensor([2, 0, 2], device=DEV), torch.tensor([0, 32, 32], device=DEV)
    base = tuple(t.fill_(float("nan")) if t.is_floating_point() else t
                 for t in make_pool(4, h, p, d, g, 4, 2, torch.float16))
    pool_k, pool_r = tuple(t.clone() for t in base), tuple(t.clone() for t in base)
    K.quantize_and_write(k, v, pages, slots, *pool_k, 4, 2, g, tuning=KT.QuantTuning(split=split))
    R.quantize_and_write(k, v, pages, slots, *pool_r, 4, 2, g)
    for a, b_ in zip(pool_k, pool_r, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b_.nan_to_num(7.0))


def test_quantize_and_write_empty():
    pool = make_pool(2, 1, 32, 64, 32, 4, 4, torch.float16)
    snap = [t.clone() for t in pool]
    e = torch.zeros(0, 1, 32, 64, device=DEV, dtype=torch.float16)
    none = torch.zeros(0, device=DEV, dtype=torch.long)
    K.quantize_and_write(e, e, none, none, *pool, 4, 4, 32)
    for a, b_ in zip(pool, snap, strict=True):
        assert torch.equal(a.nan_to_num(), b_.nan_to_num())


@pytest.mark.parametrize("kb,vb,dtype,r_win", [(4, 4, torch.float16, 40), (2, 2, torch.float32, 64),
                                                (2, 4, torch.float16, 0)])
def test_append_and_flush(kb, vb, dtype, r_win):
    """A compiled decode step's window write and flush against the reference: windows bit-equal (poisoned slots past
    the tokens untouched), the flushed groups' pages as quantize_and_write writes them, nothing else written, the
    lengths only read. Sequences: full (page columns 0 and 1, slots 32 and 0), not full, sinks still arriving."""
    bsz, h, g, d, p, sinks = 5, 2, 32, 64, 64, 2
    cap = sinks + r_win + g
    full_r = sinks + r_win + g - 1  # the window's length before a step that fills it
    rl = torch.tensor([full_r, sinks + r_win // 2 + 3, 1, full_r, full_r], dtype=torch.int32, device=DEV)
    sl = torch.tensor([2, 2, 1, 2, 2], dtype=torch.int32, device=DEV)
    ql = torch.tensor([32, 96, 0, 64, 0], dtype=torch.int32, device=DEV)
    bt = torch.tensor([[4, 1], [0, 6], [2, 7], [3, 5], [8, 9]], dtype=torch.int32, device=DEV)
    res_k = torch.full((bsz, h, cap, d), float("nan"), dtype=dtype, device=DEV)
    res_v = res_k.clone()
    for b, n in enumerate(rl.tolist()):
        res_k[b, :, :n] = torch.randn(h, n, d, device=DEV).to(dtype) * 2
        res_v[b, :, :n] = torch.randn(h, n, d, device=DEV).to(dtype)
    new_k = torch.randn(bsz, h, 1, d, device=DEV).to(dtype)
    new_v = torch.randn(bsz, h, 1, d, device=DEV).to(dtype)
    base = make_pool(10, h, p, d, g, kb, vb, dtype)
    base = tuple(t.fill_(float("nan")) if t.is_floating_point() else t for t in base)
    before = (rl.clone(), sl.clone(), ql.clone())
    out = {}
    for name, mod in (("kernel", K), ("reference", R)):
        win = (res_k.clone(), res_v.clone())
        pool = tuple(t.clone() for t in base)
        mod.append_and_flush(new_k, new_v, *win, rl, sl, ql, bt, *pool, kb, vb, g, r_win, sinks)
        out[name] = (win, pool)
    (wk, pk), (wr, pr) = out["kernel"], out["reference"]
    for a, b_ in zip(wk, wr, strict=True):
        torch.testing.assert_close(a, b_, rtol=0, atol=0, equal_nan=True)
    rows = torch.arange(bsz, device=DEV)
    after = []  # the windows after the token's write, before any flush
    for res, new in ((res_k, new_k), (res_v, new_v)):
        w = res.clone()
        w[rows, :, rl.long()] = new[:, :, 0]
        after.append(w)
    for b in (1, 2):  # not full: the write only
        assert torch.equal(wr[0][b].nan_to_num(), after[0][b].nan_to_num())
    assert torch.equal(wr[1][0, :, sinks:sinks + r_win], after[1][0, :, sinks + g:sinks + g + r_win])
    pages, slots = torch.tensor([4, 5, 8], device=DEV), torch.tensor([32, 0, 0], device=DEV)
    _check_quantized(pk, pr, kb, vb, g, pages, slots, f"append-flush {kb}/{vb} {dtype} R={r_win}")
    ref = tuple(t.clone() for t in base)  # the same groups through quantize_and_write
    idx = torch.tensor([0, 3, 4], device=DEV)
    R.quantize_and_write(after[0][idx, :, sinks:sinks + g], after[1][idx, :, sinks:sinks + g], pages, slots, *ref,
                         kb, vb, g)
    for a, b_ in zip(pr, ref, strict=True):
        torch.testing.assert_close(a, b_, rtol=0, atol=0, equal_nan=True)
    for a, b_ in zip((rl, sl, ql), before, strict=True):
        assert torch.equal(a, b_)


# ----------------------------------------------------------------------------- clipping (the range search)

CLIPS = [(True, False), (False, True), (True, True)]  # (clip_keys, clip_values)
TIE = 1e-5  # candidate errors this close (relative) may be ordered either way by another fp32 summation order


def _heavy(n, h, g, d, dtype, outlier_dim):
    """Random [N, H, G, D] groups with outliers within groups: a few tokens (outlier_dim 2: the key groups, per channel
    over tokens) or channels (3: the value groups, per token over channels) scaled up, and scattered spikes."""
    x = torch.randn(n, h, g, d, device=DEV)
    shape = [1, 1, 1, 1]
    shape[outlier_dim] = x.shape[outlier_dim]
    x = x * torch.where(torch.rand(shape, device=DEV) < 0.1, 6.0, 1.0)
    x = torch.where(torch.rand(x.shape, device=DEV) < 0.02, x * 10, x)
    return x.to(dtype)


def _grouped(x, keys: bool, g: int):
    """[N, H, G, D] -> (groups, reduced dim) as quantize_keys / quantize_values group them."""
    n, h, t, d = x.shape
    return (x.reshape(n, h, 1, t, d), -2) if keys else (x.reshape(n, h, t, d // g, g), -1)


def _candidate_errors(x, dim, bits, sdt):
    """(fp32 squared error [CLIP_STEPS, ...] of each candidate of the range search, with the reduced dim squeezed; the
    clamped fp32 groups), with the reference's functions (kivi_cache.quant._quantize)."""
    xf = x.float()
    poison = (xf - xf).sum(dim=dim, keepdim=True)
    c = Q.range_bound(sdt)
    xf = xf.clamp(-c, c)
    lo, hi = xf.amin(dim=dim, keepdim=True), xf.amax(dim=dim, keepdim=True)
    errs = []
    for i in range(CLIP_STEPS):
        cut = (hi - lo) * (i / 32)
        cand = Q._quantize_range(xf, *((lo + cut, hi - cut) if i else (lo, hi)), poison, bits, sdt)
        errs.append(Q._squared_error(xf, *cand, dim).squeeze(dim))
    return torch.stack(errs), xf


def _near_ties(errs):
    """Groups whose best candidate error has another candidate's within TIE (relative); never a NaN group."""
    best = errs.amin(0)
    return ((errs - best).abs() <= TIE * best).sum(0) >= 2


def _written(pool, pages, slots, kb, vb, g):
    """The groups written at (pages[n], slots[n]) as quantize_keys / quantize_values return them (codes unpacked):
    key codes [N, H, G, D], scales and zeros [N, H, 1, D]; value codes [N, H, G, D], scales and zeros
    [N, H, G, D // G]."""
    kc, ks, kz, vc, vs, vz = pool
    out = [[] for _ in range(6)]
    for p, s in zip(pages.tolist(), slots.tolist(), strict=True):
        out[0].append(unpack(kc[p, :, s:s + g], kb))
        out[1].append(ks[p, :, s // g][:, None])
        out[2].append(kz[p, :, s // g][:, None])
        out[3].append(unpack_tokens(vc[p], vb)[:, :, s:s + g].transpose(-1, -2))
        out[4].append(vs[p, :, :, s:s + g].transpose(-1, -2))
        out[5].append(vz[p, :, :, s:s + g].transpose(-1, -2))
    return tuple(torch.stack(t) for t in out)


def _unwritten(pool, pages, slots, kb, vb, g):
    """A copy of ``pool`` with the groups written at (pages, slots) zeroed."""
    pool = tuple(t.clone() for t in pool)
    kc, ks, kz, vc, vs, vz = pool
    for p, s in zip(pages.tolist(), slots.tolist(), strict=True):
        kc[p, :, s:s + g] = 0
        ks[p, :, s // g] = 0
        kz[p, :, s // g] = 0
        vc[p, :, :, s * vb // 8:(s + g) * vb // 8] = 0
        vs[p, :, :, s:s + g] = 0
        vz[p, :, :, s:s + g] = 0
    return pool


def _bits(t):
    """Floating tensor -> its bit patterns (every NaN one pattern)."""
    ints = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(ints)


def _check_clipped(pool_k, pool_r, groups, pages, slots, kb, vb, g, clips, tag):
    """The kernel's pool against the reference's: nothing but the groups written; each group's codes, scale and zero
    bit-equal, except in near ties of the range search (clip on), where the kernel's group error is the reference's
    within TIE. ``groups``: the written (k, v) ``[N, H, G, D]``. Returns the fraction of near ties (keys, values)."""
    for a, b_ in zip(_unwritten(pool_k, pages, slots, kb, vb, g), _unwritten(pool_r, pages, slots, kb, vb, g),
                     strict=True):
        assert torch.equal(a.nan_to_num(7.0), b_.nan_to_num(7.0)), f"{tag}: written outside the groups"
    wk, wr = _written(pool_k, pages, slots, kb, vb, g), _written(pool_r, pages, slots, kb, vb, g)
    ties = []
    for part, (x, bits, clip) in enumerate(zip(groups, (kb, vb), clips, strict=True)):
        keys = part == 0
        name = f"{tag} {'keys' if keys else 'values'}"
        (ck, sk, zk), (cr, sr, zr) = wk[3 * part:3 * part + 3], wr[3 * part:3 * part + 3]
        xg, dim = _grouped(x, keys, g)
        errs, xf = _candidate_errors(xg, dim, bits, sr.dtype)
        tie = _near_ties(errs) if clip else torch.zeros_like(sr, dtype=torch.bool)
        ties.append(tie.double().mean().item())
        code_tie = tie.unsqueeze(dim).expand(_grouped(ck, keys, g)[0].shape).reshape(ck.shape)
        assert torch.equal(ck[~code_tie], cr[~code_tie]), f"{name}: codes differ"
        for a, b_ in ((sk, sr), (zk, zr)):
            assert torch.equal(_bits(a)[~tie], _bits(b_)[~tie]), f"{name}: scales or zeros differ"
        if tie.any():  # either candidate of a near tie: the same error within TIE
            e = [Q._squared_error(xf, _grouped(c, keys, g)[0], s.unsqueeze(dim), z.unsqueeze(dim), dim).squeeze(dim)
                 for c, s, z in ((ck, sk, zk), (cr, sr, zr))]
            assert ((e[0] - e[1]).abs() <= TIE * e[1] + 1e-30)[tie].all(), f"{name}: a near tie's error differs"
    return ties


# the interpreter casts fp32 to bf16 by truncation: the zero point of a narrowed range (no bf16 value, unlike a group's
# minimum) then differs from the reference's round to nearest; bf16 on the GPU only (KIVI_TEST_GPU=1)
BF16_GPU = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not ON_GPU, reason="interpreter: bf16 casts truncate"))


@pytest.mark.parametrize("clips", CLIPS, ids=["keys", "values", "both"])
@pytest.mark.parametrize("kb,vb", BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, BF16_GPU], ids=str)
def test_quantize_and_write_clip(kb, vb, dtype, clips):
    """clip_keys / clip_values: the reference's bytes (but at near ties of the range search) on groups with outlier
    tokens (keys) and channels (values); 3 groups, 3 heads; nothing else written."""
    n, h, g, d, p = 3, 3, 32, 64, 64
    k = _heavy(n, h, g, d, dtype, 2) * 2
    v = _heavy(n, h, g, d, dtype, 3)
    k[1, 0, :, 3] = 0.75  # a constant key channel: every candidate the same
    pages, slots = torch.tensor([2, 0, 2], device=DEV), torch.tensor([32, 0, 0], device=DEV)
    base = tuple(t.fill_(float("nan")) if t.is_floating_point() else t
                 for t in make_pool(4, h, p, d, g, kb, vb, dtype))
    pool_k, pool_r = tuple(t.clone() for t in base), tuple(t.clone() for t in base)
    ck, cv = clips
    K.quantize_and_write(k, v, pages, slots, *pool_k, kb, vb, g, clip_keys=ck, clip_values=cv)
    R.quantize_and_write(k, v, pages, slots, *pool_r, kb, vb, g, clip_keys=ck, clip_values=cv)
    ties = _check_clipped(pool_k, pool_r, (k, v), pages, slots, kb, vb, g, clips, f"clip {kb}/{vb} {dtype} {clips}")
    assert max(ties) < 0.2, ties


@pytest.mark.parametrize("clips", CLIPS, ids=["keys", "values", "both"])
@pytest.mark.parametrize("kb,vb,dtype,r_win", [(4, 4, torch.float16, 40), (2, 2, torch.float32, 64),
                                                (2, 4, torch.float16, 0), (8, 8, torch.float32, 8)])
def test_append_and_flush_clip(kb, vb, dtype, r_win, clips):
    """append_and_flush with clip_keys / clip_values: the windows bit-equal to the reference's, the flushed groups
    (sequences 0 and 2 of 3 full) as the reference writes them, but at near ties of the range search."""
    bsz, h, g, d, p, sinks = 3, 3, 32, 64, 64, 2
    cap = sinks + r_win + g
    full_r = sinks + r_win + g - 1
    rl = torch.tensor([full_r, sinks + r_win // 2 + 3, full_r], dtype=torch.int32, device=DEV)
    sl = torch.tensor([2, 2, 2], dtype=torch.int32, device=DEV)
    ql = torch.tensor([32, 96, 64], dtype=torch.int32, device=DEV)
    bt = torch.tensor([[4, 1], [0, 6], [3, 5]], dtype=torch.int32, device=DEV)
    res_k = torch.full((bsz, h, cap, d), float("nan"), dtype=dtype, device=DEV)
    res_v = res_k.clone()
    res_k[:, :, :cap - 1] = _heavy(bsz, h, cap - 1, d, dtype, 2) * 2
    res_v[:, :, :cap - 1] = _heavy(bsz, h, cap - 1, d, dtype, 3)
    for b, n in enumerate(rl.tolist()):
        res_k[b, :, n:] = res_v[b, :, n:] = float("nan")
    new_k = _heavy(bsz, h, 1, d, dtype, 2)
    new_v = _heavy(bsz, h, 1, d, dtype, 3)
    base = tuple(t.fill_(float("nan")) if t.is_floating_point() else t
                 for t in make_pool(7, h, p, d, g, kb, vb, dtype))
    ck, cv = clips
    out = {}
    for name, mod in (("kernel", K), ("reference", R)):
        win = (res_k.clone(), res_v.clone())
        pool = tuple(t.clone() for t in base)
        mod.append_and_flush(new_k, new_v, *win, rl, sl, ql, bt, *pool, kb, vb, g, r_win, sinks, clip_keys=ck,
                             clip_values=cv)
        out[name] = (win, pool)
    (wk, pk), (wr, pr) = out["kernel"], out["reference"]
    for a, b_ in zip(wk, wr, strict=True):
        torch.testing.assert_close(a, b_, rtol=0, atol=0, equal_nan=True)
    idx = torch.tensor([0, 2], device=DEV)
    groups = []
    for res, new in ((res_k, new_k), (res_v, new_v)):
        w = res[idx].clone()
        w[:, :, full_r] = new[idx, :, 0]
        groups.append(w[:, :, sinks:sinks + g])
    pages, slots = torch.tensor([4, 5], device=DEV), torch.tensor([32, 0], device=DEV)
    _check_clipped(pk, pr, groups, pages, slots, kb, vb, g, clips, f"append-flush clip {kb}/{vb} {dtype} {clips}")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter: inf - inf
def test_clip_changes_groups_and_keeps_nan_groups():
    """At 2 bits the range search picks a narrowed range for a good part of the groups with outliers (the kernel's
    bytes differ from its unclipped ones there), and a group holding a NaN or an inf keeps NaN scales and zeros,
    codes 0, the other groups unaffected."""
    n, h, g, d, p, dtype = 3, 3, 32, 64, 64, torch.float16
    k = _heavy(n, h, g, d, dtype, 2)
    v = _heavy(n, h, g, d, dtype, 3)
    k[0, 1, 7, 5] = float("nan")  # key group (0, 1, channel 5)
    k[2, 0, 3, 9] = float("inf")  # key group (2, 0, channel 9)
    v[1, 2, 4, 40] = float("nan")  # value group (1, 2, token 4, channels 32..63)
    v[2, 1, 0, 1] = float("-inf")  # value group (2, 1, token 0, channels 0..31)
    pages, slots = torch.tensor([1, 0, 1], device=DEV), torch.tensor([0, 32, 32], device=DEV)
    base = tuple(t.fill_(float("nan")) if t.is_floating_point() else t for t in make_pool(2, h, p, d, g, 2, 2, dtype))
    got = {}
    for clip in (False, True):
        pool = tuple(t.clone() for t in base)
        K.quantize_and_write(k, v, pages, slots, *pool, 2, 2, g, clip_keys=clip, clip_values=clip)
        got[clip] = _written(pool, pages, slots, 2, 2, g)
        if clip:
            pool_r = tuple(t.clone() for t in base)
            R.quantize_and_write(k, v, pages, slots, *pool_r, 2, 2, g, clip_keys=True, clip_values=True)
            _check_clipped(pool, pool_r, (k, v), pages, slots, 2, 2, g, (True, True), "clip nan")
    nan_k = torch.zeros(n, h, 1, d, dtype=torch.bool, device=DEV)
    nan_k[0, 1, 0, 5] = nan_k[2, 0, 0, 9] = True
    nan_v = torch.zeros(n, h, g, d // g, dtype=torch.bool, device=DEV)
    nan_v[1, 2, 4, 1] = nan_v[2, 1, 0, 0] = True
    for part, nan in ((0, nan_k), (1, nan_v)):
        codes, scale, zero = got[True][3 * part:3 * part + 3]
        plain = got[False][3 * part:3 * part + 3]
        for t in (scale, zero):
            assert torch.equal(t.isnan(), nan)
        keys = part == 0
        dim = -2 if keys else -1
        cg = _grouped(codes, keys, g)[0]
        assert (cg.amax(dim) == 0)[nan].all()
        changed = (scale != plain[1]) | (zero != plain[2])  # NaN groups: NaN != NaN, excluded below
        frac = changed[~nan].double().mean().item()
        assert frac > 0.2, f"{'keys' if keys else 'values'}: only {frac:.3f} of the groups clipped"


def test_clip_flags_reach_the_launch(monkeypatch):
    """The clip flags are constexprs of both kernels (in their meta, hence in the direct launches' plan keys)."""
    from kivi_cache.kernels import quantize as QK

    seen = []
    monkeypatch.setattr(QK, "_QUANT", lambda key, grid, args, meta: seen.append((key, meta)))
    monkeypatch.setattr(QK, "_APPEND", lambda key, grid, args, meta: seen.append((key, meta)))
    h, g, d = 2, 32, 64
    pool = make_pool(2, h, 64, d, g, 4, 4, torch.float16)
    x = torch.randn(1, h, g, d, device=DEV).to(torch.float16)
    one = torch.zeros(1, dtype=torch.long, device=DEV)
    res = torch.zeros(1, h, g + 2, d, dtype=torch.float16, device=DEV)
    ints = [torch.zeros(1, dtype=torch.int32, device=DEV) for _ in range(3)]
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    for ck, cv in [(False, False), *CLIPS]:
        K.quantize_and_write(x, x, one, one, *pool, 4, 4, g, clip_keys=ck, clip_values=cv)
        K.append_and_flush(x[:, :, 0], x[:, :, 0], res, res.clone(), *ints, bt, *pool, 4, 4, g, 0, 2, clip_keys=ck,
                           clip_values=cv)
    metas = [(m["CLIP_K"], m["CLIP_V"]) for _, m in seen]
    assert metas == [c for c in [(False, False), *CLIPS] for _ in range(2)]
    for op in (0, 1):
        keys = [k for k, _ in seen[op::2]]
        assert len(set(keys)) == 4, f"op {op}: the clip flags do not distinguish the plan keys"

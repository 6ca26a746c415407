"""kernels/quantize.py: quantize_and_write, and append_and_flush (a compiled decode step's window write and flush),
against the torch reference: the same scales and zero points, codes equal but at rounding ties, nothing else
written. Builders: kernel_cases.py."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import BITS, DEV, make_pool, rel_err

from kivi_cache import reference as R
from kivi_cache.kernels import api as K
from kivi_cache.kernels import tuning as KT
from kivi_cache.quant import unpack


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

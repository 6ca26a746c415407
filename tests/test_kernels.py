"""Triton kernels vs the torch reference (kivi_cache.reference).

Runs under the Triton interpreter on CPU (conftest.py sets
TRITON_INTERPRET=1); with KIVI_TEST_GPU=1 the same tests run on the CUDA device.
Shapes are tiny so the interpreter finishes in a couple of minutes.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from kivi_cache import reference as R
from kivi_cache.kernels import api as K
from kivi_cache.kernels import decode as KD
from kivi_cache.kernels import decode_plan as KP
from kivi_cache.kernels import decode_split as KS
from kivi_cache.kernels import tuning as KT
from kivi_cache.quant import qmax, unpack

ON_GPU = os.environ.get("KIVI_TEST_GPU") == "1" and torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")
HALF = KT.DecodeTuning(dot="half")  # fp16/bf16 dots under the interpreter too: the GPU's arithmetic
TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}
BITS = [(2, 2), (4, 4), (8, 8), (2, 4)]
MAX_ERR: dict = {}


def rel_err(out, ref, tag):
    out, ref = out.double(), ref.double()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    MAX_ERR[tag] = max(MAX_ERR.get(tag, 0.0), err)
    print(f"[{tag}] rel err {err:.2e}")
    return err


def make_pool(np_, h, p, d, g, kb, vb, dtype, gen=None):
    """A pool of random codes with scales giving values of order 1."""
    kc = torch.randint(0, 256, (np_, h, p, d * kb // 8), dtype=torch.uint8, device=DEV)
    vc = torch.randint(0, 256, (np_, h, d, p * vb // 8), dtype=torch.uint8, device=DEV)  # channel rows
    ks = (torch.rand(np_, h, p // g, d, device=DEV) * 3 / qmax(kb)).to(dtype)
    kz = (torch.randn(np_, h, p // g, d, device=DEV) - 1.5).to(dtype)
    vs = (torch.rand(np_, h, d // g, p, device=DEV) * 3 / qmax(vb)).to(dtype)  # token-contiguous
    vz = (torch.randn(np_, h, d // g, p, device=DEV) - 1.5).to(dtype)
    return kc, ks, kz, vc, vs, vz


def make_block_table(lengths, p, width=None):
    """Distinct random pages per sequence; -1 in unused entries."""
    need = [-(-int(n) // p) for n in lengths]
    width = width or max(1, max(need))
    total = sum(need)
    perm = torch.randperm(total + 3)
    bt = torch.full((len(lengths), width), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i:i + n].to(torch.int32)
        i += n
    return bt.to(DEV), total + 3


def decode_case(bsz, hkv, grp, d, p, g, kb, vb, dtype, lengths, res_lengths, c=None, width=None):
    lengths = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    bt, np_ = make_block_table(lengths.tolist(), p, width)
    pool = make_pool(np_, hkv, p, d, g, kb, vb, dtype)
    c = c or max(1, max(res_lengths))
    res_k = torch.randn(bsz, hkv, c, d, device=DEV).to(dtype)
    res_v = torch.randn(bsz, hkv, c, d, device=DEV).to(dtype)
    rl = torch.tensor(res_lengths, dtype=torch.int32, device=DEV)
    q = torch.randn(bsz, hkv * grp, d, device=DEV).to(dtype)
    return (q, bt, lengths, *pool, res_k, res_v, rl, kb, vb, g, 1.0 / math.sqrt(d))


def run_decode(args, tag, **kw):
    q = args[0]
    out = torch.full_like(q, float("nan"))
    got = K.paged_decode_attention(*args, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all(), "decode left unwritten (NaN) outputs"
    ref = R.paged_decode_attention(*args)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    err = rel_err(out, ref, tag)
    assert err < TOL[q.dtype], f"{tag}: relative error {err:.2e}"


def patch_default_decode_tuning(monkeypatch, **fields):
    """``kernels.tuning.DEFAULT`` with these decode settings for the rest of the test: for code the test does not
    call directly (``ops.DecodeRunner``, the compiled-mode op), which runs under the default."""
    monkeypatch.setattr(KT, "DEFAULT", KT.Tuning(decode=KT.DecodeTuning(**fields)))


def window_with_token(res_k, res_v, res_lengths, new_k, new_v):
    """The windows expected after a decode call that writes the step's token (``new_k/new_v`` ``[B, H, D]``) at
    ``res_lengths[b] - 1`` of every sequence with a non-empty window: copies, the inputs untouched."""
    want_k, want_v = res_k.clone(), res_v.clone()
    for b, r in enumerate(res_lengths.tolist()):
        if r > 0:
            want_k[b, :, r - 1] = new_k[b]
            want_v[b, :, r - 1] = new_v[b]
    return want_k, want_v


# ----------------------------------------------------------------------------- misc

def test_available():
    assert K.available()


def test_kernels_take_the_references_arguments():
    """kernels/api.py: each public function is the twin of the reference's, "same signature ... a few extra
    keyword-only tuning arguments": the reference's parameters, in its order, of the same kind and default, and the
    extra ones keyword-only (a call written against the reference runs on the kernels)."""
    import inspect

    for name in ("quantize_and_write", "append_and_flush", "dequantize_pages", "paged_decode_attention",
                 "paged_prefix_attention"):
        kern = inspect.signature(getattr(K, name)).parameters
        ref = inspect.signature(getattr(R, name)).parameters
        assert [n for n in kern if n in ref] == list(ref), name
        for n, p in ref.items():
            assert (kern[n].kind, kern[n].default) == (p.kind, p.default), (name, n)
        assert all(p.kind == p.KEYWORD_ONLY for n, p in kern.items() if n not in ref), name


def test_head_dim_rejected():
    d = 96
    pool = make_pool(2, 1, 32, d, 32, 4, 4, torch.float16)
    q = torch.randn(1, 1, d, device=DEV, dtype=torch.float16)
    res = torch.randn(1, 1, 4, d, device=DEV, dtype=torch.float16)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    one = torch.ones(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="head_dim"):
        K.paged_decode_attention(q, bt, one * 32, *pool, res, res, one, 4, 4, 32, 0.1)
    kv = torch.randn(1, 1, 32, d, device=DEV, dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim"):
        K.quantize_and_write(kv, kv, one, one * 0, *pool, 4, 4, 32)


# ----------------------------------------------------------------------------- quantize_and_write

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


# ----------------------------------------------------------------------------- dequantize_pages


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


@pytest.mark.parametrize("kb,vb", BITS)
def test_dequantize_pages(kb, vb):
    g, p, d, h = 32, 64, 64, 2
    lengths = torch.tensor([96, 0, 150], device=DEV)  # not page (nor group) multiples, and an empty sequence
    bt, np_ = make_block_table(lengths.tolist(), p, width=4)
    pool = make_pool(np_, h, p, d, g, kb, vb, torch.float16)
    for max_len in (None, 200):
        ref = R.dequantize_pages(bt, lengths, *pool, kb, vb, g, max_len=max_len)
        t = ref[0].shape[2]
        out = (torch.full((3, h, t, d), float("nan"), device=DEV, dtype=torch.float16),
               torch.full((3, h, t, d), float("nan"), device=DEV, dtype=torch.float16))
        got = K.dequantize_pages(bt, lengths, *pool, kb, vb, g, max_len=max_len, out=out)
        for a, b_ in zip(got, ref, strict=True):
            assert torch.isfinite(a).all()
            assert a.dtype == b_.dtype and a.shape == b_.shape
            torch.testing.assert_close(a.float(), b_.float(), rtol=1e-3, atol=1e-3)


def test_dequantize_pages_empty_batch_and_max_len_past_the_table():
    """An empty batch, and max_len past what the block table covers (zeros there): the reference as the kernels
    (before, it raised RuntimeError: ``lengths.max()`` of no sequences, a reshape past the table), the attention ops
    through it too; a negative max_len is a ValueError in both (before: the reference returned T=0, the kernels
    RuntimeError)."""
    g, p, d, h = 32, 64, 64, 1
    lengths = torch.tensor([96, 32], dtype=torch.int32, device=DEV)
    bt, np_ = make_block_table(lengths.tolist(), p, width=2)
    pool = make_pool(np_, h, p, d, g, 4, 4, torch.float16)
    for impl in (K, R):
        k, v = impl.dequantize_pages(bt, lengths, *pool, 4, 4, g, max_len=300)  # the table covers 128 tokens
        assert k.shape == v.shape == (2, h, 300, d), impl.__name__
        assert not k[:, :, 96:].any() and not v[:, :, 96:].any() and not k[1, :, 32:].any()
        torch.testing.assert_close(k[:, :, :96], R.dequantize_pages(bt, lengths, *pool, 4, 4, g)[0])
        k, v = impl.dequantize_pages(bt[:0], lengths[:0], *pool, 4, 4, g)
        assert k.shape == v.shape == (0, h, 0, d), impl.__name__
        with pytest.raises(ValueError, match="max_len must be None or an int >= 0"):
            impl.dequantize_pages(bt, lengths, *pool, 4, 4, g, max_len=-1)
    q = torch.randn(0, 2, d, device=DEV, dtype=torch.float16)
    win = torch.randn(0, h, 4, d, device=DEV, dtype=torch.float16)
    out = R.paged_decode_attention(q, bt[:0], lengths[:0], *pool, win, win, lengths[:0], 4, 4, g, 0.125)
    assert out.shape == (0, 2, d)


def test_dequantize_pages_fp32_scales():
    g, p, d, h = 32, 32, 64, 1
    lengths = torch.tensor([64, 32], device=DEV)
    bt, np_ = make_block_table(lengths.tolist(), p)
    pool = make_pool(np_, h, p, d, g, 4, 2, torch.float32)
    got = K.dequantize_pages(bt, lengths, *pool, 4, 2, g)
    ref = R.dequantize_pages(bt, lengths, *pool, 4, 2, g)
    for a, b_ in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- decode attention

@pytest.mark.parametrize("kb,vb", BITS)
@pytest.mark.parametrize("grp", [1, 4])
def test_decode_bits_gqa(kb, vb, grp):
    args = decode_case(2, 2, grp, 64, 64, 32, kb, vb, torch.float16, [96, 160], [5, 17])
    run_decode(args, f"decode fp16 {kb}/{vb} grp{grp}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_dtypes(dtype):
    args = decode_case(2, 1, 2, 64, 32, 32, 4, 2, dtype, [64, 128], [3, 31])
    run_decode(args, f"decode {dtype}")


def test_decode_gqa8_and_page32():
    args = decode_case(1, 2, 8, 64, 32, 32, 4, 4, torch.float16, [160], [7])
    run_decode(args, "decode grp8 page32")


@pytest.mark.parametrize("case", ["no_quant", "no_residual", "mixed", "one_empty"])
def test_decode_edge_lengths(case):
    lengths, res = {
        "no_quant": ([0, 0], [3, 30]),
        "no_residual": ([96, 32], [0, 0]),
        "mixed": ([0, 128], [9, 0]),
        "one_empty": ([160, 0], [1, 2]),
    }[case]
    args = decode_case(2, 2, 2, 64, 64, 32, 4, 4, torch.float16, lengths, res, c=32)
    run_decode(args, f"decode {case}")


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_num_splits(splits):
    # more splits than pages leaves empty splits; a wide block table with -1 padding
    args = decode_case(2, 1, 4, 64, 32, 32, 2, 4, torch.float32, [96, 224], [4, 0], width=9)
    run_decode(args, f"decode splits{splits}", num_splits=splits)


@pytest.mark.parametrize("splits", [-1, 0, 2.5, "3"])
def test_decode_num_splits_is_checked(splits):
    """num_splits: None (automatic) or an int >= 1. Before, -1 gave a silent wrong answer (no context split read),
    0 was taken as automatic, a float or a string failed inside the plan with TypeError."""
    args = decode_case(2, 1, 2, 64, 64, 32, 4, 4, torch.float16, [96, 160], [3, 5])
    with pytest.raises(ValueError, match="num_splits must be None \\(automatic\\) or an int >= 1"):
        K.paged_decode_attention(*args, num_splits=splits)


@pytest.mark.parametrize("bsz,hq,d,nsp1,dtype", [(2, 3, 64, 3, torch.float16), (2, 3, 128, 301, torch.float32),
                                                 (2, 3, 256, 130, torch.bfloat16), (128, 4, 64, 5, torch.float16)])
def test_decode_reduce(bsz, hq, d, nsp1, dtype):
    # the merge of split partials alone, many splits (several loop rounds and a partial one), empty
    # splits (-inf max, 0 sum, whatever output) and one all-empty row (-> 0); poisoned output; 512 rows
    # take the whole-row grid
    from kivi_cache.kernels.decode_merge import decode_reduce
    m = torch.randn(bsz * hq, nsp1, device=DEV) * 4
    m[:, ::7] = float("-inf")
    m[-1] = float("-inf")
    l_ = torch.rand(bsz * hq, nsp1, device=DEV) + 0.5
    l_[m == float("-inf")] = 0.0
    o = torch.randn(bsz * hq, nsp1, d, device=DEV)
    out = torch.full((bsz, hq, d), float("nan"), device=DEV, dtype=dtype)
    decode_reduce(m, l_, o, out, hq)
    w = torch.exp2(m - m.amax(1, keepdim=True).nan_to_num(neginf=0.0)).nan_to_num(0.0)
    den = (w * l_).sum(1, keepdim=True)
    ref = ((w[..., None] * o).sum(1) / torch.where(den > 0, den, 1.0)).view(bsz, hq, d)
    assert torch.isfinite(out).all(), "reduce left unwritten (NaN) outputs"
    assert (out[-1, -1] == 0).all()
    assert rel_err(out.float(), ref, f"reduce d{d} n{nsp1}") < TOL[dtype]


def test_resident_programs_and_split_waves():
    # occupancy from a compiled kernel's registers / shared memory / warps (sm_90 limits), as the split
    # rule uses it: the d=128 one-warp kernel (241 registers, 25.6 KB) holds 8 per SM, two warps at 168
    # registers 6, d=256 (47.6 KB shared) 4
    from types import SimpleNamespace

    assert KP.resident_programs(241, 25608, 1) == 8
    assert KP.resident_programs(168, 26120, 2) == 6
    assert KP.resident_programs(246, 47624, 1) == 4
    assert KP.resident_programs(32, 0, 1) == 32  # block limit
    # per sub-partition: 140 registers fit 3 warps in each quarter of the file = 12 (the whole file: 14)
    assert KP.warps_by_registers(140) == 12 and KP.resident_programs(140, 26120, 4) == 3
    fake = SimpleNamespace(n_regs=168, metadata=SimpleNamespace(shared=26120, num_warps=2))
    cpu = torch.device("cpu")
    assert KP._resident_of(fake, cpu) == 6 and KP._resident_of(object(), cpu) is None
    assert KP.resident_programs(241, 25608, 1, sm_shared=167936) == 6  # A100: 164 KB of shared memory per SM



@pytest.mark.parametrize("bsz,hkv,ctx,resident,splits", [
    (1, 8, 131072, 8, 131),  # one wave of ~1000-token splits (measured best on the H200, 132 SMs)
    (1, 8, 32768, 8, 128),  # 256-token splits, one wave
    (1, 8, 8192, 8, 32),  # 256-token minimum
    (1, 32, 131072, 8, 98),  # three waves (the fill of 24 per SM)
    (8, 8, 32768, 8, 32),  # two waves of 1024-token splits
    (8, 8, 131072, 8, 48),
    (32, 8, 32768, 8, 11),
    (32, 32, 4096, 8, 2),
    (32, 8, 32768, 4, 11),  # d=256: 4 programs per SM; the fill (24 programs per SM) gives the same splits
    (1, 8, 131072, 4, 131),  # 4 per SM: one wave is 66 splits, two waves of 1024-token splits
])
def test_split_count_rule(bsz, hkv, ctx, resident, splits):
    assert KP.split_count(bsz, hkv, ctx, 132, resident, t=KT.DecodeTuning()) == splits  # the default settings
    assert KP.split_count(bsz, hkv, ctx, 132, resident) == splits  # (which tuning.DEFAULT holds)


def test_decode_head_dim_128():
    args = decode_case(1, 1, 2, 128, 64, 64, 4, 2, torch.float16, [128], [6])
    run_decode(args, "decode d128 g64")


def test_decode_int4_group_64():
    """4/4 bits with 64-token key groups and 64-channel value groups (two value sub-tiles per group; key codes
    as ODD pairs on the GPU), GQA 4, a partial last page and a long residual."""
    args = decode_case(2, 2, 4, 128, 64, 64, 4, 4, torch.float16, [200, 64], [5, 70])
    run_decode(args, "decode d128 4/4 g64")


def test_decode_group_16_page_48():
    # page size that is not a power of two (48 = 3 groups of 16): 16-token tiles, interpreter only;
    # the GPU path refuses pages not divisible by 32 (wrong results were seen there)
    args = decode_case(2, 1, 2, 64, 48, 16, 4, 4, torch.float16, [80, 144], [2, 5])
    if ON_GPU:
        with pytest.raises(ValueError, match="page_size"):
            K.paged_decode_attention(*args)
        return
    run_decode(args, "decode g16 page48")


def test_decode_group_16_page_96():
    args = decode_case(2, 1, 2, 64, 96, 16, 4, 4, torch.float16, [80, 208], [2, 5])
    run_decode(args, "decode g16 page96")


@settings(max_examples=6, deadline=None)
@given(
    bsz=st.integers(1, 3),
    hkv=st.integers(1, 2),
    grp=st.sampled_from([1, 2, 4]),
    bits=st.sampled_from(BITS),
    page_groups=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_decode_hypothesis(bsz, hkv, grp, bits, page_groups, data):
    g = 32
    p = g * page_groups
    lengths = data.draw(st.lists(st.integers(0, 5), min_size=bsz, max_size=bsz))
    lengths = [n * g for n in lengths]
    res = data.draw(st.lists(st.integers(0, 40), min_size=bsz, max_size=bsz))
    if all(n == 0 for n in lengths) and all(r == 0 for r in res):
        res[0] = 1
    for b in range(bsz):
        if lengths[b] == 0 and res[b] == 0:
            res[b] = 1  # a sequence with no token at all has no defined attention
    args = decode_case(bsz, hkv, grp, 64, p, g, bits[0], bits[1], torch.float16, lengths, res, c=40)
    run_decode(args, "decode hypothesis")


@settings(max_examples=5, deadline=None)
@given(
    bsz=st.integers(1, 3),
    grp=st.sampled_from([1, 4]),
    fuse=st.booleans(),
    newkv=st.booleans(),
    data=st.data(),
)
def test_decode_window_chunks_hypothesis(bsz, grp, fuse, newkv, data):
    """Random window lengths (0..150 of 150 slots) read in 64-slot chunks (``DecodeTuning(rchunk=64)``: three programs
    per (sequence, KV head)), random paged lengths, the step's token written by the kernel or not, merged in the split
    kernel or by the merge kernel: the reference's output and window."""
    lengths = [n * 32 for n in data.draw(st.lists(st.integers(0, 4), min_size=bsz, max_size=bsz))]
    res = data.draw(st.lists(st.integers(0, 150), min_size=bsz, max_size=bsz))
    res = [r if r or n else 1 for r, n in zip(res, lengths, strict=True)]  # every sequence has some token
    args = list(decode_case(bsz, 1, grp, 64, 64, 32, 4, 4, torch.float32, lengths, res, c=150))
    new, want_k, want_v = {}, args[9], args[10]
    if newkv:
        new = dict(new_k=torch.randn(bsz, 1, 64, device=DEV), new_v=torch.randn(bsz, 1, 64, device=DEV))
        want_k, want_v = window_with_token(args[9], args[10], args[11], new["new_k"], new["new_v"])
    ref = R.paged_decode_attention(*args[:9], want_k, want_v, *args[11:])
    rk, rv = args[9].clone(), args[10].clone()
    out = K.paged_decode_attention(*args[:9], rk, rv, *args[11:], tuning=KT.DecodeTuning(rchunk=64, fuse_merge=fuse),
                                   **new)
    assert torch.equal(rk, want_k) and torch.equal(rv, want_v)
    assert rel_err(out, ref, "decode window chunks hypothesis") < TOL[torch.float32]


# ----------------------------------------------------------------------------- prefix attention

@pytest.mark.parametrize("dtype,kb,vb", [(torch.float16, 4, 2), (torch.float32, 8, 4)])
def test_prefix_attention(dtype, kb, vb):
    bsz, hkv, grp, d, p, g, ql = 2, 2, 2, 64, 32, 32, 5
    args = decode_case(bsz, hkv, grp, d, p, g, kb, vb, dtype, [96, 0], [4, 9], c=16)
    q = torch.randn(bsz, hkv * grp, ql, d, device=DEV).to(dtype)
    new_k = torch.randn(bsz, hkv, ql, d, device=DEV).to(dtype)
    new_v = torch.randn(bsz, hkv, ql, d, device=DEV).to(dtype)
    mask = torch.tril(torch.ones(ql, ql, dtype=torch.bool, device=DEV))[None].repeat(bsz, 1, 1)
    mask[1, :, 0] = False  # left padding of the second sequence
    mask[1, 0, 0] = True
    pa = (q, *args[1:12], new_k, new_v, mask, kb, vb, g, args[15])
    ref = R.paged_prefix_attention(*pa)
    for sl in (None, 1):  # one slice of the whole batch, one sequence per slice
        out = K.paged_prefix_attention(*pa, batch_slice=sl)
        assert out.dtype == ref.dtype and out.shape == ref.shape
        assert torch.isfinite(out).all()
        err = rel_err(out, ref, f"prefix {dtype}")
        assert err < TOL[dtype]


@pytest.mark.parametrize("batch_slice", [-1, 0, 1.5])
def test_prefix_batch_slice_is_checked(batch_slice):
    """batch_slice: None or an int >= 1. Before, -1 returned the uninitialized output (no slice ran), 0 and 1.5 failed
    in range() with its own message."""
    args = decode_case(2, 1, 2, 64, 64, 32, 4, 4, torch.float16, [96, 0], [3, 5])
    q = torch.randn(2, 2, 3, 64, device=DEV).to(torch.float16)
    new = torch.randn(2, 1, 3, 64, device=DEV).to(torch.float16)
    mask = torch.ones(2, 3, 3, dtype=torch.bool, device=DEV)
    with pytest.raises(ValueError, match="batch_slice must be None \\(by memory\\) or an int >= 1"):
        K.paged_prefix_attention(q, *args[1:12], new, new, mask, *args[12:], batch_slice=batch_slice)


def test_window_slots_past_res_lengths_never_reach_the_output():
    """The window's slots at and past res_lengths hold no token: an engine's ``torch.empty`` window may hold anything
    there, NaN included. Decode and prefix attention, kernels and reference, give what they give over a zeroed
    window (before: NaN from the reference, decode and prefix, and from the prefix kernel: a zero weight times NaN)."""
    bsz, hkv, grp, d, p, g, ql, dt = 2, 1, 2, 64, 64, 32, 3, torch.float16
    args = list(decode_case(bsz, hkv, grp, d, p, g, 4, 4, dt, [64, 32], [3, 0], c=8))
    res_k, res_v, rl = args[9], args[10], args[11]
    for b, r in enumerate(rl.tolist()):
        res_k[b, :, r:] = 0
        res_v[b, :, r:] = 0
    poisoned = [x.clone() for x in (res_k, res_v)]
    for b, r in enumerate(rl.tolist()):
        for x in poisoned:
            x[b, :, r:] = float("nan")
    q = torch.randn(bsz, hkv * grp, ql, d, device=DEV).to(dt)
    new = torch.randn(bsz, hkv, ql, d, device=DEV).to(dt)
    mask = torch.tril(torch.ones(ql, ql, dtype=torch.bool, device=DEV))[None].repeat(bsz, 1, 1)
    for impl in (K, R):
        want = impl.paged_decode_attention(*args)
        got = impl.paged_decode_attention(*args[:9], *poisoned, *args[11:])
        assert torch.equal(got, want), f"decode {impl.__name__}"
        pa = [q, *args[1:9]], [rl, new, new, mask, 4, 4, g, 0.125]
        want = impl.paged_prefix_attention(*pa[0], res_k, res_v, *pa[1])
        got = impl.paged_prefix_attention(*pa[0], *poisoned, *pa[1])
        assert torch.equal(got, want), f"prefix {impl.__name__}"


def test_prefix_query_with_nothing_to_attend_to_gives_zeros():
    """A chunk query that sees nothing (its own and every new token masked, no stored token in its sliding window, or
    none stored): zeros, as the reference (before, the kernels' path gave the value of its buffer's first key)."""
    bsz, hkv, grp, d, p, g, ql, dt = 2, 1, 2, 64, 64, 32, 3, torch.float16
    args = decode_case(bsz, hkv, grp, d, p, g, 4, 4, dt, [64, 32], [3, 1], c=4)
    q = torch.randn(bsz, hkv * grp, ql, d, device=DEV).to(dt)
    new = torch.randn(bsz, hkv, ql, d, device=DEV).to(dt)
    mask = torch.tril(torch.ones(ql, ql, dtype=torch.bool, device=DEV))[None].repeat(bsz, 1, 1)
    mask[0, 1] = False  # query 1 of sequence 0: padding
    none = torch.zeros(bsz, dtype=torch.int32, device=DEV)
    empty = torch.zeros(bsz, hkv, 0, d, device=DEV, dtype=dt)
    for hist, kw in ((list(args[1:12]), dict(sliding_window=1)), ([args[1], none, *args[3:9], empty, empty, none], {})):
        pa = (q, *hist, new, new, mask, 4, 4, g, 0.125)
        ref = R.paged_prefix_attention(*pa, **kw)
        out = K.paged_prefix_attention(*pa, **kw)
        assert not out[0, :, 1].any() and not ref[0, :, 1].any()
        assert rel_err(out, ref, "prefix nothing to attend to") < TOL[dt]


def test_zz_report_max_errors():
    print("max relative errors:", {k: f"{v:.2e}" for k, v in sorted(MAX_ERR.items())})


@pytest.mark.parametrize("kb,vb,g", [(4, 4, 32), (2, 2, 32), (8, 8, 32), (2, 4, 32), (4, 2, 64)])
def test_decode_half_precision_dot_path(kb, vb, g):
    """The GPU path's plumbing (folded scales packed in pairs, fp16 dot operands; on the GPU the pairs
    come from inline PTX, here from its plain-Triton emulation) on any device."""
    args = decode_case(2, 2, 4, 64, 128, g, kb, vb, torch.float16, [96, 192], [5, 17])
    run_decode(args, f"decode half-dot {kb}/{vb}", tuning=HALF)


@pytest.mark.parametrize("srcmin", [6, 4])
@pytest.mark.parametrize("kb,vb,g", [(4, 4, 32), (2, 2, 32), (4, 2, 64), (4, 4, 64)])
def test_decode_half_dot_codes_read_in_place(kb, vb, g, srcmin):
    """``DecodeTuning.srcmin``: codes read where they sit in the mantissa, zero points folded with that field's power
    of two (unpack.field); 4-bit keys in groups of 64 (ODD pairs) fold their two pairs with different powers."""
    args = decode_case(2, 2, 4, 64, 128, g, kb, vb, torch.float16, [96, 192], [5, 17])
    run_decode(args, f"decode half-dot srcmin{srcmin} {kb}/{vb}", tuning=KT.DecodeTuning(srcmin=srcmin, dot="half"))


def test_decode_rejects_an_unknown_srcmin():
    args = decode_case(1, 2, 4, 64, 128, 32, 4, 4, torch.float16, [96], [5])
    with pytest.raises(ValueError, match="srcmin must be one of"):
        run_decode(args, "srcmin 5", tuning=KT.DecodeTuning(srcmin=5, dot="half"))


def test_decode_value_hint_setting():
    """``DecodeTuning.vhint``: None, the policy (on with 64-token steps at head_dim >= 128, and at head_dim 64 for 2/4
    bits), True, False give the reference's output (the hint only declares an alignment; its effect on the copies is
    checked in test_sass.py); other values are refused."""

    auto = {(d, step, kb, vb): KP._vhint(d, step, kb, vb)["VHINT"] for d in (64, 128, 256) for step in (32, 64)
            for kb in (2, 4, 8) for vb in (2, 4, 8)}
    assert auto == {(d, step, kb, vb): int(step == 64 and (d >= 128 or max(kb, vb) <= 4)) for d, step, kb, vb in auto}
    assert auto[128, 64, 2, 2] == auto[64, 64, 4, 4] == auto[64, 64, 2, 2] == auto[64, 64, 4, 2] == 1
    assert auto[64, 64, 8, 4] == auto[64, 64, 4, 8] == auto[128, 32, 4, 4] == auto[64, 32, 2, 2] == 0
    args = decode_case(2, 2, 2, 128, 64, 32, 4, 4, torch.float16, [96, 150], [5, 33])
    assert auto == {k: KP._vhint(*k, KT.DecodeTuning(vhint=None))["VHINT"] for k in auto}  # the default: the policy
    for v in (True, False):
        t = KT.DecodeTuning(vhint=v, dot="half")
        assert KP._vhint(64, 32, 2, 2, t) == {"VHINT": int(v)}
        run_decode(args, f"decode vhint {v}", tuning=t)
    with pytest.raises(ValueError, match="DecodeTuning.vhint must be None"):
        run_decode(args, "vhint yes", tuning=KT.DecodeTuning(vhint="yes", dot="half"))


@triton.jit
def _key_words_probe(s_ptr, z_ptr, out_ptr, s_row, GPS: tl.constexpr, D: tl.constexpr, NK: tl.constexpr):
    """Stores the plane tiles of KS._key_words4 (NK 4) or KS._key_words2 (NK 2) one after another: out [2 NK, GPS,
    D/(2 NK)], (s, z) of plane 0, then plane 1, ..."""
    g = tl.arange(0, GPS)
    srow = (s_ptr + g * s_row).to(tl.pointer_type(tl.float16), bitcast=True)
    zrow = (z_ptr + g * s_row).to(tl.pointer_type(tl.float16), bitcast=True)
    o = out_ptr + g[:, None] * (D // (2 * NK)) + tl.arange(0, D // (2 * NK))[None, :]
    n: tl.constexpr = GPS * (D // (2 * NK))
    if NK == 4:
        s0, z0, s1, z1, s2, z2, s3, z3 = KS._key_words4(srow, zrow, D)
        tl.store(o + 4 * n, s2)
        tl.store(o + 5 * n, z2)
        tl.store(o + 6 * n, s3)
        tl.store(o + 7 * n, z3)
    else:
        s0, z0, s1, z1 = KS._key_words2(srow, zrow, D)
    tl.store(o, s0)
    tl.store(o + n, z0)
    tl.store(o + 2 * n, s1)
    tl.store(o + 3 * n, z1)


@pytest.mark.parametrize("nk", [4, 2], ids=["2bit", "4bit"])
def test_key_words_split_every_planes_words(nk):
    """_key_words4 / _key_words2 (KSZ, 2-/4-bit keys): one [2, GPS, D/2] load of the step's key scale
    and zero words, split in registers into plane k = words k D/(2 NK) .. (k+1) D/(2 NK) of each group row; checked
    here against torch slicing on random words (the decode kernel takes this path only with the GPU's inline-PTX
    unpack, which the interpreter cannot run)."""
    for gps, d in ((1, 64), (2, 64), (2, 128), (4, 256)):
        row = d // 2 + 3  # rows of the pools are further apart than a row's words (as the page pools' groups are)
        s = torch.randint(-2**31, 2**31 - 1, (gps, row), dtype=torch.int32)
        z = torch.randint(-2**31, 2**31 - 1, (gps, row), dtype=torch.int32)
        w = d // (2 * nk)
        out = torch.full((2 * nk, gps, w), -7, dtype=torch.int32)  # poisoned
        _key_words_probe[(1,)](s, z, out, row, GPS=gps, D=d, NK=nk)
        want = torch.stack([t[:, k * w:(k + 1) * w] for k in range(nk) for t in (s, z)])
        assert torch.equal(out, want), (gps, d)


def test_decode_key_scale_words_setting(monkeypatch):
    """``DecodeTuning.ksz``: None (the default, the policy) asks for the one-load key scales with 2- and 4-bit keys at
    head_dim 64, and at 128 for fp16, and for bf16 under Triton 3.6 (timed faster there; neutral under 3.9, where a
    bf16 build spills with it; 256 unmeasured), True always, False never; others refused. The decode op's output is
    the reference's either way: under KIVI_TEST_GPU=1 through the inline-PTX build (False takes the per-plane loads,
    the default the one-load path); under the interpreter (no PTX) the setting changes nothing, and test_sass.py
    checks the GPU build's SASS instead."""
    t36 = int(triton.__version__.startswith("3.6"))  # bf16 at head_dim 128: on under 3.6 only (timed faster there)
    assert KP._ksz(64, 2) == KP._ksz(128, 4) == KP._ksz(64, 4, True) == {"KSZ": 1}
    assert KP._ksz(128, 2, True) == KP._ksz(128, 4, True) == {"KSZ": t36}
    assert KP._ksz(256, 4, True) == KP._ksz(256, 2) == KP._ksz(64, 8) == KP._ksz(128, 8, True) == {"KSZ": 0}
    for dt, d, want in ((torch.float16, 128, 1), (torch.bfloat16, 128, t36), (torch.bfloat16, 64, 1)):
        q, bt, _, kc, ks, _, vc, vs, vz, rk, rv, *_ = decode_case(1, 1, 1, d, 64, 32, 2, 2, dt, [70], [7])
        plan = KP._DecodePlan(q, bt, kc, ks, vc, vs, vz, rk, rv, 2, 2, 32, None, tuning=HALF)  # the launch's meta
        assert plan.meta["KSZ"] == want, (dt, d, plan.meta["KSZ"])
    monkeypatch.setattr(KP, "_TRITON_36", not t36)  # the other Triton's rule
    assert KP._ksz(128, 2, True) == {"KSZ": 1 - t36} and KP._ksz(128, 2) == {"KSZ": 1}
    args = decode_case(2, 2, 2, 64, 64, 32, 2, 2, torch.float16, [96, 150], [5, 33])
    run_decode(args, "decode ksz default", tuning=HALF)
    on, off = KT.DecodeTuning(ksz=True), KT.DecodeTuning(ksz=False)
    assert KP._ksz(128, 2, True, on) == {"KSZ": 1} and KP._ksz(64, 8, t=on) == {"KSZ": 0}
    assert KP._ksz(64, 2, t=off) == KP._ksz(128, 4, t=off) == {"KSZ": 0}
    run_decode(args, "decode ksz 0", tuning=KT.DecodeTuning(ksz=False, dot="half"))
    with pytest.raises(ValueError, match="DecodeTuning.ksz must be None"):
        run_decode(args, "ksz yes", tuning=KT.DecodeTuning(ksz="yes", dot="half"))


@pytest.mark.parametrize("splits", [3, 6])
def test_decode_half_dot_splits_past_the_end(splits):
    """64-token steps (unmasked loop + partial-step loop) with splits that start past a sequence's end."""
    args = decode_case(2, 2, 4, 64, 128, 32, 4, 4, torch.float16, [96, 200], [5, 0])
    run_decode(args, f"decode half-dot splits{splits}", num_splits=splits, tuning=HALF)


def test_decode_plans_are_reused_per_shape_and_setting(monkeypatch):
    """paged_decode_attention plans once per shapes/strides/dtypes/settings key (kernels.decode._PLANS): calls
    with other data reuse the plan and match the reference; another block-table width, dtype or environment
    setting makes a new plan. On a GPU the first call of a kernel configuration is not kept (it is planned again
    once the compiled kernel's residency is known, ``_RESIDENT``), so every new setting is called twice here: the
    count then does not depend on which tests ran before in the process. An equal tuning object is the same
    setting."""

    KD._PLANS.clear()
    monkeypatch.setattr(KP, "_RESIDENT", {})

    def run(width, dtype, seed, **kw):
        torch.manual_seed(seed)
        args = decode_case(2, 2, 2, 64, 64, 32, 4, 4, dtype, [96, 160], [3, 17], c=32, width=width)
        run_decode(args, f"decode plan {dtype}", **kw)

    run(4, torch.float32, 0)
    run(4, torch.float32, 1)
    assert len(KD._PLANS) == 1
    run(5, torch.float32, 2)
    assert len(KD._PLANS) == 2  # the residency of this configuration is known by now: kept at once
    run(4, torch.float16, 3)
    run(4, torch.float16, 4)
    assert len(KD._PLANS) == 3
    run(4, torch.float16, 5)
    assert len(KD._PLANS) == 3
    run(4, torch.float32, 6, tuning=KT.DecodeTuning(split_min=128))
    run(4, torch.float32, 7, tuning=KT.DecodeTuning(split_min=128))
    assert len(KD._PLANS) == 4
    run(4, torch.float32, 8, tuning=KT.DecodeTuning())  # the default's settings: the first plan
    assert len(KD._PLANS) == 4


# ----------------------------------------------------------------------------- decode writes the step's token

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("grp,four_d", [(4, False), (1, True)])
def test_decode_writes_the_new_token_into_the_window_then_attends(dtype, grp, four_d):
    """new_k/new_v: the op stores the step's token at res_lengths - 1 (lengths already count it; a sequence with an
    empty window is left alone) and attends to it: the same output and window as writing it first, kernel and
    reference alike; the token never reaches other slots."""
    bsz, hkv, d, p, g = 3, 2, 64, 64, 32
    args = list(decode_case(bsz, hkv, grp, d, p, g, 4, 4, dtype, [70, 130, 32], [5, 0, 37], c=48))
    q, res_k, res_v, rl = args[0], args[9], args[10], args[11]
    new_k = torch.randn(bsz, hkv, d, device=DEV).to(dtype)
    new_v = torch.randn(bsz, hkv, d, device=DEV).to(dtype)
    want_k, want_v = window_with_token(res_k, res_v, rl, new_k, new_v)
    ref = R.paged_decode_attention(*args[:9], want_k, want_v, *args[11:])
    nk, nv = (new_k[:, :, None], new_v[:, :, None]) if four_d else (new_k, new_v)
    for impl in (K, R):
        rk, rv = res_k.clone(), res_v.clone()
        out = impl.paged_decode_attention(*args[:9], rk, rv, *args[11:], new_k=nk, new_v=nv)
        assert torch.equal(rk, want_k) and torch.equal(rv, want_v), impl.__name__
        err = rel_err(out, ref, f"decode new_k {impl.__name__} {dtype}")
        assert err < TOL[dtype], err
    with pytest.raises(ValueError, match="new_k/new_v must be"):
        K.paged_decode_attention(*args[:9], res_k, res_v, *args[11:], new_k=new_k[:, :1], new_v=new_v[:, :1])
    with pytest.raises(ValueError, match="together"):
        K.paged_decode_attention(*args[:9], res_k, res_v, *args[11:], new_k=new_k)
    assert q.shape == (bsz, hkv * grp, d)


@pytest.mark.parametrize("newkv,fuse", [(False, False), (True, True), (True, False)])
def test_window_read_in_chunks_by_several_programs(newkv, fuse):
    """``DecodeTuning(rchunk=64)``: a 150-slot window read by three programs (windows empty, inside one chunk, at and
    past the chunks' edges, full); with the step's token written by the chunk that holds its slot, merged by the merge
    kernel or in the split kernel: the reference's output and window; the plan has NS + 3 programs per pair."""

    t = KT.DecodeTuning(rchunk=64, fuse_merge=fuse)
    bsz, hkv, grp, d, p, g = 6, 1, 2, 64, 64, 32
    rls = [0, 5, 64, 65, 129, 150]
    args = list(decode_case(bsz, hkv, grp, d, p, g, 4, 4, torch.float32, [64, 0, 96, 32, 160, 64], rls, c=150))
    res_k, res_v = args[9], args[10]
    new = {}
    want_k, want_v = res_k, res_v
    if newkv:
        new = dict(new_k=torch.randn(bsz, hkv, d, device=DEV), new_v=torch.randn(bsz, hkv, d, device=DEV))
        want_k, want_v = window_with_token(res_k, res_v, args[11], new["new_k"], new["new_v"])
    ref = R.paged_decode_attention(*args[:9], want_k, want_v, *args[11:])
    for _ in range(2):  # on a GPU the plan is kept from the second call (once the kernel's residency is known)
        rk, rv = res_k.clone(), res_v.clone()
        out = K.paged_decode_attention(*args[:9], rk, rv, *args[11:], tuning=t, **new)
        assert torch.equal(rk, want_k) and torch.equal(rv, want_v)
        err = rel_err(out, ref, f"decode window chunks newkv={newkv} fuse={fuse}")
        assert err < TOL[torch.float32], err
    plans = [pl for pl in KD._PLANS.values() if pl.rows == bsz * hkv * grp and pl.grid[0] == bsz * hkv]
    assert plans and all(pl.nsp1 == pl.ints[1] + 3 and pl.ints[2] == 64 for pl in plans)
    assert KP.window_chunk(bsz * hkv, 150, 32, torch.device("cpu"), t) == 64  # the setting, rounded to whole steps
    assert KP.window_chunk(8, 164, 32, torch.device("cpu")) >= 164  # one program for the window: the CPU default


@pytest.mark.parametrize("bsz,hkv,width,chunked,ns", [(1, 8, 16, True, 4), (8, 8, 16, True, 4), (1, 8, 512, True, 128),
                                                      (8, 8, 512, False, 32), (1, 8, 2048, False, 131)])
def test_window_chunks_only_where_they_change_no_paged_split(monkeypatch, bsz, hkv, width, chunked, ns):
    """The plan's choice on an H200-sized device (132 SMs x 8 programs, the split rule with the GPU's numbers; the
    window in 64-slot chunks as on a GPU at <= 64 pairs): 3 chunks of a 160-slot window where the rule gives the
    paged splits the same count as with one window program (1k at batch 1 and 8: 4 splits; batch 1 at 32k: 128,
    bounded by length), one window program where the chunks would change them (8 x 8 KV heads x 32k: 3 waves of 46
    splits instead of 2 of 32, measured 5.6% slower; 1 x 8 x 128k: 129 instead of 131). The plan alone."""

    monkeypatch.setattr(KP, "window_chunk", lambda pairs, cap, blk, dev, t=None: 64)
    monkeypatch.setattr(KP, "_pick_splits",
                        lambda b, h, w, dev, res, chunks=1, t=None: KP.split_count(b, h, w, 132, 8, chunks, t))
    q, bt, _, kc, ks, _, vc, vs, vz, rk, rv, *_ = decode_case(bsz, hkv, 1, 64, 64, 32, 4, 4, torch.float32,
                                                               [70] * bsz, [7] * bsz, c=160, width=width)
    plan = KP._DecodePlan(q, bt, kc, ks, vc, vs, vz, rk, rv, 4, 4, 32, None)
    assert plan.ints[1] == ns
    if chunked:
        assert plan.ints[2] == 64 and plan.nsp1 == ns + 3
    else:
        assert plan.ints[2] >= 160 and plan.nsp1 == ns + 1
    plan = KP._DecodePlan(q, bt, kc, ks, vc, vs, vz, rk, rv, 4, 4, 32, None,
                         tuning=KT.DecodeTuning(rchunk=64))  # the setting: chunks whatever the rule says
    assert plan.ints[2] == 64 and plan.nsp1 == plan.ints[1] + 3


@pytest.mark.parametrize("grp,splits", [(1, 1), (3, 4), (8, 15), (4, 20)])
def test_split_kernel_merges_its_own_partials(monkeypatch, grp, splits):
    """The split kernel merging (here ``fuse_merge=True``; by default at small batches): the last program of
    each (sequence, KV head) merges the NS + 1 partials (up to ``DecodeTuning.merge_max``, MERGE_MAX, of them,
    unrolled up to 16 and in a loop beyond, as at 21 here; and while GP x BM <= 1024; else the merge kernel as
    before: test_in_kernel_merge_plan_limits); outputs
    match the two-kernel path and the reference, the merge kernel is not launched, and the arrival counts are left
    at zero for the next call."""

    # one window program on every device (NS + 1 partials); the merge kernel, then the split kernel's merge
    unfused, fused_t = KT.DecodeTuning(rchunk=4096, fuse_merge=False), KT.DecodeTuning(rchunk=4096, fuse_merge=True)
    args = decode_case(3, 2, grp, 64, 64, 32, 4, 4, torch.float32, [300, 0, 64], [7, 0, 130], c=160)
    two = K.paged_decode_attention(*args, num_splits=splits, tuning=unfused)
    launched = []
    real = KD._REDUCE
    monkeypatch.setattr(KD, "_REDUCE", lambda *a: launched.append(1) or real(*a))
    for _ in range(2):  # the second call reuses the plan and its counts
        out = torch.full_like(args[0], float("nan"))
        K.paged_decode_attention(*args, num_splits=splits, out=out, tuning=fused_t)
        assert torch.isfinite(out).all()
        assert rel_err(out, two, f"fused merge g{grp} s{splits}") < 1e-5
        assert rel_err(out, R.paged_decode_attention(*args), f"fused merge ref g{grp} s{splits}") < TOL[torch.float32]
    bm = 1 << (splits).bit_length()  # next power of two of splits + 1
    fused = splits + 1 <= KP.MERGE_MAX and (1 << (grp - 1).bit_length()) * bm <= 1024
    assert len(launched) == (0 if fused else 2)
    plans = [p for p in KD._PLANS.values()
             if p.merge_meta is not None and p.pairs == 6 and p.nsp1 == splits + 1 and p.meta["GROUP"] == grp]
    assert bool(plans) == fused
    for p in plans:
        for cnt in p.counters.values():
            assert not cnt.any()


def test_compiled_mode_op_never_merges_in_the_kernel(monkeypatch):
    """The custom op of the compiled mode (``StaticQuantizedPagedCache``) passes ``merge=False``: where the default
    would merge in the split kernel (a small batch), it launches the merge kernel instead and allocates no arrival
    counts. A count tensor allocated by a first call and kept by the plan made generate fail on the GPU: inductor's
    CUDA graphs run their warm-up in the graphs' own memory pool, and recording refused the pool tensor kept alive
    ("tensor(s) in the cudagraph pool not tracked as outputs"). Same output as the reference and as the
    op with the in-kernel merge."""
    from kivi_cache import ops, static  # noqa: F401  (static registers torch.ops.kivi_cache.*)

    args = decode_case(2, 2, 4, 64, 64, 32, 4, 4, torch.float32, [150, 64], [7, 33], c=48)
    patch_default_decode_tuning(monkeypatch, fuse_merge=None)  # the policy: merge in the kernel at small batches
    launched = []
    real = KD._REDUCE
    monkeypatch.setattr(KD, "_REDUCE", lambda *a: launched.append(1) or real(*a))
    monkeypatch.setattr(ops, "_backend", "triton")
    KD._PLANS.clear()
    out = torch.ops.kivi_cache.paged_decode_attention(*args)
    assert launched == [1]
    plans = list(KD._PLANS.values())
    assert plans and all(p.merge_meta is not None for p in plans)  # the default would merge here...
    assert all(not p.counters for p in plans)  # ...but no counts were allocated
    assert rel_err(out, R.paged_decode_attention(*args), "compiled-mode op") < TOL[torch.float32]
    fused = K.paged_decode_attention(*args)  # the plain op does merge in the kernel (no second launch)
    assert launched == [1] and any(p.counters for p in KD._PLANS.values())
    assert rel_err(out, fused, "compiled-mode op vs in-kernel merge") < 1e-5


@pytest.mark.parametrize("grp,splits,merge_max,fused", [(4, 15, 16, True), (4, 16, 16, False), (4, 16, None, True),
                                                         (4, 130, 256, True), (8, 130, 256, False),
                                                         (4, 130, 100, False), (2, 300, 512, True)])
def test_in_kernel_merge_plan_limits(grp, splits, merge_max, fused):
    """Where the split kernel merges (the plan alone, no launch): at most ``DecodeTuning.merge_max`` partials
    (default MERGE_MAX = 256) and GP x BM <= 1024 (the merging program's partial maxima and sums in registers)."""

    # one window program on every device (NS + 1 partials)
    t = KT.DecodeTuning(fuse_merge=True, rchunk=4096, **({} if merge_max is None else {"merge_max": merge_max}))
    q, bt, _, kc, ks, _, vc, vs, vz, rk, rv, *_ = decode_case(1, 2, grp, 64, 64, 32, 4, 4, torch.float32, [300],
                                                               [7], c=160)
    plan = KP._DecodePlan(q, bt, kc, ks, vc, vs, vz, rk, rv, 4, 4, 32, splits, tuning=t)
    assert plan.nsp1 == splits + 1 and (plan.merge_meta is not None) == fused
    if fused:
        assert plan.merge_meta["BM"] >= splits + 1 and plan.merge_meta["MERGE"] == 1


# ----------------------------------------------------------------------------- sliding-window attention

def brute_window_attention(args, sliding_window, q=None, new_k=None, new_v=None, new_mask=None, sink_logits=None):
    """An independent oracle for the ``sliding_window`` argument: each sequence's stored tokens dequantized and laid
    out in order (pages, then the window), the queries after them; each query attends to the keys at most
    ``sliding_window - 1`` positions before it (fp64 softmax; None: all). ``sink_logits`` ``[Hq]``: one more logit
    per query head in the softmax, whose weight multiplies no value (GPT-OSS's eager attention)."""
    q = args[0] if q is None else q
    bt, lengths, pool, res_k, res_v, rl, kb, vb, g, scale = args[1], args[2], args[3:9], *args[9:16]
    hk, hv = R.dequantize_pages(bt, lengths, *pool, kb, vb, g)
    decode = q.dim() == 3
    qq = q[:, :, None] if decode else q
    bsz, hq, ql, d = qq.shape
    grp = hq // res_k.shape[1]
    out = torch.zeros(bsz, hq, ql, d, dtype=torch.float64, device=q.device)
    for b in range(bsz):
        n, r = int(lengths[b]), int(rl[b])
        k = torch.cat([hk[b, :, :n].double(), res_k[b, :, :r].double()], 1)
        v = torch.cat([hv[b, :, :n].double(), res_v[b, :, :r].double()], 1)
        stored = n + r
        for i in range(ql):
            qi = stored - 1 if decode else stored + i  # the query's own index (decode: the newest stored token)
            lo = 0 if sliding_window is None else max(0, qi - sliding_window + 1)
            kk, vv = k[:, lo:], v[:, lo:]
            if not decode:
                keep = new_mask[b, i]
                kk = torch.cat([kk, new_k[b][:, keep].double()], 1)
                vv = torch.cat([vv, new_v[b][:, keep].double()], 1)
            kk = kk.repeat_interleave(grp, 0)
            vv = vv.repeat_interleave(grp, 0)
            logits = (qq[b, :, i:i + 1].double() @ kk.transpose(-1, -2)) * scale  # [Hq, 1, keys]
            if sink_logits is not None:
                logits = torch.cat([logits, sink_logits.double()[:, None, None]], -1)
            p = torch.softmax(logits, -1)
            if sink_logits is not None:
                p = p[..., :-1]
            out[b, :, i] = (p @ vv)[:, 0]
    return out[:, :, 0] if decode else out


SLIDING_CASES = {  # lengths (multiples of 32), window lengths, window sizes: past every page, inside one, at edges
    "in_window_only": ([96, 160], [17, 5], [1, 5, 17]),
    "page_edges": ([192, 128], [0, 31], [32, 64, 65, 96, 127, 159]),
    "mid_group": ([224, 64], [9, 40], [3, 41, 50, 100, 200]),
    "longer_than_all": ([96, 0], [4, 9], [101, 400]),
}


@pytest.mark.parametrize("case", sorted(SLIDING_CASES))
def test_decode_sliding_window_matches_brute_force(case):
    """The reference's and the kernel's ``sliding_window`` against an independent per-sequence oracle, over windows
    inside the residual window, at page and group edges, mid-group and longer than the sequence; pages wholly before
    the window are poisoned (NaN scales) for the kernel, which must not read them."""
    lengths, res, windows = SLIDING_CASES[case]
    args = decode_case(2, 2, 2, 64, 64, 32, 4, 4, torch.float32, lengths, res, c=48)
    for w in windows:
        want = brute_window_attention(args, w)
        ref = R.paged_decode_attention(*args, sliding_window=w)
        assert rel_err(ref, want, f"sliding reference {case}") < 1e-5, w
        poisoned = list(args)
        kc, ks, kz, vc, vs, vz = (t.clone() for t in args[3:9])
        for b, (n, r) in enumerate(zip(lengths, res, strict=True)):
            first_page = max(0, n + r - w) // 64  # the first page holding a visible token
            for col in range(min(first_page, -(-n // 64))):
                page = int(args[1][b, col])
                ks[page] = float("nan")
                vs[page] = float("nan")
        poisoned[3:9] = kc, ks, kz, vc, vs, vz
        for splits in (None, 3):
            out = torch.full_like(args[0], float("nan"))
            K.paged_decode_attention(*poisoned, out=out, sliding_window=w, num_splits=splits)
            assert torch.isfinite(out).all(), (case, w, splits)
            assert rel_err(out, want, f"sliding decode {case}") < TOL[torch.float32], (w, splits)


@pytest.mark.parametrize("newkv,fuse", [(True, True), (False, False)])
def test_decode_sliding_window_chunked_window_and_new_token(newkv, fuse):
    """The sliding window across a residual window read in 64-slot chunks (some chunks wholly hidden), with the
    step's token written by the kernel, merged in the split kernel or by the merge kernel; fp16."""
    t = KT.DecodeTuning(rchunk=64, fuse_merge=fuse)
    bsz, d = 4, 64
    args = list(decode_case(bsz, 1, 4, d, 64, 32, 2, 4, torch.float16, [64, 0, 96, 160], [150, 130, 70, 1], c=150))
    new = {}
    if newkv:
        new = dict(new_k=torch.randn(bsz, 1, d, device=DEV).half(), new_v=torch.randn(bsz, 1, d, device=DEV).half())
    for w in (10, 66, 140, 230):
        rk, rv = args[9].clone(), args[10].clone()
        out = K.paged_decode_attention(*args[:9], rk, rv, *args[11:], sliding_window=w, tuning=t, **new)
        if newkv:
            want_k, want_v = window_with_token(args[9], args[10], args[11], new["new_k"], new["new_v"])
            assert torch.equal(rk, want_k) and torch.equal(rv, want_v)
        want = brute_window_attention([*args[:9], rk, rv, *args[11:]], w)
        assert rel_err(out, want, "sliding decode chunked") < TOL[torch.float16], w


@settings(max_examples=6, deadline=None)
@given(bsz=st.integers(1, 3), grp=st.sampled_from([1, 2, 4]), bits=st.sampled_from(BITS), data=st.data())
def test_decode_sliding_window_hypothesis(bsz, grp, bits, data):
    lengths = [32 * n for n in data.draw(st.lists(st.integers(0, 6), min_size=bsz, max_size=bsz))]
    res = [r if r or n else 1 for r, n in zip(
        data.draw(st.lists(st.integers(0, 40), min_size=bsz, max_size=bsz)), lengths, strict=True)]
    w = data.draw(st.integers(1, 260))
    args = decode_case(bsz, 2, grp, 64, 64, 32, bits[0], bits[1], torch.float32, lengths, res, c=40)
    want = brute_window_attention(args, w)
    out = K.paged_decode_attention(*args, sliding_window=w, num_splits=data.draw(st.sampled_from([None, 2, 5])))
    assert rel_err(out, want, "sliding decode hypothesis") < TOL[torch.float32], (lengths, res, w)


def test_prefix_attention_sliding_window():
    """Several queries over a quantized past with a sliding window: each query's window starts at its own position
    (the history's part here; the mask gives the new tokens'): kernel path and reference against the oracle."""
    bsz, hkv, grp, d, ql = 2, 2, 2, 64, 6
    args = decode_case(bsz, hkv, grp, d, 64, 32, 4, 4, torch.float32, [192, 64], [7, 30], c=32)
    q = torch.randn(bsz, hkv * grp, ql, d, device=DEV)
    new_k = torch.randn(bsz, hkv, ql, d, device=DEV)
    new_v = torch.randn(bsz, hkv, ql, d, device=DEV)
    for w in (4, 40, 100, 500):
        causal = torch.tril(torch.ones(ql, ql, dtype=torch.bool, device=DEV))
        mask = (causal & ~torch.tril(torch.ones(ql, ql, dtype=torch.bool, device=DEV), -w))[None].repeat(bsz, 1, 1)
        pa = (q, *args[1:12], new_k, new_v, mask, 4, 4, 32, args[15])
        want = brute_window_attention(args, w, q=q, new_k=new_k, new_v=new_v, new_mask=mask)
        ref = R.paged_prefix_attention(*pa, sliding_window=w)
        out = K.paged_prefix_attention(*pa, sliding_window=w)
        assert rel_err(ref, want, "sliding prefix reference") < 1e-5, w
        assert rel_err(out, want, "sliding prefix") < TOL[torch.float32], w


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "16"])
def test_sliding_window_argument_is_checked(bad):
    args = decode_case(1, 1, 1, 64, 64, 32, 4, 4, torch.float32, [64], [3])
    for fn in (K.paged_decode_attention, R.paged_decode_attention):
        with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
            fn(*args, sliding_window=bad)


# ----------------------------------------------------------------------------- learned attention sinks (GPT-OSS)

def sink_values(hq, kind):
    """Sink logits ``[hq]`` of several regimes: of the scores' order, far above them (the sink takes nearly all the
    weight: outputs near 0), far below (no effect), mixed."""
    gen = {"normal": lambda: torch.randn(hq) * 2, "high": lambda: torch.full((hq,), 40.0),
           "low": lambda: torch.full((hq,), -60.0),
           "mixed": lambda: torch.tensor([(-1) ** i * 3.0 * i for i in range(hq)])}
    return gen[kind]().to(DEV)


@pytest.mark.parametrize("kind", ["normal", "high", "low", "mixed"])
@pytest.mark.parametrize("fuse", [False, True])
def test_decode_sink_logits_match_brute_force(kind, fuse):
    """``sink_logits`` in the decode op (merged by the split kernel's last program or by the merge kernel) and the
    reference against the fp64 oracle, with and without a sliding window and forced splits, including a sequence
    with no pages; with the sinks ignored the outputs are far off (so the test can fail)."""
    t = KT.DecodeTuning(fuse_merge=fuse)
    args = decode_case(3, 2, 4, 64, 64, 32, 4, 2, torch.float32, [160, 0, 64], [9, 3, 33], c=40)
    sinks = sink_values(8, kind)
    for w in (None, 50):
        want = brute_window_attention(args, w, sink_logits=sinks)
        ref = R.paged_decode_attention(*args, sliding_window=w, sink_logits=sinks)
        assert rel_err(ref, want, "sink reference") < 1e-5, w
        for splits in (None, 3):
            out = torch.full_like(args[0], float("nan"))
            K.paged_decode_attention(*args, out=out, sliding_window=w, num_splits=splits, sink_logits=sinks, tuning=t)
            assert torch.isfinite(out).all()
            assert rel_err(out, want, "sink decode") < TOL[torch.float32], (w, splits)
        if kind in ("normal", "mixed", "high"):
            plain = K.paged_decode_attention(*args, sliding_window=w, tuning=t)
            assert rel_err(plain, want, "sink ignored") > 0.05


def test_decode_sink_logits_half_precision_runner_and_new_token(monkeypatch):
    """fp16 queries with bf16 sink logits (the model's dtype) through ops.DecodeRunner, the step's token written by
    the kernel; the runner's plain and sink runs do not share a launch."""
    from kivi_cache import ops

    patch_default_decode_tuning(monkeypatch, fuse_merge=True)
    bsz, d = 2, 64
    args = list(decode_case(bsz, 2, 2, d, 64, 32, 4, 4, torch.float16, [128, 32], [5, 17], c=24))
    sinks = sink_values(4, "mixed").to(torch.bfloat16)
    q, bt, ql, pool, rk, rv, rl = args[0], args[1], args[2], args[3:9], args[9], args[10], args[11]
    new_k = torch.randn(bsz, 2, 1, d, device=DEV).half()
    new_v = torch.randn(bsz, 2, 1, d, device=DEV).half()
    run = ops.DecodeRunner(bt, ql, pool, res_k=rk, res_v=rv, key_bits=4, value_bits=4, group_size=32)
    for _ in range(2):
        out = run(q, rl, args[15], new_k, new_v, sink_logits=sinks)
        want_k, want_v = window_with_token(args[9], args[10], rl, new_k[:, :, 0], new_v[:, :, 0])
        want = brute_window_attention([*args[:9], want_k, want_v, *args[11:]], None, sink_logits=sinks.float())
        assert rel_err(out, want, "sink runner fp16") < TOL[torch.float16]
        plain = run(q, rl, args[15], new_k, new_v)
        assert rel_err(plain, want, "sink runner ignored") > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefix_attention_sink_logits(dtype):
    """Several queries over a quantized past with learned sinks (the kernels' path puts the sink on extra channels
    of one more key; the reference adds a softmax column) against the oracle, with a sliding window and a padded
    query that sees nothing but the sink (output zero, not NaN)."""
    bsz, hkv, grp, d, ql = 2, 2, 2, 64, 5
    args = decode_case(bsz, hkv, grp, d, 64, 32, 4, 4, dtype, [128, 0], [7, 0], c=32)  # sequence 1: nothing stored
    q = torch.randn(bsz, hkv * grp, ql, d, device=DEV).to(dtype)
    new_k = torch.randn(bsz, hkv, ql, d, device=DEV).to(dtype)
    new_v = torch.randn(bsz, hkv, ql, d, device=DEV).to(dtype)
    sinks = sink_values(hkv * grp, "mixed") + 0.37  # not a multiple of a power of two: the split halves matter
    causal = torch.tril(torch.ones(ql, ql, dtype=torch.bool, device=DEV))[None].repeat(bsz, 1, 1)
    for w in (None, 30):
        pa = (q, *args[1:12], new_k, new_v, causal, 4, 4, 32, args[15])
        want = brute_window_attention(args, w, q=q, new_k=new_k, new_v=new_v, new_mask=causal, sink_logits=sinks)
        ref = R.paged_prefix_attention(*pa, sliding_window=w, sink_logits=sinks)
        out = K.paged_prefix_attention(*pa, sliding_window=w, sink_logits=sinks)
        assert rel_err(ref, want, "sink prefix reference") < (1e-5 if dtype == torch.float32 else 1e-2), w
        assert rel_err(out, want, "sink prefix") < TOL[dtype], w
        assert rel_err(K.paged_prefix_attention(*pa, sliding_window=w), want, "sink prefix ignored") > 0.05
    lonely = causal.clone()
    lonely[1, 0] = False  # query 0 of sequence 1 (no stored tokens) sees nothing: only the sink
    pa = (q, *args[1:12], new_k, new_v, lonely, 4, 4, 32, args[15])
    for fn in (R.paged_prefix_attention, K.paged_prefix_attention):
        out = fn(*pa, sink_logits=sinks)
        assert torch.isfinite(out).all() and out[1, :, 0].abs().max() == 0


@pytest.mark.parametrize("bad", ["shape", "dtype", "list"])
def test_sink_logits_argument_is_checked(bad):
    args = decode_case(1, 1, 2, 64, 64, 32, 4, 4, torch.float32, [64], [3])
    sinks = {"shape": torch.zeros(3, device=DEV), "dtype": torch.zeros(2, dtype=torch.int32, device=DEV),
             "list": [0.0, 1.0]}[bad]
    for fn in (K.paged_decode_attention, R.paged_decode_attention):
        with pytest.raises(ValueError, match="sink_logits"):
            fn(*args, sink_logits=sinks)


# ----------------------------------------------------------------------------- launch options

class _LaunchSpy:
    """A kernel whose launches record their ``enable_fp_fusion`` option, then run the real kernel."""

    def __init__(self, fn, seen: list, name: str):
        self.fn, self.seen, self.name = fn, seen, name

    @property
    def params(self):
        return self.fn.params

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def call(*args, **kwargs):
            self.seen.append((self.name, kwargs.get("enable_fp_fusion")))
            return launch(*args, **kwargs)

        return call


def test_every_kernel_states_fp_fusion(monkeypatch):
    """Each kernel is launched with ``enable_fp_fusion=True`` (kernels._util.FP_FUSION): the setting the kernels were
    tuned with, which Triton 3.9 warns about when left to its default and turns off by default from 3.10."""
    from kivi_cache.kernels import dequant as Dq
    from kivi_cache.kernels import quantize as Q

    seen: list = []
    for mod, name in ((KD, "_SPLIT"), (KD, "_REDUCE"), (Q, "_QUANT"), (Q, "_APPEND")):
        launcher = getattr(mod, name)
        monkeypatch.setattr(launcher, "fn", _LaunchSpy(launcher.fn, seen, name))
    monkeypatch.setattr(Dq, "_dequant_kernel", _LaunchSpy(Dq._dequant_kernel, seen, "_dequant_kernel"))
    test_quantize_and_write(4, 4, torch.float32)
    test_append_and_flush(4, 4, torch.float16, 40)
    test_dequantize_pages(4, 4)
    run_decode(decode_case(2, 2, 2, 64, 64, 32, 4, 4, torch.float16, [96, 160], [5, 17]), "fp fusion", merge=False)
    assert {n for n, _ in seen} == {"_SPLIT", "_REDUCE", "_QUANT", "_APPEND", "_dequant_kernel"}, seen
    assert all(v is True for _, v in seen), seen


def test_decode_runner_direct_launch_refuses_tensors_on_another_device():
    """DecodeRunner's direct launch passes raw pointers: a window length or step token on another device than its
    first run's must send the run the ordinary way (whose checks name the tensor), never into the kernel. The
    decision is made before any CUDA call, so it is checked here on the CPU with a recorded launch for device 0."""
    import types

    q = torch.zeros(2, 4, 64, dtype=torch.float16)
    rl = torch.zeros(2, dtype=torch.int32)
    nk = torch.zeros(2, 1, 64, dtype=torch.float16)
    r = types.SimpleNamespace(qshape=q.shape, qstride=q.stride(), dtype=q.dtype, scale=0.1, rl_dtype=rl.dtype,
                              new=nk.shape, nk=nk.stride(), nv=nk.stride(), sink=None, index=0)
    run = KD.DecodeRunner.__new__(KD.DecodeRunner)
    assert run._launch(r, q, rl, 0.1, nk, nk) is None  # the window lengths on the CPU, the launch on cuda:0
    rl_gpu = types.SimpleNamespace(dtype=rl.dtype, stride=rl.stride, get_device=lambda: 0)
    assert run._launch(r, q, rl_gpu, 0.1, nk, nk) is None  # the step token on the CPU

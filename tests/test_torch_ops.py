"""The torch path (kivi_cache.torch_ops: what runs where the Triton kernels do not, the CPU) against the reference.

Fresh random pools, odd lengths (not multiples of the page or the group), empty sequences and windows, GQA ratios
1-8, sliding windows, learned sinks, several chunks of pages, and poison (NaN) in every slot that holds no token: the
pages' slots past a sequence's length and the window's slots past its length. fp32 agrees to summation order; fp16
and bf16 to the rounding of the dequantized history, which the reference makes and this path does not. With
KIVI_TEST_GPU=1 the same tests run on the CUDA device (the path is the GPU's fallback).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import DEV, ON_GPU, make_block_table, make_pool

from kivi_cache import ops
from kivi_cache import reference as R
from kivi_cache import torch_ops as F

TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}
BITS = [(4, 4, 32), (2, 2, 32), (4, 2, 64), (2, 4, 32), (8, 8, 32)]


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def case(lengths, res_lengths, hkv=2, grp=3, d=64, p=64, bits=(4, 4, 32), dtype=torch.float32, c=None, poison=True,
         consecutive=False):
    """Decode arguments (the reference's order) with NaN in every slot that holds no token. ``consecutive``: one
    sequence's pages in order from page 2 (the path that reads them as a view)."""
    kb, vb, g = bits
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    bt, np_ = make_block_table(lengths, p)
    if consecutive:
        bt = (torch.arange(bt.shape[1], dtype=torch.int32, device=DEV) + 2)[None]
        np_ = bt.shape[1] + 4
    pool = list(make_pool(np_, hkv, p, d, g, kb, vb, dtype))
    c = c or max(1, max(res_lengths))
    res_k = torch.randn(len(lengths), hkv, c, d, device=DEV).to(dtype)
    res_v = torch.randn(len(lengths), hkv, c, d, device=DEV).to(dtype)
    if poison:
        used = set()
        for b, n in enumerate(lengths):
            for j in range(-(-n // p)):
                page, first = int(bt[b, j]), n - j * p  # the page's first slot past the sequence's length
                used.add(page)
                if first < p:
                    pool[1][page, :, -(-first // g):] = float("nan")  # key groups from the first empty one
                    pool[2][page, :, -(-first // g):] = float("nan")
                    pool[4][page, :, :, first:] = float("nan")
                    pool[5][page, :, :, first:] = float("nan")
            res_k[b, :, res_lengths[b]:] = float("nan")
            res_v[b, :, res_lengths[b]:] = float("nan")
        for page in set(range(np_)) - used:
            for i in (1, 2, 4, 5):
                pool[i][page] = float("nan")
    q = torch.randn(len(lengths), hkv * grp, d, device=DEV).to(dtype)
    rl = torch.tensor(res_lengths, dtype=torch.int32, device=DEV)
    return [q, bt, lengths_t, *pool, res_k, res_v, rl, kb, vb, g, 1.0 / math.sqrt(d)]


def check_decode(args, **kw):
    ref = R.paged_decode_attention(*args, **kw)
    out = F.paged_decode_attention(*args, **kw)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    print(f"rel err {err:.1e}")
    assert err < TOL[args[0].dtype], err
    return out


@pytest.mark.parametrize("bits", BITS, ids=lambda b: "k{}v{}g{}".format(*b))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_decode_matches_the_reference(bits, dtype):
    # one sequence with a partial last page; a batch of unequal lengths, an empty sequence, empty and full windows
    check_decode(case([864], [161], bits=bits, dtype=dtype))
    check_decode(case([96, 0, 416, 256], [5, 1, 33, 0], bits=bits, dtype=dtype, c=40))


@pytest.mark.parametrize("bits", BITS, ids=lambda b: "k{}v{}g{}".format(*b))
def test_one_sequence_with_consecutive_pages(bits, monkeypatch):
    """The pages read as a view of the pool (no gather), and the stored-slot mask cached by length."""
    for n in (864, 896, 1000, 64):
        args = case([n], [7], bits=bits, consecutive=True)
        check_decode(args)
        check_decode(args, sliding_window=300)
    monkeypatch.setattr(F, "CHUNK_CODES", 3 * 64 * 64 * 2)  # 3 pages a chunk
    check_decode(case([1000], [7], bits=bits, consecutive=True))


@pytest.mark.parametrize("grp", [1, 4, 8])
@pytest.mark.parametrize("window", [None, 1, 50, 300])
def test_decode_gqa_and_sliding_windows(grp, window):
    check_decode(case([480, 64, 320], [20, 7, 0], grp=grp, c=24), sliding_window=window)


def test_decode_sinks_and_head_dims():
    """Learned sinks with unequal lengths, equal lengths and one sequence (the path without a per-token mask)."""
    for d in (64, 128, 256):
        args = case([192, 32], [9, 3], d=d, grp=2)
        check_decode(args, sink_logits=torch.randn(args[0].shape[1], device=DEV))
    for lengths, rls in (([192], [9]), ([64, 64], [3, 3])):
        args = case(lengths, rls, grp=2)
        check_decode(args, sink_logits=torch.randn(args[0].shape[1], device=DEV))


@pytest.mark.parametrize("window", range(61, 68))
def test_sliding_window_at_page_boundaries(window):
    """Windows whose earliest visible key falls on the last slot of a page, the first of the next, or near them."""
    check_decode(case([128], [1], grp=2), sliding_window=window)
    check_decode(case([127, 128], [1, 5], grp=2), sliding_window=window)


def test_decode_writes_the_step_token_like_the_reference():
    """Both ways of writing the step's token: a slice copy where every window has the same length (the cache's
    steps), indexing otherwise; an empty window takes none (every window empty: none written)."""
    for rls in ([9, 9], [9, 0], [0, 0]):
        args = case([128, 64], rls, c=12)
        nk, nv = torch.randn(2, 2, 1, 64, device=DEV), torch.randn(2, 2, 1, 64, device=DEV)
        ra = [t.clone() if torch.is_tensor(t) else t for t in args]
        ref = R.paged_decode_attention(*ra, new_k=nk, new_v=nv)
        out = F.paged_decode_attention(*args, new_k=nk, new_v=nv)
        assert rel_err(out, ref) < TOL[torch.float32]
        for i in (9, 10):  # the windows, NaN slots compared as equal
            assert torch.equal(args[i].nan_to_num(7.0), ra[i].nan_to_num(7.0))
        if rls[0]:
            assert torch.equal(args[9][0, :, 8], nk[0, :, 0])
        else:
            assert torch.isnan(args[9]).all()  # the poison stays: nothing was written


def test_several_chunks_of_pages(monkeypatch):
    args = case([1000, 333], [40, 17], bits=(2, 2, 32))
    whole = F.paged_decode_attention(*args)
    monkeypatch.setattr(F, "CHUNK_CODES", 2 * 64 * 64 * 3)  # 1-2 pages a chunk: 8 chunks
    chunked = check_decode(args)
    assert rel_err(chunked, whole) < 1e-6
    check_decode(args, sliding_window=700)


def test_empty_batch_and_no_pages():
    check_decode(case([0, 0], [3, 1]))
    assert not F.paged_decode_attention(*case([0], [0])).any()  # no key at all: zeros, as the reference gives
    args = case([5], [2])
    args[0], args[1], args[2], args[11] = args[0][:0], args[1][:0], args[2][:0], args[11][:0]
    args[9], args[10] = args[9][:0], args[10][:0]
    out = F.paged_decode_attention(*args)
    assert out.shape == (0, 6, 64)
    a = prefix_args(args, 3)
    assert F.paged_prefix_attention(*a).shape == R.paged_prefix_attention(*a).shape == (0, 6, 3, 64)


def prefix_args(args, ql, padded_row=False):
    bsz, hq, d = args[0].shape
    hkv = args[3].shape[1]
    q = torch.randn(bsz, hq, ql, d, device=DEV).to(args[0].dtype)
    nk = torch.randn(bsz, hkv, ql, d, device=DEV).to(q.dtype)
    nv = torch.randn(bsz, hkv, ql, d, device=DEV).to(q.dtype)
    mask = torch.tril(torch.ones(ql, ql, dtype=torch.bool, device=DEV)).expand(bsz, ql, ql).clone()
    if padded_row:
        mask[0, 0] = False  # a query that sees no new token (and, with no history, nothing)
    return [q, *args[1:12], nk, nv, mask, *args[12:]]


@pytest.mark.parametrize("bits", BITS[:3], ids=lambda b: "k{}v{}g{}".format(*b))
@pytest.mark.parametrize("window", [None, 3, 100])
def test_prefix_matches_the_reference(bits, window):
    for lengths, rls in (([864], [161]), ([96, 0, 416], [5, 0, 33])):
        a = prefix_args(case(lengths, rls, bits=bits, c=40 if len(lengths) > 1 else None), 5, padded_row=True)
        sinks = torch.randn(a[0].shape[1], device=DEV)
        ref = R.paged_prefix_attention(*a, sliding_window=window, sink_logits=sinks)
        out = F.paged_prefix_attention(*a, sliding_window=window, sink_logits=sinks)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < TOL[torch.float32]


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_random_shapes(data):
    bits = data.draw(st.sampled_from(BITS))
    p = data.draw(st.sampled_from([b for b in (32, 64, 128) if b % bits[2] == 0 and b >= 32]))
    bsz = data.draw(st.integers(1, 4))
    lengths = data.draw(st.lists(st.integers(0, 5 * p), min_size=bsz, max_size=bsz))
    rls = data.draw(st.lists(st.integers(0, 9), min_size=bsz, max_size=bsz))
    grp = data.draw(st.sampled_from([1, 2, 5]))
    window = data.draw(st.sampled_from([None, 1, 17, 200]))
    args = case(lengths, rls, hkv=data.draw(st.integers(1, 3)), grp=grp, p=p, bits=bits, c=10)
    check_decode(args, sliding_window=window)


@pytest.mark.skipif(ON_GPU, reason="on a GPU ops.DecodeRunner holds the kernels' runner")
def test_runner_checks_once_and_then_runs_fast():
    args = case([300, 200], [6, 6], c=10)
    q, bt, ln, *pool = args[:9]
    rk, rv, rl = args[9:12]
    run = ops.DecodeRunner(bt, ln, pool, res_k=rk, res_v=rv, key_bits=4, value_bits=4, group_size=32)
    assert isinstance(run.kernel, F.DecodeRunner)
    for _ in range(3):
        out = run(q, rl, args[-1])
        assert rel_err(out, R.paged_decode_attention(*args)) < TOL[torch.float32]
    assert run.kernel.fast_runs == 2
    with pytest.raises(ValueError, match="q must be"):  # a new shape: the ordinary call and its checks
        run(q[:, :, :32], rl, args[-1])
    with pytest.raises(ValueError, match="sm_scale"):
        run(q, rl, "1/8")


@pytest.mark.parametrize("bits", BITS, ids=lambda b: "k{}v{}g{}".format(*b))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_dequantize_pages_matches_the_reference(bits, dtype):
    """The eager-attention fallback's history: tokens in order, zeros past each length (its slots poisoned) and past
    the table (max_len), the pool's dtype; equal to the reference's up to the fused fp32 multiply-add's rounding."""
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    for lengths, consecutive in (([864], True), ([864], False), ([96, 0, 416, 256], False)):
        a = case(lengths, [1] * len(lengths), bits=bits, dtype=dtype, consecutive=consecutive)
        for max_len in (None, 100, 2000):
            ref = R.dequantize_pages(*a[1:9], *a[12:15], max_len=max_len)
            out = F.dequantize_pages(*a[1:9], *a[12:15], max_len=max_len)
            for o, r in zip(out, ref, strict=True):
                assert o.shape == r.shape and o.dtype == r.dtype and torch.isfinite(o).all()
                assert ((o.double() - r.double()).abs().max() / r.double().abs().max()).item() < tol
            t = ref[0].shape[2]  # out=: views of a larger NaN buffer, written in place (both paths)
            for mod in (F, R):
                buf = torch.full((2, len(lengths), 2, t + 3, 64), float("nan"), dtype=torch.float32, device=DEV)
                got = mod.dequantize_pages(*a[1:9], *a[12:15], max_len=max_len, out=(buf[0, :, :, 1:t + 1],
                                                                                      buf[1, :, :, 1:t + 1]))
                assert got[0].data_ptr() == buf[0, :, :, 1:].data_ptr() and torch.isnan(buf[:, :, :, 0]).all()
                assert torch.isnan(buf[:, :, :, t + 1:]).all()
                for o, r in zip(got, ref, strict=True):
                    assert torch.isfinite(o).all()
                    assert ((o.double() - r.double()).abs().max() / r.double().abs().max()).item() < tol
            with pytest.raises(ValueError, match="out tensors must be"):
                F.dequantize_pages(*a[1:9], *a[12:15], max_len=max_len, out=(buf[0, :, :, :t + 1], buf[1, :, :, 1:]))
    e = case([0], [1], bits=bits, dtype=dtype)
    assert F.dequantize_pages(*e[1:9], *e[12:15])[0].shape == (1, 2, 0, 64)
    e[1] = e[1][:, :0]  # a table with no column, max_len past it: zeros
    out = F.dequantize_pages(*e[1:9], *e[12:15], max_len=5)
    assert out[0].shape == R.dequantize_pages(*e[1:9], *e[12:15], max_len=5)[0].shape == (1, 2, 5, 64)
    assert not out[0].any() and not out[1].any()

"""kernels/prefix.py: paged_prefix_attention (a chunk of queries over the quantized pages, the window and the chunk
itself) against the torch reference and, with a sliding window, kernel_cases' fp64 oracle; what a window slot past
res_lengths holds reaches neither attention op."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEV, TOL, brute_window_attention, decode_case, rel_err

from kivi_cache import reference as R
from kivi_cache.kernels import api as K


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
    """batch_slice: None or an int >= 1, else a ValueError naming it (with -1 no slice would run, leaving the output
    uninitialized; 0 and 1.5 would fail in range() with its own message)."""
    args = decode_case(2, 1, 2, 64, 64, 32, 4, 4, torch.float16, [96, 0], [3, 5])
    q = torch.randn(2, 2, 3, 64, device=DEV).to(torch.float16)
    new = torch.randn(2, 1, 3, 64, device=DEV).to(torch.float16)
    mask = torch.ones(2, 3, 3, dtype=torch.bool, device=DEV)
    with pytest.raises(ValueError, match="batch_slice must be None \\(by memory\\) or an int >= 1"):
        K.paged_prefix_attention(q, *args[1:12], new, new, mask, *args[12:], batch_slice=batch_slice)


def test_window_slots_past_res_lengths_never_reach_the_output():
    """The window's slots at and past res_lengths hold no token: an engine's ``torch.empty`` window may hold anything
    there, NaN included. Decode and prefix attention, kernels and reference, give what they give over a zeroed
    window (a masked slot's zero weight times NaN would still be NaN)."""
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
    none stored): zeros, as the reference (not the value of the kernels' buffer's first key)."""
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

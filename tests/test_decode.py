"""kernels/decode.py: paged_decode_attention against the torch reference (bit widths, GQA, dtypes, page and group
sizes, context splits, the half-precision dot path, the step's token written into the window, the window read in
chunks, sliding windows against kernel_cases' fp64 oracle) and DecodeRunner's direct launch. The plan's choices:
test_decode_plan.py; the merge of the split partials: test_decode_merge.py; sinks: test_sinks.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    BITS,
    DEV,
    HALF,
    ON_GPU,
    TOL,
    brute_window_attention,
    decode_case,
    rel_err,
    run_decode,
    window_with_token,
)

from kivi_cache import reference as R
from kivi_cache.kernels import api as K
from kivi_cache.kernels import decode as KD
from kivi_cache.kernels import tuning as KT


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
    """num_splits: None (automatic) or an int >= 1, else a ValueError naming it: -1 would read no context split (a
    silent wrong answer), 0 is not automatic, and a float or a string must not reach the plan (a TypeError there)."""
    args = decode_case(2, 1, 2, 64, 64, 32, 4, 4, torch.float16, [96, 160], [3, 5])
    with pytest.raises(ValueError, match="num_splits must be None \\(automatic\\) or an int >= 1"):
        K.paged_decode_attention(*args, num_splits=splits)


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
    # the GPU path refuses pages not divisible by 32 (its results there are wrong)
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


# ----------------------------------------------------------------------------- the half-precision dot path

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


@pytest.mark.parametrize("splits", [3, 6])
def test_decode_half_dot_splits_past_the_end(splits):
    """64-token steps (unmasked loop + partial-step loop) with splits that start past a sequence's end."""
    args = decode_case(2, 2, 4, 64, 128, 32, 4, 4, torch.float16, [96, 200], [5, 0])
    run_decode(args, f"decode half-dot splits{splits}", num_splits=splits, tuning=HALF)


# ----------------------------------------------------------------------------- the step's token

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


# ----------------------------------------------------------------------------- sliding-window attention

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


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "16"])
def test_sliding_window_argument_is_checked(bad):
    args = decode_case(1, 1, 1, 64, 64, 32, 4, 4, torch.float32, [64], [3])
    for fn in (K.paged_decode_attention, R.paged_decode_attention):
        with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
            fn(*args, sliding_window=bad)


# ----------------------------------------------------------------------------- DecodeRunner

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

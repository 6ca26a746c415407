"""kernels/sinks.py: learned attention sinks (GPT-OSS's per-head sink logits) in the decode op, DecodeRunner and the
prefix op, against kernel_cases' fp64 oracle; and the report of the largest relative errors of the kernel tests."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DEV,
    MAX_ERR,
    TOL,
    brute_window_attention,
    decode_case,
    patch_default_decode_tuning,
    rel_err,
    window_with_token,
)

from kivi_cache import reference as R
from kivi_cache.kernels import api as K
from kivi_cache.kernels import tuning as KT


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


# the last, in pytest's (alphabetical) order, of the modules that record errors: the report covers them all
def test_zz_report_max_errors():
    print("max relative errors:", {k: f"{v:.2e}" for k, v in sorted(MAX_ERR.items())})

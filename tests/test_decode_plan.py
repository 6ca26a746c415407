"""kernels/decode_plan.py: the decode op's plan (checked on the plan alone where the choice is the point): residency
and the split-count rule, the value-hint and key-scale policies behind DecodeTuning's vhint and ksz, plan reuse, and
where the window is read in chunks (and a 150-slot window so read: the reference's output, the plan's programs) and
where the split kernel merges its own partials."""

from __future__ import annotations

import pytest
import torch
import triton
from kernel_cases import DEV, HALF, TOL, decode_case, rel_err, run_decode, window_with_token

from kivi_cache import reference as R
from kivi_cache.kernels import api as K
from kivi_cache.kernels import decode as KD
from kivi_cache.kernels import decode_plan as KP
from kivi_cache.kernels import tuning as KT


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


@pytest.mark.parametrize("newkv,fuse", [(False, False), (True, True), (True, False)])
def test_window_read_in_chunks_by_several_programs(newkv, fuse, monkeypatch):
    """``DecodeTuning(rchunk=64)``: a 150-slot window read by three programs (windows empty, inside one chunk, at and
    past the chunks' edges, full); with the step's token written by the chunk that holds its slot, merged by the merge
    kernel or in the split kernel: the reference's output and window; the plan has NS + 3 programs per pair."""

    monkeypatch.setattr(KD, "_PLANS", {})  # only this test's plans are checked below
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

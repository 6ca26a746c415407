"""kernels/decode_merge.py: the merge of the split partials, by the merge kernel or by the split kernel's last
program of each (sequence, KV head), and the compiled mode's op, which never merges in the split kernel."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEV, TOL, decode_case, patch_default_decode_tuning, rel_err

from kivi_cache import reference as R
from kivi_cache.kernels import api as K
from kivi_cache.kernels import decode as KD
from kivi_cache.kernels import decode_plan as KP
from kivi_cache.kernels import tuning as KT


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


@pytest.mark.parametrize("grp,splits", [(1, 1), (3, 4), (8, 15), (4, 20)])
def test_split_kernel_merges_its_own_partials(monkeypatch, grp, splits):
    """The split kernel merging (here ``fuse_merge=True``; by default at small batches): the last program of
    each (sequence, KV head) merges the NS + 1 partials (up to ``DecodeTuning.merge_max``, MERGE_MAX, of them,
    unrolled up to 16 and in a loop beyond, as at 21 here; and while GP x BM <= 1024; else the merge kernel
    launches: test_in_kernel_merge_plan_limits); outputs
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
    counts. A count tensor allocated by a first call and kept by the plan makes generate fail on the GPU: inductor's
    CUDA graphs run their warm-up in the graphs' own memory pool, and recording refuses the pool tensor kept alive
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

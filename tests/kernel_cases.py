"""Builders and checks shared by the kernels' tests (test_api, test_quantize, test_dequant, test_decode*, test_prefix,
test_sinks; test_torch_ops and test_quant build their pools here too): random page pools, block tables and decode
cases, the decode op against the torch reference (kivi_cache.reference) within TOL, and an independent fp64 oracle
for sliding windows and sinks. Not a test module.

The kernel tests run under the Triton interpreter on CPU (conftest.py sets TRITON_INTERPRET=1); with
KIVI_TEST_GPU=1 the same tests run on the CUDA device. Shapes are tiny so the interpreter finishes in minutes.
"""

from __future__ import annotations

import math
import os

import torch

from kivi_cache import reference as R
from kivi_cache.kernels import api as K
from kivi_cache.kernels import tuning as KT
from kivi_cache.quant import qmax

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

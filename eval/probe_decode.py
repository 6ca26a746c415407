"""Diagnose the paged decode kernel on a GPU: where does its time go?

One run times, on the same shapes (default b=8, 8 KV heads, 32k; b=1, 8 KV heads, 128k):
  * fp16 SDPA (distinct K and V tensors), the bandwidth reference;
  * ``fp16-paged``: the kernel's own loop structure (split-K, a page-id load per step, tl.dot,
    online softmax) over *fp16* pages: the ceiling of the structure without any dequantization;
  * the int4/int2 kernel as shipped, and diagnostic variants: ``probe1`` (no scale/zero loads),
    ``probe2`` (keys only, no value path), ``prefetch`` (page id loaded one step ahead), 8 warps.
Prints ms, effective TB/s over the bytes each variant must read, and saves JSON (--out).
"""

import argparse
import json
import math

import torch
import triton
import triton.language as tl

from kivi_cache.kernels import api as KK
from kivi_cache.kernels.decode_merge import decode_reduce
from kivi_cache.kernels.tuning import DecodeTuning


@triton.jit
def _fp16_paged_split(q_ptr, bt_ptr, len_ptr, k_ptr, v_ptr, m_ws, l_ws, o_ws, qk_scale, Hkv, NS,
                      s_qb, s_qh, s_btb, s_kp, s_kh, s_kt,
                      GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                      BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // Hkv
    h = pid % Hkv
    b64 = b.to(tl.int64)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    gmask = offs_g < GROUP
    q = tl.load(q_ptr + b64 * s_qb + (h * GROUP + offs_g)[:, None] * s_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    length = tl.load(len_ptr + b)
    npg = tl.cdiv(length, P)
    pps = tl.cdiv(npg, NS)
    t0 = split * pps * P
    t1 = tl.minimum(t0 + pps * P, length)
    offs_t = tl.arange(0, BLOCK)
    for start in range(t0, t1, BLOCK):
        page = tl.load(bt_ptr + b64 * s_btb + start // P).to(tl.int64)
        tp = start % P + offs_t
        base = page * s_kp + h * s_kh + tp[:, None] * s_kt + offs_d[None, :]
        k = tl.load(k_ptr + base)
        v = tl.load(v_ptr + base)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where((start + offs_t < t1)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    row = (b64 * Hkv + h) * GROUP + offs_g
    ws = row * NS + split
    tl.store(m_ws + ws, m_i, mask=gmask)
    tl.store(l_ws + ws, l_i, mask=gmask)
    tl.store(o_ws + ws[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])


def fp16_paged(q, bt, lens, kp, vp, ns, block, warps, stages):
    b, hq, d = q.shape
    _, hkv, p, _ = kp.shape
    grp = hq // hkv
    m = torch.empty(b * hq, ns, device=q.device, dtype=torch.float32)
    l_ = torch.empty_like(m)
    o = torch.empty(b * hq, ns, d, device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    _fp16_paged_split[(b * hkv, ns)](q, bt, lens, kp, vp, m, l_, o, 1.44 / math.sqrt(d), hkv, ns,
                                     q.stride(0), q.stride(1), bt.stride(0), kp.stride(0), kp.stride(1),
                                     kp.stride(2), GROUP=grp, GP=max(16, grp), D=d, P=p, BLOCK=block,
                                     num_warps=warps, num_stages=stages)
    decode_reduce(m, l_, o, out, hq)
    return out


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, hq, d, g, page = "cuda", 32, 128, 32, 64
    rows = []

    def rec(**r):
        rows.append(r)
        print(f"b={r['batch']} ctx={r['context']} {r['variant']:<22} {r['ms']:.4f} ms  {r['tbps']:.2f} TB/s",
              flush=True)

    for b, hkv, ctx in [(8, 8, 32768), (1, 8, 131072)]:
        q4 = torch.randn(b, hq, 1, d, device=dev, dtype=torch.float16)
        kf = torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.float16)
        vf = torch.randn_like(kf)
        t = bench(lambda q4=q4, kf=kf, vf=vf: torch.nn.functional.scaled_dot_product_attention(q4, kf, vf,
                                                                                     enable_gqa=True))
        rec(batch=b, context=ctx, variant="sdpa-fp16", ms=t, tbps=2 * kf.numel() * 2 / t / 1e9)
        npg = ctx // page
        np_ = b * npg
        kp = kf.reshape(b, hkv, npg, page, d).permute(0, 2, 1, 3, 4).reshape(np_, hkv, page, d).contiguous()
        vp = vf.reshape(b, hkv, npg, page, d).permute(0, 2, 1, 3, 4).reshape(np_, hkv, page, d).contiguous()
        del kf, vf
        perm = torch.randperm(np_, device=dev)
        kp, vp = kp[perm].contiguous(), vp[perm].contiguous()
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(np_, device=dev)
        bt = inv.reshape(b, npg).to(torch.int32)
        lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
        q = q4[:, :, 0]
        ns = max(1, min(triton.cdiv(132 * 8, b * hkv), ctx // 512))
        for block, warps, stages in [(32, 4, 3), (64, 4, 3)]:  # block <= page size
            try:
                t = bench(lambda a=(q, bt, lens, kp, vp, ns, block, warps, stages): fp16_paged(*a))
                rec(batch=b, context=ctx, variant=f"fp16-paged-b{block}-w{warps}", ms=t,
                    tbps=2 * kp.numel() * 2 / t / 1e9)
            except Exception as e:  # noqa: BLE001
                print("fp16-paged", block, warps, "failed:", e)
        del kp, vp
        for bits in (4, 2):
            t_q = ctx - 128
            np2 = b * (t_q // page)
            kc = torch.randint(0, 255, (np2, hkv, page, d * bits // 8), device=dev, dtype=torch.uint8)
            ks = torch.rand(np2, hkv, page // g, d, device=dev, dtype=torch.float16) * 0.1
            vc = torch.randint(0, 255, (np2, hkv, d, page * bits // 8), device=dev, dtype=torch.uint8)
            vs = torch.rand(np2, hkv, d // g, page, device=dev, dtype=torch.float16) * 0.1
            bt2 = torch.randperm(np2, device=dev, dtype=torch.int32).reshape(b, -1)
            l2 = torch.full((b,), t_q, device=dev, dtype=torch.int32)
            rk = torch.randn(b, hkv, 160, d, device=dev, dtype=torch.float16)
            rl = torch.full((b,), 128, device=dev, dtype=torch.int32)
            nbytes = sum(x.numel() * x.element_size() for x in (kc, ks, ks, vc, vs, vs))
            for name, kw in [(f"int{bits}", {}), (f"int{bits}-plain-unpack", {"tuning": DecodeTuning(unpack="plain")}),
                             (f"int{bits}-w2", {"tuning": DecodeTuning(warps=2)})]:
                try:
                    t = bench(lambda a=(q, bt2, l2, kc, ks, ks, vc, vs, vs, rk, rk, rl, bits, bits, g, 0.088), kw=kw:
                              KK.paged_decode_attention(*a, **kw))
                    rec(batch=b, context=ctx, variant=name, ms=t, tbps=nbytes / t / 1e9)
                except Exception as e:  # noqa: BLE001
                    print(name, "failed:", e)
            del kc, ks, vc, vs
    if args.out:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()

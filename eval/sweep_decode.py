"""Sweep the decode kernel's launch settings on a GPU (warps, stages, query-row padding, PTX unpack on/off).

Prints one line per setting: time (median, do_bench), effective TB/s over the bytes the kernel
must read, and speed-up over fp16 SDPA on the same shape (measured in the same run). Each setting is a
``kernels.tuning.DecodeTuning`` passed to the op. Usage:
    python eval/sweep_decode.py [--out results.json] [--quick]
"""

import argparse
import itertools
import json

import torch
import triton

from kivi_cache.kernels import api as KK
from kivi_cache.kernels.tuning import DecodeTuning

ap = argparse.ArgumentParser()
ap.add_argument("--out", default=None)
ap.add_argument("--quick", action="store_true", help="fewer settings")
args = ap.parse_args()
dev = "cuda"
hq, d = 32, 128
rows = []
# (warps, stages, maxnreg, plain, tokens per step)
SETTINGS = [(w, st, r, False, 32) for w, st, r in itertools.product((1, 2), (2, 3), (0, 128))]
SETTINGS += [(1, 3, 128, True, 32), (4, 3, 128, False, 32), (1, 3, 0, False, 64), (1, 3, 168, False, 64)]
if args.quick:
    SETTINGS = [(1, 3, 128, False, 32), (1, 3, 0, False, 64)]
BITS = ((4, 4, 32), (2, 2, 32)) if args.quick else ((4, 4, 32), (2, 2, 32), (4, 2, 64))
for (b, hkv, ctx) in [(8, 8, 32768), (1, 8, 131072)]:
    q = torch.randn(b, hq, 1, d, device=dev, dtype=torch.float16)
    kf = torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.float16)
    vf = torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.float16)  # separate K and V (no L2 reuse)
    t_sdpa = triton.testing.do_bench(lambda q=q, kf=kf, vf=vf: torch.nn.functional.scaled_dot_product_attention(
        q, kf, vf, enable_gqa=True), warmup=50, rep=300, return_mode="median")
    del kf, vf
    for kb, vb, g in BITS:
        page = 64
        t_q = ctx - 128
        npg = -(-t_q // page)
        np_ = b * npg
        kc = torch.randint(0, 255, (np_, hkv, page, d * kb // 8), device=dev, dtype=torch.uint8)
        ks = torch.rand(np_, hkv, page // g, d, device=dev, dtype=torch.float16) * 0.1
        vc = torch.randint(0, 255, (np_, hkv, d, page * vb // 8), device=dev, dtype=torch.uint8)
        vs = torch.rand(np_, hkv, d // g, page, device=dev, dtype=torch.float16) * 0.1
        bt = torch.randperm(np_, device=dev, dtype=torch.int32).reshape(b, npg)
        lens = torch.full((b,), t_q, device=dev, dtype=torch.int32)
        rk = torch.randn(b, hkv, 160, d, device=dev, dtype=torch.float16)
        rl = torch.full((b,), 128, device=dev, dtype=torch.int32)
        nbytes = sum(t.numel() * t.element_size() for t in (kc, ks, ks, vc, vs, vs)) + 2 * b * hkv * 128 * d * 2
        for warps, stages, maxnreg, plain, step in SETTINGS:
            tuning = DecodeTuning(warps=warps, stages=stages, maxnreg=maxnreg, step=step,
                                  unpack="plain" if plain else "auto")
            try:
                args_ = (q[:, :, 0], bt, lens, kc, ks, ks, vc, vs, vs, rk, rk, rl, kb, vb, g, 0.088)
                t = triton.testing.do_bench(
                    lambda a=args_, tuning=tuning: KK.paged_decode_attention(*a, tuning=tuning),
                    warmup=50, rep=300, return_mode="median")
            except Exception as e:  # noqa: BLE001
                print(f"b={b} ctx={ctx} k{kb}v{vb}g{g} w={warps} st={stages} maxnreg={maxnreg} step={step} "
                      f"plain={plain}: "
                      f"{type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            r = dict(batch=b, kv_heads=hkv, context=ctx, page=page, key_bits=kb, value_bits=vb, group=g,
                     warps=warps, stages=stages, maxnreg=maxnreg, step=step, plain=plain, ms=t, sdpa_ms=t_sdpa,
                     tbps=nbytes / t / 1e9, speedup=t_sdpa / t)
            rows.append(r)
            print(f"b={b} ctx={ctx} k{kb}v{vb}g{g} w={warps} st={stages} maxnreg={maxnreg} step={step} "
                  f"plain={plain}: {t:.4f} ms "
                  f"({r['tbps']:.2f} TB/s) sdpa {t_sdpa:.4f} ms -> {r['speedup']:.2f}x", flush=True)
        del kc, ks, vc, vs
for key in sorted({(r["batch"], r["context"], r["key_bits"], r["value_bits"]) for r in rows}):
    best = min((r for r in rows if (r["batch"], r["context"], r["key_bits"], r["value_bits"]) == key),
               key=lambda r: r["ms"])
    print("BEST", key, {k: best[k] for k in ("warps", "stages", "maxnreg", "step", "plain", "ms", "tbps", "speedup")})
if args.out:
    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   rows=rows), open(args.out, "w"), indent=1)

"""Sweep the decode kernel's tile (BLOCK tokens), warps, stages and page size on a GPU.

Prints one line per setting: time (median, do_bench), effective TB/s over the bytes
the kernel must read, and speed-up over fp16 SDPA on the same shape. Usage:
    python eval/sweep_decode.py [--out results.json]
"""

import argparse
import itertools
import json
import os

import torch
import triton

from kivi_cache import kernels as KK

ap = argparse.ArgumentParser()
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev = "cuda"
hq, d, g = 32, 128, 32
rows = []
for (b, hkv, ctx) in [(8, 8, 32768), (1, 8, 131072)]:
    q = torch.randn(b, hq, 1, d, device=dev, dtype=torch.float16)
    kf = torch.randn(b, hkv, ctx, d, device=dev, dtype=torch.float16)
    t_sdpa = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, kf, kf, enable_gqa=True), warmup=50, rep=300, return_mode="median")
    del kf
    for page, bits in itertools.product((64, 128), (4, 2)):
        t_q = ctx - 128
        npg = -(-t_q // page)
        np_ = b * npg
        kc = torch.randint(0, 255, (np_, hkv, page, d * bits // 8), device=dev, dtype=torch.uint8)
        ks = torch.rand(np_, hkv, page // g, d, device=dev, dtype=torch.float16) * 0.1
        vc = torch.randint(0, 255, (np_, hkv, page, d * bits // 8), device=dev, dtype=torch.uint8)
        vs = torch.rand(np_, hkv, page, d // g, device=dev, dtype=torch.float16) * 0.1
        bt = torch.randperm(np_, device=dev, dtype=torch.int32).reshape(b, npg)
        lens = torch.full((b,), t_q, device=dev, dtype=torch.int32)
        rk = torch.randn(b, hkv, 160, d, device=dev, dtype=torch.float16)
        rl = torch.full((b,), 128, device=dev, dtype=torch.int32)
        nbytes = sum(t.numel() * t.element_size() for t in (kc, ks, ks, vc, vs, vs)) + 2 * b * hkv * 128 * d * 2
        for blk, warps, stages in itertools.product((64,), (4, 8), (3,)):
            if blk > page:
                continue
            os.environ.update(KIVI_DECODE_BLOCK=str(blk), KIVI_DECODE_WARPS=str(warps),
                              KIVI_DECODE_STAGES=str(stages))
            try:
                t = triton.testing.do_bench(lambda: KK.paged_decode_attention(
                    q[:, :, 0], bt, lens, kc, ks, ks, vc, vs, vs, rk, rk, rl, bits, bits, g, 0.088),
                    warmup=50, rep=300, return_mode="median")
            except Exception as e:  # noqa: BLE001
                print(f"b={b} ctx={ctx} page={page} int{bits} blk={blk} w={warps} st={stages}: {e}")
                continue
            r = dict(batch=b, kv_heads=hkv, context=ctx, page=page, bits=bits, block=blk, warps=warps,
                     stages=stages, ms=t, sdpa_ms=t_sdpa, tbps=nbytes / t / 1e9, speedup=t_sdpa / t)
            rows.append(r)
            print(f"b={b} ctx={ctx} page={page} int{bits} blk={blk} w={warps} st={stages}: {t:.4f} ms "
                  f"({r['tbps']:.2f} TB/s) sdpa {t_sdpa:.4f} ms -> {r['speedup']:.2f}x", flush=True)
        del kc, ks, vc, vs
for key in sorted({(r["batch"], r["context"], r["bits"]) for r in rows}):
    best = min((r for r in rows if (r["batch"], r["context"], r["bits"]) == key), key=lambda r: r["ms"])
    print("BEST", key, {k: best[k] for k in ("page", "block", "warps", "stages", "ms", "tbps", "speedup")})
if args.out:
    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   rows=rows), open(args.out, "w"), indent=1)

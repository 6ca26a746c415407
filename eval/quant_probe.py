"""A/B of quantize_and_write launch settings on the GPU (CUDA-graph timing, one flush per sequence).

Variants are ``kernels.tuning.QuantTuning`` settings passed to the op: ``split`` (1: keys and values in separate
programs, grid (N, H, 2); 0: one program does both) and ``warps``. Each variant's output is checked against the torch
reference.
    python eval/quant_probe.py [--out quant_probe.json]
"""

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kernels import graph_bench  # noqa: E402

from kivi_cache import reference as R  # noqa: E402
from kivi_cache.config import QuantConfig  # noqa: E402
from kivi_cache.kernels import api as KK  # noqa: E402
from kivi_cache.kernels.tuning import QuantTuning  # noqa: E402
from kivi_cache.pool import PagePool  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="1x8,8x8,8x32,32x32", help="batch x KV heads")
ap.add_argument("--variants", default="s0w4:0:4,s1w4:1:4,s1w8:1:8,s0w8:0:8", help="name:SPLIT:WARPS")
ap.add_argument("--out", default=None)
args = ap.parse_args()

d, g, p, kb, vb = 128, 32, 64, 4, 4
rows = []
for shape in args.shapes.split(","):
    b, h = map(int, shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(b, h, g, d, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(b, h, g, d, device="cuda", dtype=torch.float16, generator=gen)
    pages = torch.arange(b, device="cuda", dtype=torch.int32)
    slots = torch.full((b,), 32, device="cuda", dtype=torch.int32)

    def pool(b=b, h=h):  # zeroed pages of b sequences in the cache's own layout
        cfg = QuantConfig(key_bits=kb, value_bits=vb, group_size=g, page_size=p, num_pages=b)
        return PagePool(cfg, h, d, torch.float16, torch.device("cuda")).args()

    ref = pool()
    R.quantize_and_write(k, v, pages, slots, *ref, kb, vb, g)
    row = {"batch": b, "kv_heads": h}
    for spec in args.variants.split(","):
        name, split, warps = spec.split(":")
        tuning = QuantTuning(split=split != "0", warps=int(warps))
        got = pool()
        KK.quantize_and_write(k, v, pages, slots, *got, kb, vb, g, tuning=tuning)
        same = all(torch.equal(a, r) for a, r in zip(got, ref, strict=True))
        ms = graph_bench(lambda a=(k, v, pages, slots, *got), t=tuning: KK.quantize_and_write(*a, kb, vb, g, tuning=t),
                         rep=100)
        row[name] = {"ms": ms, "matches_reference": same}
        print(f"b{b} kv{h} {name}: {ms * 1000:.2f} us, matches reference: {same}", flush=True)
    rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "d": d, "g": g, "bits": [kb, vb], "timing": "do_bench_cudagraph median", "rows": rows}, f,
                      indent=1)

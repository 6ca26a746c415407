"""Probe: the windowed decode kernel's time against the window and the batch (CUDA-graph replays and eager
do_bench), next to the unwindowed kernel over a pool of the window's length (the same bytes).

    . eval/device_env.sh && python eval/probe_sliding.py --out $OUT/probe_sliding.json
"""

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402

from eval.bench_kernels import graph_bench, make_pool  # noqa: E402
from kivi_cache.kernels import api as KK  # noqa: E402
from kivi_cache.kernels import decode as D  # noqa: E402


def case(b, ctx, window, dev, gen, hq=32, hkv=8, d=128, g=32, p=64, res=128):
    t_quant = (ctx - res) // g * g
    pool = make_pool(b, hkv, t_quant, d, p, g, 4, 4, dev, gen)
    rk = torch.randn(b, hkv, res + g, d, device=dev, dtype=torch.float16, generator=gen)
    rv = torch.randn_like(rk)
    rl = torch.full((b,), res, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, d, device=dev, dtype=torch.float16, generator=gen)
    pa = (q, pool["block_table"], pool["lengths"], pool["k_codes"], pool["k_scale"], pool["k_zero"],
          pool["v_codes"], pool["v_scale"], pool["v_zero"], rk, rv, rl, 4, 4, g, 1 / math.sqrt(d))
    kw = {} if window is None else {"sliding_window": window}
    fn = lambda: KK.paged_decode_attention(*pa, **kw)  # noqa: E731
    fn()
    fn()
    plans = [pl for k, pl in D._PLANS.items() if k[3] == q.shape and (k[-1] == window)]
    eager = triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    graph = graph_bench(lambda: KK.paged_decode_attention(*pa, merge=False, **kw), rep=60)
    return dict(batch=b, context=ctx, window=window, eager_us=eager * 1e3, graph_us=graph * 1e3,
                grid=list(plans[-1].grid) if plans else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe_sliding.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for b in (1, 8):
        for ctx, window in ((32768, None), (4224, None), (32768, 4096), (32768, 1024), (32768, 16384),
                            (32768, 32768)):
            r = case(b, ctx, window, dev, gen)
            print(json.dumps(r), flush=True)
            rows.append(r)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

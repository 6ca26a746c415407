"""GPU time of the decode op's merge (H200): the split kernel merging its own partials (in-kernel, one program per
(sequence, KV head) after the others) against the split kernel plus the merge kernel, from the torch profiler's
kernel durations (eager calls: a CUDA graph never uses the in-kernel merge). Per shape and setting the kernels' total
GPU time per call, the mean over ``--calls`` calls. Shapes ``BxHKVxCTX`` (32 query heads, d 128, int4 g32, pages of 64).

    python eval/merge_tail.py [--shapes 1x8x32768,1x8x131072,8x8x32768] [--calls 50] --out F.json
"""

import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kernels import decode_args, make_pool  # noqa: E402

from kivi_cache.kernels import api as K  # noqa: E402
from kivi_cache.kernels.tuning import DecodeTuning  # noqa: E402

SETTINGS = {"merge_kernel": DecodeTuning(fuse_merge=False), "in_kernel": DecodeTuning(fuse_merge=True, merge_max=1024)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1x8x32768,1x8x131072,8x8x32768")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    res = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), args=vars(args), rows=[])
    for shape in args.shapes.split(","):
        b, hkv, ctx = map(int, shape.split("x"))
        pool = make_pool(b, hkv, ctx, 128, 64, 32, 4, 4, dev, gen)
        q = torch.randn(b, 32, 128, device=dev, generator=gen, dtype=torch.float16)
        rk = torch.randn(b, hkv, 160, 128, device=dev, generator=gen, dtype=torch.float16)
        rv = torch.randn_like(rk)
        rl = torch.full((b,), 100, device=dev, dtype=torch.int32)
        a = decode_args(pool, q, rk, rv, rl, 4, 4, 32, 0.088)
        outs = {}
        for name, tuning in SETTINGS.items():
            for _ in range(5):  # compiled, planned
                outs[name] = K.paged_decode_attention(*a, tuning=tuning)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.calls):
                    K.paged_decode_attention(*a, tuning=tuning)
                torch.cuda.synchronize()
            kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            by_name: dict = {}
            for e in kern:
                by_name[e.name[:48]] = by_name.get(e.name[:48], 0.0) + e.time_range.elapsed_us() / args.calls
            row = dict(shape=shape, setting=name, gpu_us_per_call=sum(by_name.values()),
                       kernels_per_call=len(kern) / args.calls, us_per_call_by_kernel=by_name)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        err = ((outs["in_kernel"].float() - outs["merge_kernel"].float()).norm() / outs["merge_kernel"].float().norm())
        print(shape, "rel err in-kernel vs merge kernel", err.item(), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

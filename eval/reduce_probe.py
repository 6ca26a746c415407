"""Time the split-merge kernel alone, as CUDA-graph replays: an old kernels copy's ``_decode_reduce_kernel``
(session 5: grid B*Hq, serial over splits) against the current ``decode_reduce``. Rows: (B*Hq, NS+1, D).
Session 6 (``eval/results/reduce_probe.json``) ran it with the session-5 kernels in ``eval/ab/main``:
    mkdir -p eval/ab/main && git archive 2049a8f^1 kernels | tar -x -C eval/ab/main --strip-components=1
    python eval/reduce_probe.py eval/ab/main      (GPU; writes $OUT/reduce_probe.json)
"""
import importlib.util
import json
import os
import sys

import torch
import triton

from kivi_cache.kernels import decode_merge as new

old_dir = sys.argv[1] if len(sys.argv) > 1 else "eval/ab/main"
spec = importlib.util.spec_from_file_location("oldk", os.path.join(old_dir, "__init__.py"),
                                              submodule_search_locations=[old_dir])
mod = importlib.util.module_from_spec(spec)
sys.modules["oldk"] = mod
spec.loader.exec_module(mod)
old = sys.modules["oldk.attention"]


def graph_ms(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    return triton.testing.do_bench(g.replay, warmup=20, rep=200, return_mode="median") / 10


res = []
for rows, nsp1, d in [(32, 257, 128), (32, 129, 128), (32, 65, 128), (32, 99, 128), (256, 49, 128), (1024, 13, 128)]:
    m = torch.randn(rows, nsp1, device="cuda")
    l_ = torch.rand(rows, nsp1, device="cuda") + 0.5
    o = torch.randn(rows, nsp1, d, device="cuda")
    out = torch.empty(rows // 32 if rows >= 32 else 1, 32, d, device="cuda", dtype=torch.float16)
    out2 = torch.empty_like(out)
    bs = min(triton.next_power_of_2(nsp1), 32)
    grid_old = old._decode_reduce_kernel[(rows,)]
    args_old = (m, l_, o, out, nsp1, out.stride(0), out.stride(1), 32)
    t_old = graph_ms(lambda g=grid_old, a=args_old, kw=dict(D=d, BS=bs): g(*a, **kw, num_warps=4))
    t_new = graph_ms(lambda a=(m, l_, o, out2, 32): new.decode_reduce(*a))
    err = ((out.float() - out2.float()).norm() / out.float().norm()).item()
    r = dict(rows=rows, nsp1=nsp1, d=d, old_us=t_old * 1e3, new_us=t_new * 1e3, err=err)
    print(json.dumps(r))
    res.append(r)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "reduce_probe.json"), "w"), indent=1)

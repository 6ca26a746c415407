"""Why are CUDA-graph replays of the decode kernels slower than their eager launches at large shapes? (GPU)

Session 15's bench_kernels (`eval/results/bench_kernels_s15.json`): at 32 x 32 KV heads x 32k, int4 took 1.374 ms
eagerly (`do_bench`: an L2-clearing memset before each timed call) and 1.565 ms as `do_bench_cudagraph` replays
(many calls in one graph, back to back), while fp16 SDPA took the same either way. This probe times one kernel
four ways in one process, and samples the SM clock and power while each runs (``nvidia-smi -lms``):

* ``do_bench``: eager, L2 flushed before every call (bench_kernels' eager column);
* ``eager_burst``: N eager calls back to back between two events (no flush, sustained load like a graph);
* ``graph_burst``: ``do_bench_cudagraph`` (N calls captured in one graph; bench_kernels' graph column);
* ``graph_single``: a graph of one call, replayed with a sync after each replay (a graph without sustained load).

If ``eager_burst`` is as slow as ``graph_burst`` and the clock drops during both, sustained load is the cause
(our kernel is issue-bound, so it follows the SM clock; SDPA is DRAM-bound). If only the graphs are slow, it is
the capture (e.g. another plan or launch under capture). Usage:
    python eval/graph_gap.py [--shape 32x32x32768] [--bits 4/4/32] [--out F.json]
    python eval/graph_gap.py --quick      # CPU interpreter smoke run (eager timings only)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

QUICK = "--quick" in sys.argv
if QUICK:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kernels import decode_args, graph_bench, make_pool  # noqa: E402

from kivi_cache.kernels import api as KK  # noqa: E402


class Clocks:
    """SM clock (MHz) and power (W) samples from ``nvidia-smi -lms 20`` while a block runs (empty without it)."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self.proc = None

    def __enter__(self):
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,"
                                          "nounits", "-lms", "20"], stdout=subprocess.PIPE, text=True)
        except (FileNotFoundError, OSError):
            return self
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            try:
                clk, pw = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.samples.append((clk, pw))

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        clk = sorted(c for c, _ in self.samples)
        pw = sorted(p for _, p in self.samples)
        return dict(sm_mhz_min=clk[0], sm_mhz_median=clk[len(clk) // 2], power_w_max=pw[-1], samples=len(clk))


def burst(fn, n: int, cuda: bool) -> float:
    """ms per call of ``n`` calls back to back."""
    if cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / n
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) * 1e3 / n


def graph_single(fn, n: int) -> float:
    """ms per replay of a one-call graph, each replay timed alone (median)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2x2x512" if QUICK else "32x32x32768", help="BATCHxKVxCONTEXT")
    ap.add_argument("--bits", default="4/4/32", help="KEY/VALUE/GROUP")
    ap.add_argument("--calls", type=int, default=3 if QUICK else 200)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not QUICK
    dev = torch.device("cuda" if cuda else "cpu")
    b, hkv, ctx = (int(x) for x in args.shape.split("x"))
    kb, vb, g = (int(x) for x in args.bits.split("/"))
    hq, d, res, p = (4 * hkv if QUICK else 32), (64 if QUICK else 128), 32 if QUICK else 128, 64
    gen = torch.Generator(device=dev).manual_seed(0)
    t_quant = (ctx - res) // g * g
    pool = make_pool(b, hkv, t_quant, d, p, g, kb, vb, dev, gen)
    dt = torch.float16 if cuda else torch.float32
    q = torch.randn(b, hq, d, device=dev, dtype=dt, generator=gen)
    rk = torch.randn(b, hkv, res + g, d, device=dev, dtype=dt, generator=gen)
    rv = torch.randn(rk.shape, device=dev, dtype=dt, generator=gen)
    rl = torch.full((b,), ctx - t_quant, device=dev, dtype=torch.int32)
    sm = d ** -0.5
    margs = decode_args(pool, q, rk, rv, rl, kb, vb, g, sm)
    kf = torch.randn(b, hkv, ctx, d, device=dev, dtype=dt, generator=gen)
    vf = torch.randn(kf.shape, device=dev, dtype=dt, generator=gen)
    q4 = q[:, :, None]
    fns = {"fp16_sdpa": lambda: F.scaled_dot_product_attention(q4, kf, vf, enable_gqa=True),
           "kivi": lambda: KK.paged_decode_attention(*margs)}
    out = dict(machine=torch.cuda.get_device_name(dev) if cuda else "cpu", torch=torch.__version__,
               triton=triton.__version__, shape=dict(batch=b, kv_heads=hkv, context=ctx, q_heads=hq, head_dim=d),
               bits=args.bits, calls=args.calls, rows={})
    for name, fn in fns.items():
        fn()
        row = out["rows"][name] = {}
        methods = {"eager_burst": lambda fn=fn: burst(fn, args.calls, cuda)}
        if cuda:
            methods = {"do_bench": lambda fn=fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"),
                       **methods, "graph_burst": lambda fn=fn: graph_bench(fn, rep=60),
                       "graph_single": lambda fn=fn: graph_single(fn, args.calls)}
        for method, run in methods.items():
            with Clocks() as c:
                ms = run()
            row[method] = dict(ms=ms, **c.summary())
            print(f"{name:10s} {method:13s} {ms:8.4f} ms  {c.summary()}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()

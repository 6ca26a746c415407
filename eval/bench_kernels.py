"""Benchmark of the kivi_cache Triton kernels against fp16 SDPA decode attention.

Usage (GPU, < 8 minutes on an H200):
    python eval/bench_kernels.py [--out eval/results/bench_kernels.json]
Tiny CPU smoke run under the Triton interpreter (writes eval/results/bench_kernels_quick.json/.png):
    python eval/bench_kernels.py --quick

For every (batch, KV heads, context) it builds an fp16 KV cache and int4 / int2
paged pools of the same context (context - residual quantized tokens in pages,
``residual`` fp16 tokens in the residual window), checks the Triton decode
kernel against the torch reference on a small slice, then times, alternating
configurations over several rounds: fp16 ``scaled_dot_product_attention`` (q
``[B, 32, 1, 128]``), int4 and int2 ``paged_decode_attention``, and
``quantize_and_write`` (one group per sequence, the flush of one decode step).
Reports time, bytes read, effective TB/s against a device-to-device copy
bandwidth measured in the same run, and the speed-up over fp16; saves JSON and
a PNG plot of speed-up vs context.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

QUICK = "--quick" in sys.argv
if QUICK:
    try:  # the interpreter must be on before triton.jit functions are defined
        import torch as _t

        if not _t.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    except Exception:
        os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402

from kivi_cache import reference as REF  # noqa: E402
from kivi_cache.kernels import api as KK  # noqa: E402
from kivi_cache.kernels import tuning as KT  # noqa: E402
from kivi_cache.testing import decode_args, random_pool  # noqa: E402

GB = 1e9


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------- timing

def graph_bench(fn, rep: int) -> float:
    """Median ms of ``fn`` captured in a CUDA graph and replayed (GPU time, no launch overhead). Syncs first:
    ``do_bench_cudagraph`` makes its first call on a new stream that does not wait for the default stream, so it
    could read inputs still being written (session 10: an illegal address in ab_decode, gone with a sync)."""
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def cold_graph_bench(fn, rounds: int = 15, calls: int = 10, flush_mib: int = 256) -> float:
    """Median ms of ``fn`` with a cold L2, as inside a model (where every layer's pages and window are evicted by
    the weights streaming through L2 between two visits): two CUDA graphs, ``calls`` x (zero a ``flush_mib`` buffer,
    ``fn``) and ``calls`` x (zero the buffer), replayed alternately ``rounds`` times; the difference of their median
    replay times over ``calls``. Graph replays and ``do_bench_cudagraph`` keep a small problem in L2 (50 MB on an
    H200); session 17's A/B of the window chunks saw no gain that way, the compiled model step 18 -> 10 us a call
    (eval/NOTES.md, session 18)."""
    flush = torch.empty(flush_mib << 20, dtype=torch.int8, device="cuda")

    def capture(body):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (allocations, first launches)
            body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                body()
        return graph

    both = capture(lambda: (flush.zero_(), fn()))
    alone = capture(flush.zero_)
    times = {both: [], alone: []}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(rounds):
        for graph in ((both, alone) if i % 2 == 0 else (alone, both)):
            torch.cuda.synchronize()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[graph].append(start.elapsed_time(end))
    return max(0.0, (statistics.median(times[both]) - statistics.median(times[alone])) / calls)


def timer(device, graph=False):
    if device.type == "cuda" and graph:
        def t(fn):  # GPU time only: the calls captured in a CUDA graph and replayed (no launch overhead)
            fn()
            return graph_bench(fn, rep=60)
    elif device.type == "cuda":
        def t(fn):
            return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    else:
        def t(fn):
            fn()
            best = float("inf")
            for _ in range(1):
                t0 = time.perf_counter()
                fn()
                best = min(best, (time.perf_counter() - t0) * 1e3)
            return best
    return t


def copy_bandwidth(device, quick):
    nbytes = (1 << 22) if quick else (4 << 30)
    x = torch.empty(nbytes // 2, dtype=torch.float16, device=device).uniform_()
    y = torch.empty_like(x)
    ms = timer(device)(lambda x=x, y=y: y.copy_(x))
    del x, y
    return 2 * nbytes / (ms * 1e-3)


# ----------------------------------------------------------------------------- problem builders

make_pool = random_pool  # the benchmark's pools: kivi_cache.testing's


def pool_bytes(pool, b, hkv, t_quant, d, p, g, kb, vb, res, hq):
    codes = b * hkv * t_quant * d * (kb + vb) // 8
    scales = b * hkv * (t_quant // g) * d * 2 * 2 + b * hkv * t_quant * (d // g) * 2 * 2  # fp16 scale + zero
    resid = 2 * b * hkv * res * d * 2
    qb = b * hq * d * 2 * 2  # q read + out written
    bt = pool["block_table"].numel() * 4
    return codes + scales + resid + qb + bt


def verify(pool, q, rk, rv, rl, kb, vb, g, sm, slice_tokens):
    """Kernel vs torch reference on the first sequence(s), first ``slice_tokens`` tokens."""
    nb = min(2, q.shape[0])
    p = pool["k_codes"].shape[2]
    t_s = min(int(pool["lengths"][0]), slice_tokens) // g * g
    np_s = -(-t_s // p)
    sub = dict(pool)
    sub["block_table"] = pool["block_table"][:nb, :np_s].contiguous()
    sub["lengths"] = torch.full((nb,), t_s, dtype=torch.int32, device=q.device)
    args = decode_args(sub, q[:nb], rk[:nb], rv[:nb], rl[:nb], kb, vb, g, sm)
    out = KK.paged_decode_attention(*args).float()
    ref = REF.paged_decode_attention(*args).float()
    err = ((out - ref).norm() / ref.norm()).item()
    return err


# ----------------------------------------------------------------------------- main

def bench_config(row, b, hkv, ctx, hq, d, res, g, p, sm, t_quant, res_len, fp16_bytes, device, gen, tm, bw, rounds,
                 quick, tm_graph=None, graph_below=0.0):
    """One shape: every kernel timed with ``tm`` in alternating rounds (best round kept); with ``tm_graph``,
    those faster than ``graph_below`` ms are also timed as CUDA-graph replays (``*_graph_ms``: GPU time
    without the launch overhead that bounds small eager calls)."""
    q = torch.randn(b, hq, d, dtype=torch.float16, device=device, generator=gen)
    kf = torch.randn(b, hkv, ctx, d, dtype=torch.float16, device=device, generator=gen)
    vf = torch.randn(b, hkv, ctx, d, dtype=torch.float16, device=device, generator=gen)
    q4 = q[:, :, None, :]
    gqa = hkv != hq

    def sdpa():
        return F.scaled_dot_product_attention(q4, kf, vf, enable_gqa=gqa)

    fns = {"fp16_sdpa": sdpa}
    # int2_k4v2g64: Int2PagedCache's settings; int4_g64: 4/4 bits with 64-token / 64-channel groups (10% fewer
    # bytes than g32: scales and zeros per 64 elements)
    configs = {"int4": (4, 4, g), "int2": (2, 2, g), "int2_k4v2g64": (4, 2, 64), "int4_g64": (4, 4, 64)}
    pools = {}
    for name, (kb, vb, gg) in configs.items():
        tq = t_quant // gg * gg
        pool = pools[name] = make_pool(b, hkv, tq, d, p, gg, kb, vb, device, gen)
        rl_c = torch.full((b,), ctx - tq, dtype=torch.int32, device=device)
        rk_c = torch.randn(b, hkv, res + gg - 1, d, dtype=torch.float16, device=device, generator=gen)
        rv_c = torch.randn_like(rk_c)
        a = decode_args(pool, q, rk_c, rv_c, rl_c, kb, vb, gg, sm)
        fns[name] = (lambda a=a: KK.paged_decode_attention(*a))
        row[f"{name}_rel_err"] = verify(pool, q, rk_c, rv_c, rl_c, kb, vb, gg, sm, 256 if quick else 4096)
        row[f"{name}_bytes"] = pool_bytes(pool, b, hkv, tq, d, p, gg, kb, vb, ctx - tq, hq)
    # quantize_and_write: one group per sequence (a decode step's flush), int4 pool
    pool4 = pools["int4"]
    kq = torch.randn(b, hkv, g, d, dtype=torch.float16, device=device, generator=gen)
    vq = torch.randn(b, hkv, g, d, dtype=torch.float16, device=device, generator=gen)
    pg = pool4["block_table"][:, 0].contiguous()
    sl = torch.zeros(b, dtype=torch.int32, device=device)
    qa = (kq, vq, pg, sl, pool4["k_codes"], pool4["k_scale"], pool4["k_zero"], pool4["v_codes"],
          pool4["v_scale"], pool4["v_zero"], 4, 4, g)
    fns["quantize_and_write"] = lambda: KK.quantize_and_write(*qa)
    # sanity: SDPA vs our fp32 reference path on the fp16 cache is not needed; time now
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():  # alternate configurations
            times[name].append(tm(fn))
    for name, ts in times.items():
        row[f"{name}_ms"] = min(ts)
        row[f"{name}_ms_rounds"] = ts
    row["fp16_bytes"] = fp16_bytes + b * hq * d * 4
    for name in ("fp16_sdpa", *configs):
        nbytes = row["fp16_bytes"] if name == "fp16_sdpa" else row[f"{name}_bytes"]
        ms = row[f"{name}_ms"]
        row[f"{name}_TBps"] = nbytes / (ms * 1e-3) / 1e12
        row[f"{name}_frac_copy_bw"] = nbytes / (ms * 1e-3) / bw
    for name in configs:
        row[f"{name}_speedup"] = row["fp16_sdpa_ms"] / row[f"{name}_ms"]
    if tm_graph is not None:
        # every kernel of a row as graphs once one of them is under graph_below: the speed-ups then compare GPU
        # times on both sides (fp16 SDPA itself is rarely host-bound, but its eager time includes the launch)
        if any(row[f"{name}_ms"] < graph_below for name in fns):
            for name, fn in fns.items():
                row[f"{name}_graph_ms"] = tm_graph(fn)
        for name in configs:
            if f"{name}_graph_ms" in row and "fp16_sdpa_graph_ms" in row:
                row[f"{name}_graph_speedup"] = row["fp16_sdpa_graph_ms"] / row[f"{name}_graph_ms"]
    row["quantize_frac_of_int4_decode"] = row["quantize_and_write_ms"] / row["int4_ms"]
    log(f"B={b:2d} KV={hkv:2d} ctx={ctx:6d}: fp16 {row['fp16_sdpa_ms']:.3f} ms "
        f"({row['fp16_sdpa_TBps']:.2f} TB/s) | int4 {row['int4_ms']:.3f} ms "
        f"({row['int4_TBps']:.2f} TB/s, x{row['int4_speedup']:.2f}, err {row['int4_rel_err']:.1e}) | "
        f"int2 {row['int2_ms']:.3f} ms ({row['int2_TBps']:.2f} TB/s, x{row['int2_speedup']:.2f}, "
        f"err {row['int2_rel_err']:.1e}) | int2 k4v2g64 {row['int2_k4v2g64_ms']:.3f} ms "
        f"(x{row['int2_k4v2g64_speedup']:.2f}) | int4 g64 {row['int4_g64_ms']:.3f} ms "
        f"({row['int4_g64_TBps']:.2f} TB/s, x{row['int4_g64_speedup']:.2f}) | "
        f"quant {row['quantize_and_write_ms']:.4f} ms")
    graphed = [n for n in fns if f"{n}_graph_ms" in row]
    if graphed:
        log("    as CUDA graphs: " + ", ".join(f"{n} {row[n + '_graph_ms']:.3f} ms" for n in graphed)
            + "".join(f" | {n} x{row[n + '_graph_speedup']:.2f}" for n in configs if n + "_graph_speedup" in row))
    return row


def parse_args(argv=None):
    """The command line; ``--out`` defaults to eval/results/bench_kernels.json, with ``--quick`` to
    eval/results/bench_kernels_quick.json (the PNG goes beside it). The interpreter switch for ``--quick``
    reads ``sys.argv`` at import (``QUICK``), not ``argv``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None,
                    help="JSON path, the PNG beside it (default eval/results/bench_kernels.json; with --quick "
                         "bench_kernels_quick.json)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, CPU interpreter smoke run")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--batches", type=str, default=None, help="comma list, overrides the default sweep")
    ap.add_argument("--kv-heads", type=str, default=None)
    ap.add_argument("--contexts", type=str, default=None)
    ap.add_argument("--no-sweep", action="store_true", help="skip the page-size sweep")
    ap.add_argument("--graph", action="store_true",
                    help="time every kernel (SDPA too) inside a CUDA graph: GPU time without launch overhead, "
                         "as in compiled decoding; default: eager launches as in the eager cache")
    ap.add_argument("--graph-below", type=float, default=0.3,
                    help="eager runs: also time as CUDA graphs every kernel whose eager time is below this many ms "
                         "(GPU time of the launch-bound small shapes, same run; 0 = off)")
    ap.add_argument("--tuning", default="", metavar="FIELD=VALUE,...",
                    help="run every kernel under these launch settings (kivi_cache.kernels.tuning.parse, e.g. "
                         "vhint=0,quant.warps=8; set as the process's tuning.DEFAULT); default: the defaults")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                "bench_kernels_quick.json" if args.quick else "bench_kernels.json")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.tuning:
        KT.DEFAULT = KT.parse(args.tuning)  # the kernels' calls below (they pass no tuning) run under it

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        raise SystemExit("no CUDA device: use --quick for the CPU interpreter smoke run")
    quick = args.quick
    if quick:
        batches, kv_heads, contexts = [1, 2], [2], [256, 512]
        hq, d, res, p, g = 8, 64, 32, 64, args.group_size
        mem_limit = 1e9
    else:
        batches, kv_heads, contexts = [1, 8, 32], [8, 32], [4096, 32768, 131072]
        hq, d, res, p, g = 32, 128, 128, args.page_size, args.group_size
        mem_limit = 100e9
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    if args.kv_heads:
        kv_heads = [int(x) for x in args.kv_heads.split(",")]
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    tm = timer(device, args.graph)
    tm_graph = timer(device, True) if device.type == "cuda" and not args.graph and args.graph_below > 0 else None
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    sm = 1.0 / math.sqrt(d)

    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    log(f"machine: {machine}; torch {torch.__version__}; triton {triton.__version__}; "
        f"interpreter={KK.interpreting()}; tuning {KT.overrides(KT.DEFAULT) or 'default'}")
    bw = copy_bandwidth(device, quick)
    log(f"device-to-device copy bandwidth: {bw / 1e12:.3f} TB/s (bytes read + written)")

    rows = []

    def save(complete: bool, **extra):  # after every row too: a run cut short keeps what it measured
        result = dict(machine=machine, torch=torch.__version__, triton=triton.__version__, quick=quick,
                      timing="cuda graph replay" if args.graph else "eager launches (do_bench)",
                      interpreter=KK.interpreting(), tuning=KT.overrides(KT.DEFAULT), complete=complete,
                      copy_bandwidth_TBps=bw / 1e12, rows=rows,
                      bytes_note="int: codes + scales/zeros (fp16) + fp16 residual K/V + q/out + block table; "
                                 "fp16: K + V + q/out", **extra)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for b in batches:
        for hkv in kv_heads:
            for ctx in contexts:
                row = dict(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, context=ctx, residual=res,
                           page_size=p, group_size=g)
                fp16_bytes = 2 * b * hkv * ctx * d * 2
                t_quant = (ctx - res) // g * g
                res_len = ctx - t_quant
                if fp16_bytes > mem_limit:
                    row["skipped"] = f"fp16 KV cache would need {fp16_bytes / GB:.1f} GB > {mem_limit / GB:.0f} GB"
                    log(f"skip B={b} KV={hkv} ctx={ctx}: {row['skipped']}")
                    rows.append(row)
                    save(False)
                    continue
                try:
                    bench_config(row, b, hkv, ctx, hq, d, res, g, p, sm, t_quant, res_len, fp16_bytes, device, gen,
                                 tm, bw, args.rounds, quick, tm_graph, args.graph_below)
                except torch.OutOfMemoryError as e:  # pragma: no cover - recorded, not fatal
                    row["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
                    log(f"skip B={b} KV={hkv} ctx={ctx}: {row['skipped']}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                save(False)

    # page-size sweep on one mid-size config (int4)
    sweep = []
    sb, skv, sctx = (2, 2, 512) if quick else (8, 8, 32768)
    for ps in (() if args.no_sweep else (32, 64) if quick else (32, 64, 128, 256)):
        if ps % g:
            continue
        t_quant = (sctx - res) // g * g
        pool = make_pool(sb, skv, t_quant, d, ps, g, 4, 4, device, gen)
        q = torch.randn(sb, hq, d, dtype=torch.float16, device=device, generator=gen)
        rk = torch.randn(sb, skv, res + g - 1, d, dtype=torch.float16, device=device, generator=gen)
        rv = torch.randn_like(rk)
        rl = torch.full((sb,), sctx - t_quant, dtype=torch.int32, device=device)
        a = decode_args(pool, q, rk, rv, rl, 4, 4, g, sm)
        err = verify(pool, q, rk, rv, rl, 4, 4, g, sm, 256 if quick else 4096)
        ms = tm(lambda a=a: KK.paged_decode_attention(*a))
        nbytes = pool_bytes(pool, sb, skv, t_quant, d, ps, g, 4, 4, res, hq)
        sweep.append(dict(page_size=ps, batch=sb, kv_heads=skv, context=sctx, int4_ms=ms,
                          int4_TBps=nbytes / (ms * 1e-3) / 1e12, rel_err=err))
        log(f"page sweep ps={ps:4d}: int4 {ms:.3f} ms, {nbytes / (ms * 1e-3) / 1e12:.2f} TB/s, err {err:.1e}")
        del pool

    # table
    log("")
    log(f"{'B':>3} {'KV':>3} {'ctx':>7} | {'fp16 ms':>8} {'TB/s':>5} | "
        f"{'int4 ms':>8} {'TB/s':>5} {'%bw':>4} {'x':>5} | "
        f"{'int2 ms':>8} {'TB/s':>5} {'%bw':>4} {'x':>5} | {'quant ms':>8} {'q/dec':>6}")
    for r in rows:
        if "skipped" in r:
            log(f"{r['batch']:>3} {r['kv_heads']:>3} {r['context']:>7} | skipped: {r['skipped']}")
            continue
        log(f"{r['batch']:>3} {r['kv_heads']:>3} {r['context']:>7} | "
            f"{r['fp16_sdpa_ms']:8.3f} {r['fp16_sdpa_TBps']:5.2f} | "
            f"{r['int4_ms']:8.3f} {r['int4_TBps']:5.2f} {100 * r['int4_frac_copy_bw']:4.0f} {r['int4_speedup']:5.2f} | "
            f"{r['int2_ms']:8.3f} {r['int2_TBps']:5.2f} {100 * r['int2_frac_copy_bw']:4.0f} {r['int2_speedup']:5.2f} | "
            f"{r['quantize_and_write_ms']:8.4f} {r['quantize_frac_of_int4_decode']:6.3f}")
    max_err = max([v for r in rows for k, v in r.items() if k.endswith("_rel_err")]
                  + [s["rel_err"] for s in sweep])
    log(f"max relative error vs reference over verified slices: {max_err:.2e}")

    save(True, page_size_sweep=sweep, max_rel_err=max_err)
    log(f"saved {args.out}")
    if not args.no_plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 4.5))
            for b in batches:
                for hkv in kv_heads:
                    rs = [r for r in rows if r["batch"] == b and r["kv_heads"] == hkv and "skipped" not in r]
                    if not rs:
                        continue
                    for bits, ls in ((4, "-"), (2, "--")):
                        ax.plot([r["context"] for r in rs], [r[f"int{bits}_speedup"] for r in rs], ls, marker="o",
                                label=f"int{bits} B={b} KV={hkv}")
            ax.set_xscale("log", base=2)
            ax.axhline(1.0, color="k", lw=0.5)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("speed-up over fp16 SDPA")
            ax.set_title(f"paged_decode_attention vs SDPA ({machine})")
            ax.legend(fontsize=6, ncol=2)
            png = os.path.splitext(args.out)[0] + ".png"
            fig.tight_layout()
            fig.savefig(png, dpi=120)
            log(f"saved {png}")
        except Exception as e:  # pragma: no cover
            log(f"plot skipped: {e}")


if __name__ == "__main__":
    main()

"""A/B timing of decode-kernel implementations in one process (GPU).

Each implementation is a copy of the ``kernels`` package: ``--impl name=path/to/package_dir`` (the
current ``kivi_cache.kernels`` is always ``cur``). Variants of ``cur`` run under a tuning
(``--tuning name:field=value,...``, :func:`kivi_cache.kernels.tuning.parse`: e.g. ``s32:step=32``,
``nohint:vhint=0``); a copy can have settings too (``--impl name=dir:field=value,...``: its own tuning, or, for a
copy from before ``kernels/tuning.py``, which read its settings from the environment, ``KEY=VAL`` variables set
around its calls).
For every shape and bit setting: fp16 SDPA (baseline, separate K and V
tensors), then every implementation/variant, in ``--rounds`` alternating rounds (medians of do_bench
medians); outputs are compared with ``cur`` (relative max error printed). Pools, bytes (codes, scales and
zeros, residual, q/out, block table) and kernel arguments come from ``bench_kernels.py``. Usage:
    python eval/ab_decode.py --impl main=eval/ab/kmain --tuning s32:step=32 --out ab.json
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
from unittest import mock

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kernels import cold_graph_bench, decode_args, graph_bench, make_pool, pool_bytes  # noqa: E402  (the benchmark's problem builders)
from graph_gap import Clocks, burst  # noqa: E402  (SM clock samples from nvidia-smi; back-to-back calls)

from kivi_cache.kernels import api as cur  # noqa: E402
from kivi_cache.kernels import tuning  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--impl", action="append", default=[], help="name=package_dir[:field=value,...] (its tuning; KEY=VAL "
                "environment variables for a copy without kernels/tuning.py)")
ap.add_argument("--tuning", action="append", default=[], help="name:field=value[,field=value] variant of cur "
                "(kernels.tuning.parse: e.g. vhint=0,ksz=1; decode.warps=2)")
ap.add_argument("--shapes", default="8x8x32768,32x8x32768,8x32x32768,1x8x131072,8x8x131072")
ap.add_argument("--bits", default="4/4/32,2/2/32,4/2/64")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (GPU time, no launch overhead)")
ap.add_argument("--cold", action="store_true", help="CUDA-graph replays with L2 flushed before every call "
                "(bench_kernels.cold_graph_bench: pages and window cold, as inside a model)")
ap.add_argument("--head-dim", type=int, default=128, help="head_dim of every shape (64, 128, 256)")
ap.add_argument("--q-heads", type=int, default=32, help="query heads (a multiple of every shape's KV heads)")
ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="queries, residual, scales and zeros")
ap.add_argument("--hot", default="", help="N[,N...]: also time cur (as hotN) with every block-table entry pointing "
                "into the first N pages of the pool (an L2-resident history: the kernel's time with next to no DRAM "
                "traffic; with N=1 every step reads the same page, mostly from L1)")
ap.add_argument("--burst-ms", type=float, default=0.0, help="after the rounds, also launch each implementation "
                "eagerly back to back for about this many ms and record its ms per call with the SM clock and power "
                "sampled meanwhile (nvidia-smi -lms 20): variants compared at a known clock (session 16: sustained "
                "load lowers it); host-bound below ~0.05 ms a call")
ap.add_argument("--out", default=None)
args = ap.parse_args()


def bench(fn):
    if args.cold:
        return cold_graph_bench(fn)
    if args.graph:
        return graph_bench(fn, rep=100)
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def op_call(mod, a, tuning=None):
    """A no-argument call of ``mod``'s decode op on the arguments ``a`` (under ``tuning``'s decode settings)."""
    if tuning is None:
        return lambda: mod.paged_decode_attention(*a)
    return lambda: mod.paged_decode_attention(*a, tuning=tuning.decode)


def settings(mod, kv: str):
    """``(tuning, environment)`` of an implementation: ``kv`` parsed by ``mod``'s own tuning module, or, for a copy
    from before it (which read its settings from the environment), as ``KEY=VAL`` variables."""
    if not kv:
        return None, {}
    own = getattr(mod, "tuning", None)
    if own is not None and hasattr(own, "parse"):
        return own.parse(kv), {}
    return None, dict(x.split("=", 1) for x in kv.split(","))


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


impls = [("cur", cur, None, {})]  # (name, package, tuning, environment)
for spec_ in args.impl:
    n, p = spec_.split("=", 1)
    p, _, kv = p.partition(":")  # name=dir[:settings]: that copy run under those settings
    mod = load("ab_" + n, p)
    impls.append((n, mod, *settings(mod, kv)))
for spec_ in args.tuning:
    n, kv = spec_.split(":", 1)
    impls.append((n, cur, tuning.parse(kv), {}))
hot = [int(x) for x in args.hot.split(",") if x]
for n_ in hot:
    impls.append((f"hot{n_}", cur, None, {}))

dev, hq, d, page, res = "cuda", args.q_heads, args.head_dim, 64, 128
rows = []


def save():
    """Write every row measured so far (called after each shape and bit setting: a run cut by a time limit keeps
    what it measured)."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           dtype=args.dtype, timing=("cuda graph replay, L2 flushed before every call" if args.cold else
                                   "cuda graph replay" if args.graph else "eager launches (do_bench)"), rows=rows),
                      f, indent=1)


dt = dict(fp16=torch.float16, bf16=torch.bfloat16)[args.dtype]
for shape in args.shapes.split(","):
    b, hkv, ctx = map(int, shape.split("x"))
    q = torch.randn(b, hq, 1, d, device=dev, dtype=dt)
    kf = torch.randn(b, hkv, ctx, d, device=dev, dtype=dt)
    vf = torch.randn(b, hkv, ctx, d, device=dev, dtype=dt)
    sdpa = []
    for _ in range(args.rounds):
        sdpa.append(bench(lambda q=q, kf=kf, vf=vf: torch.nn.functional.scaled_dot_product_attention(
            q, kf, vf, enable_gqa=True)))
    t_sdpa = statistics.median(sdpa)
    del kf, vf
    for bits in args.bits.split(","):
        kb, vb, g = map(int, bits.split("/"))
        t_q = ctx - res
        gen = torch.Generator(device=dev).manual_seed(0)
        pool = make_pool(b, hkv, t_q, d, page, g, kb, vb, torch.device(dev), gen, dt)
        rk = torch.randn(b, hkv, res + g, d, device=dev, dtype=dt, generator=gen)
        rv = torch.randn(b, hkv, res + g, d, device=dev, dtype=dt, generator=gen)
        rl = torch.full((b,), res, device=dev, dtype=torch.int32)
        nbytes = pool_bytes(pool, b, hkv, t_q, d, page, g, kb, vb, res, hq)
        bt = pool["block_table"]  # hotN: same shape and lengths, every entry one of the first N pages (L2-resident)
        hot_pools = {f"hot{n_}": dict(pool, block_table=(torch.arange(bt.numel(), device=dev, dtype=torch.int32) % min(
            n_, pool["k_codes"].shape[0])).reshape(bt.shape)) for n_ in hot}
        times = {n: [] for n, *_ in impls}
        outs = {}
        op_args = {n: decode_args(hot_pools.get(n, pool), q[:, :, 0], rk, rv, rl, kb, vb, g, d ** -0.5)
                   for n, *_ in impls}  # the hot variants on their block tables
        for _ in range(args.rounds):
            for n, mod, tun, env in impls:
                try:
                    with mock.patch.dict(os.environ, env):  # (env: only for a copy from before kernels/tuning.py)
                        f = op_call(mod, op_args[n], tun)
                        outs[n] = f().float()
                        times[n].append(bench(f))
                except Exception as e:  # noqa: BLE001
                    print(f"{shape} k{kb}v{vb}g{g} {n}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        bursts = {}
        if args.burst_ms:
            for n, mod, tun, env in impls:
                if not times[n]:
                    continue
                with mock.patch.dict(os.environ, env):
                    calls = max(10, int(args.burst_ms / statistics.median(times[n])))
                    with Clocks() as clk:
                        ms = burst(op_call(mod, op_args[n], tun), calls, cuda=dev == "cuda")
                    bursts[n] = dict(burst_ms_per_call=ms, burst_calls=calls, **clk.summary())
        ref = outs.get("cur")
        for n, mod, tun, env in impls:
            if not times[n]:
                continue
            t = statistics.median(times[n])
            err = (float((outs[n] - ref).abs().max() / ref.abs().max()) if ref is not None and n not in hot_pools
                   else float("nan"))  # the hot variant reads other pages: not comparable
            tuned = {} if tun is None else mod.tuning.overrides(tun)
            r = dict(impl=n, tuning=tuned, env=env, dtype=args.dtype, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d,
                     context=ctx, key_bits=kb, value_bits=vb, group=g,
                     ms=t, ms_rounds=times[n], sdpa_ms=t_sdpa, tbps=nbytes / t / 1e9, speedup=t_sdpa / t,
                     rel_err_vs_cur=err, bytes=nbytes, hot_pages=int(n[3:]) if n in hot_pools else None,
                     **bursts.get(n, {}))
            rows.append(r)
            print(f"{shape:>12} d{d} k{kb}v{vb}g{g} {n:>8}: {t:.4f} ms {r['tbps']:.2f} TB/s  sdpa {t_sdpa:.4f} -> "
                  f"{r['speedup']:.2f}x  err {err:.1e}  rounds {[round(x, 4) for x in times[n]]}"
                  + (f"  burst {r['burst_ms_per_call']:.4f} ms at SM {r.get('sm_mhz_median', '?')} MHz"
                     f" (min {r.get('sm_mhz_min', '?')}), {r.get('power_w_max', '?')} W" if n in bursts else ""),
                  flush=True)
        del pool
        save()


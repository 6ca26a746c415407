"""Where the host time of an eager batch-1 decode step goes: fp16 DynamicCache against kivi-int4.

Eager batch-1 decoding of an 8B model is host-bound (the GPU works ~5 ms of a 30-50 ms step), so a cache's
Python and launch costs decide its step time. This probe, on the GPU, with bench_generate's random-weight model:

1. alternating rounds of plain forward decode steps (no ``generate``: its own per-step work is the same for every
   cache) per cache: the median step time with a sync after each step, and the host time (step start until the
   forward returns, before the sync), and the same with the sync skipped (so the host runs ahead as in generate);
2. one cProfile of each cache's steps: the functions with the most own time and the total own time by package;
3. one op alone: the host time of a call of ``ops.paged_decode_attention`` (no sync) against torch SDPA over the
   same fp16 history.

    python eval/host_decode_probe.py [--model llama3-8b] [--prompt 1024] [--steps 48] [--rounds 3] --out F.json
    python eval/host_decode_probe.py --variants fp16,kivi:000,kivi:111 --rounds 8 --out F.json  (A/B in one process)
CPU smoke run: ``--device cpu --model tiny`` (TRITON_INTERPRET=1: the kernel calls are the interpreter's).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import DynamicCache  # noqa: E402

from eval import bench_generate as bg  # noqa: E402
from kivi_cache import Int4PagedCache, cache_kwargs, ops  # noqa: E402
from kivi_cache.kernels import tuning as T  # noqa: E402

CACHES = {"fp16": DynamicCache, "kivi-int4": Int4PagedCache}


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def decode(model, cache, ids, steps, dev, *, wait: bool, prof=None, on_step=None, cpu_s=None):
    """Prefill ``ids``, then ``steps`` one-token forwards. Returns (step seconds, host seconds) lists; ``cpu_s``: a
    list that gets each step's CPU time of this thread (``time.thread_time``: the host's work, less exposed to its
    scheduling than wall time)."""
    with torch.no_grad():
        out = model(ids, **cache_kwargs(model, cache), use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        sync(dev)
        pos = ids.shape[1]
        step_s, host_s = [], []
        if prof is not None:
            prof.enable()
        for _ in range(steps):
            c0 = time.thread_time()
            t0 = time.perf_counter()
            out = model(tok, **cache_kwargs(model, cache), use_cache=True,
                        cache_position=torch.tensor([pos], device=dev))
            tok = out.logits[:, -1:].argmax(-1)
            t1 = time.perf_counter()
            if cpu_s is not None:
                cpu_s.append(time.thread_time() - c0)
            if wait:
                sync(dev)
            step_s.append(time.perf_counter() - t0)
            host_s.append(t1 - t0)
            pos += 1
            if on_step is not None:
                on_step()
        if prof is not None:
            prof.disable()
        sync(dev)
    return step_s, host_s


_DEFAULTS: dict = {}


def set_variant(flags: str | None, tuning: str = "") -> None:
    """``flags``: three 0/1 digits, (window write in the op, in-kernel merge, decode runner), set in this process
    (the layer's FUSE_WINDOW_WRITE and DECODE_RUNNER, the kernels' default ``DecodeTuning.fuse_merge``); None: the
    process's settings at start-up. ``tuning``: ``field=value,...`` (kernels.tuning.parse) on top, in the default
    tuning the cache's kernel calls run under."""
    import kivi_cache.layer as L  # noqa: PLC0415

    if not _DEFAULTS:  # this process's settings at start-up
        _DEFAULTS.update(write=L.FUSE_WINDOW_WRITE, tuning=T.DEFAULT, runner=L.DECODE_RUNNER)
    base = _DEFAULTS["tuning"]
    if flags is None:  # back to them
        L.FUSE_WINDOW_WRITE, L.DECODE_RUNNER = _DEFAULTS["write"], _DEFAULTS["runner"]
    else:
        if len(flags) != 3 or set(flags) - {"0", "1"}:
            raise ValueError(f"variant flags must be three 0/1 digits (write, merge, runner); got {flags!r}")
        L.FUSE_WINDOW_WRITE = flags[0] == "1"
        base = T.parse(f"fuse_merge={flags[1]}", base)
        L.DECODE_RUNNER = flags[2] == "1"
    T.DEFAULT = T.parse(tuning, base)


def variants_ab(model, ids, args, dev) -> None:
    """In one process, rounds of no-sync decode steps (as generate runs them) of each variant in turn, the order
    reversed every other round: variants ``fp16``, ``kivi:WMR`` (see :func:`set_variant`) or ``kivi`` (the
    process's defaults, restored before each of its rounds). Per variant: the median
    over rounds of each round's median step, and per round the ratio to fp16 of the same round."""
    names = args.variants.split(",")
    res = dict(args=vars(args), torch=torch.__version__, python=platform.python_version(),
               gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", rounds=[])

    def make(name):
        if name == "fp16":
            return DynamicCache()
        name, *tuned = name.split("+")  # e.g. kivi+merge_max=256: the default tuning with that field changed
        set_variant(name.split(":")[1] if ":" in name else None, ",".join(tuned))  # ``kivi``: the process's defaults
        return Int4PagedCache()

    for name in names:  # warm-up: every variant's kernels compiled
        decode(model, make(name), ids, 4, dev, wait=True)
    res["cpu_rounds"] = []  # per round and variant: the median thread CPU time of a step (ms)
    for r in range(args.rounds):
        row, cpu_row = {}, {}
        for name in (names if r % 2 == 0 else names[::-1]):
            cpu = []
            step_s, _ = decode(model, make(name), ids, args.steps, dev, wait=False, cpu_s=cpu)
            row[name] = statistics.median(step_s) * 1e3
            cpu_row[name] = statistics.median(cpu) * 1e3
        res["rounds"].append(row)
        res["cpu_rounds"].append(cpu_row)
        print(json.dumps({k: round(v, 2) for k, v in row.items()}), "cpu",
              json.dumps({k: round(v, 2) for k, v in cpu_row.items()}), flush=True)
    fp = "fp16" in names
    res["summary"] = {n: dict(step_ms=statistics.median(x[n] for x in res["rounds"]),
                              ratio_to_fp16=statistics.median(x[n] / x["fp16"] for x in res["rounds"]) if fp else None,
                              cpu_ms=statistics.median(x[n] for x in res["cpu_rounds"]),
                              cpu_ratio_to_fp16=statistics.median(x[n] / x["fp16"] for x in res["cpu_rounds"])
                              if fp else None) for n in names}
    print(json.dumps(res["summary"], indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def package(filename: str) -> str:
    for key in ("kivi_cache", "kernels", "triton", "transformers", "torch"):
        if f"/{key}/" in filename:
            return key
    return "builtin" if filename.startswith("~") or filename.startswith("<") else "other"


def profile_summary(prof: cProfile.Profile, steps: int, top: int) -> dict:
    st = pstats.Stats(prof)
    rows, by_pkg = [], {}
    for (fname, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():
        by_pkg[package(fname)] = by_pkg.get(package(fname), 0.0) + tt
        rows.append(dict(where=f"{fname.split('site-packages/')[-1]}:{line} {func}", calls_per_step=nc / steps,
                         own_us_per_step=tt / steps * 1e6, cum_us_per_step=ct / steps * 1e6))
    rows.sort(key=lambda r: -r["own_us_per_step"])
    pkg = {k: v / steps * 1e6 for k, v in sorted(by_pkg.items(), key=lambda kv: -kv[1])}
    return dict(own_us_per_step_by_package=pkg,
                top_own=rows[:top], top_cumulative=sorted(rows, key=lambda r: -r["cum_us_per_step"])[:top])


def op_host_time(spec: dict, dtype, dev, prompt: int, calls: int) -> dict:
    """Host microseconds per call (no sync between calls) of our decode op on one layer's stored prompt, and of
    torch SDPA on the same shapes (the DynamicCache path's attention). ``spec``: a bench_generate model spec."""
    hq, hk = spec["num_attention_heads"], spec["num_key_value_heads"]
    d = spec.get("head_dim") or spec["hidden_size"] // hq
    cache = Int4PagedCache()
    k = torch.randn(1, hk, prompt, d, device=dev, dtype=dtype)
    cache.update(k, k, 0)
    layer = cache.layers[0]
    layer.commit(layer.pending)
    bt, ql, rl = layer._device_state()
    q = torch.randn(1, hq, d, device=dev, dtype=dtype)
    cfg = layer.cfg
    kw = dict(res_k=layer.res_k, res_v=layer.res_v, res_lengths=rl, sm_scale=d ** -0.5, key_bits=cfg.key_bits,
              value_bits=cfg.value_bits, group_size=cfg.group_size)

    def ours():
        return ops.paged_decode_attention(q, bt, ql, *layer.pool.args(), **kw)

    kv = torch.randn(1, hk, prompt, d, device=dev, dtype=dtype)
    q4 = q[:, :, None]

    def sdpa():
        return F.scaled_dot_product_attention(q4, kv, kv, enable_gqa=True)

    out = {}
    for name, fn in (("kivi_decode_op", ours), ("torch_sdpa_gqa", sdpa)):
        for _ in range(5):
            fn()
        sync(dev)
        ts = []
        for _ in range(calls):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        sync(dev)
        out[name] = dict(median_us=statistics.median(ts) * 1e6, min_us=min(ts) * 1e6)
    return out


def flush_probe(model, ids, args, dev) -> None:
    """Per-step times of kivi-int4 decode steps (synced), split by whether the step flushed a key group."""
    decode(model, Int4PagedCache(), ids, 8, dev, wait=True)  # warm-up
    res = dict(args=vars(args), torch=torch.__version__, gpu=torch.cuda.get_device_name() if dev.type == "cuda"
               else "cpu", runs=[])
    from kivi_cache.layer import QuantizedPagedLayer  # noqa: PLC0415

    for spare in (True, False, True, False):  # the block table's spare columns (session 14) on and off, in turn
        QuantizedPagedLayer.SPARE_COLUMNS = spare
        cache = Int4PagedCache()
        flushed = []

        def on_step(c=cache, seen=flushed):
            seen.append(sum(c.layers[0].paged_lens))

        step_s, host_s = decode(model, cache, ids, args.flush_probe, dev, wait=True, on_step=on_step)
        flush = [i > 0 and flushed[i] != flushed[i - 1] for i in range(len(flushed))]
        fl = [t * 1e3 for t, f in zip(step_s, flush, strict=True) if f]
        other = [t * 1e3 for t, f in zip(step_s, flush, strict=True) if not f]
        run = dict(spare_columns=spare, step_ms=[round(t * 1e3, 3) for t in step_s],
                   host_ms=[round(t * 1e3, 3) for t in host_s],
                   flush=flush, flush_steps=len(fl), flush_ms_median=statistics.median(fl) if fl else None,
                   other_ms_median=statistics.median(other), mean_ms=sum(step_s) / len(step_s) * 1e3)
        res["runs"].append(run)
        print(json.dumps({k: v for k, v in run.items() if k not in ("step_ms", "host_ms", "flush")}), flush=True)
    QuantizedPagedLayer.SPARE_COLUMNS = True
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def flush_profile(model, ids, args, dev) -> None:
    """Where a flush step's extra host time goes: kivi-int4 decode steps (synced), each under its own cProfile and
    torch.profiler (CPU ops and CUDA runtime calls); per step kind (flush / other) the functions and ops with the most
    own time per step."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    decode(model, Int4PagedCache(), ids, 8, dev, wait=True)  # warm-up
    cache = Int4PagedCache()
    kinds = {True: [None, {}, 0], False: [None, {}, 0]}  # cProfile stats, torch op own us, steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.no_grad():
        out = model(ids, **cache_kwargs(model, cache), use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        sync(dev)
        pos = ids.shape[1]
        for _ in range(args.flush_profile):
            before = sum(cache.layers[0].paged_lens)
            prof = cProfile.Profile()
            with profile(activities=acts) as tp:
                prof.enable()
                out = model(tok, **cache_kwargs(model, cache), use_cache=True,
                            cache_position=torch.tensor([pos], device=dev))
                tok = out.logits[:, -1:].argmax(-1)
                prof.disable()
                sync(dev)
            pos += 1
            k = kinds[sum(cache.layers[0].paged_lens) != before]
            k[0] = pstats.Stats(prof) if k[0] is None else (k[0].add(prof) or k[0])
            for e in tp.key_averages():
                k[1][e.key] = k[1].get(e.key, 0.0) + e.self_cpu_time_total
            k[2] += 1
    res = dict(args=vars(args), torch=torch.__version__, gpu=torch.cuda.get_device_name() if dev.type == "cuda"
               else "cpu")
    for flush, (st, ops_us, n) in kinds.items():
        if not n:
            continue
        rows = []
        for (fname, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():
            rows.append(dict(where=f"{fname.split('site-packages/')[-1]}:{line} {func}", calls_per_step=nc / n,
                             own_us_per_step=tt / n * 1e6, cum_us_per_step=ct / n * 1e6))
        name = "flush" if flush else "other"
        res[name] = dict(steps=n, top_own=sorted(rows, key=lambda r: -r["own_us_per_step"])[:args.top],
                         top_cumulative=sorted(rows, key=lambda r: -r["cum_us_per_step"])[:args.top],
                         torch_ops_own_us_per_step=dict(sorted(((k2, v / n) for k2, v in ops_us.items()),
                                                               key=lambda kv: -kv[1])[:args.top]))
        print(name, n, "steps; top cumulative:", flush=True)
        ours = [r for r in sorted(rows, key=lambda r: -r["cum_us_per_step"]) if "kivi_cache" in r["where"]
                or "kernels/" in r["where"] or "triton" in r["where"]]
        res[name]["ours_cumulative"] = ours[:args.top]
        for r in ours[:16]:
            print(f"  {r['cum_us_per_step']:10.0f} us {r['calls_per_step']:7.1f}x {r['where']}", flush=True)
        print("  torch ops (own us/step):", json.dumps({k2: round(v) for k2, v in
                                                          list(res[name]["torch_ops_own_us_per_step"].items())[:12]}),
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b", choices=sorted(bg.MODELS))
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--op-only", action="store_true", help="only item 3 (no model; seconds)")
    ap.add_argument("--no-profile", action="store_true", help="skip items 2 and 3 (the cProfile and the op alone)")
    ap.add_argument("--flush-probe", type=int, default=0, metavar="STEPS",
                    help="only kivi-int4: STEPS synced decode steps, each step's time, flush steps (a key group "
                         "quantized) against the others")
    ap.add_argument("--flush-profile", type=int, default=0, metavar="STEPS",
                    help="only kivi-int4: STEPS synced decode steps under cProfile and torch.profiler, flush steps "
                         "against the others")
    ap.add_argument("--variants", default=None, metavar="LIST",
                    help="comma-separated fp16 and kivi:WMR (0/1 digits: window write in the op, in-kernel merge, "
                         "decode runner), each optionally +field=value (a kernels.tuning field in the default tuning, "
                         "e.g. kivi+merge_max=256): no-sync step medians of each in turn, in one process")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bg.require_kernels("host_decode_probe")
    dev = torch.device(args.device)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    if args.op_only:
        import kivi_cache  # noqa: PLC0415

        gpu = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
        res = dict(args=vars(args), torch=torch.__version__, kivi_cache=kivi_cache.__file__, gpu=gpu,
                   op_host_us=op_host_time(bg.MODELS[args.model], dtype, dev, args.prompt, 500))
        print(res["kivi_cache"], "op host us per call", json.dumps(res["op_host_us"]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    model = bg.build_model(args.model, dev, torch.float16 if dev.type == "cuda" else torch.float32)
    ids = bg.prompt_ids(1, args.prompt, model.config.vocab_size, dev)
    if args.flush_probe:
        flush_probe(model, ids, args, dev)
        return
    if args.flush_profile:
        flush_profile(model, ids, args, dev)
        return
    if args.variants:
        variants_ab(model, ids, args, dev)
        return
    res = dict(args=vars(args), torch=torch.__version__, python=platform.python_version(),
               gpu=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", rounds=[])
    for make in CACHES.values():  # warm-up: kernels compiled, allocator primed
        decode(model, make(), ids, 4, dev, wait=True)
    for r in range(args.rounds):
        for name, make in (CACHES.items() if r % 2 == 0 else reversed(CACHES.items())):
            for wait in (True, False):
                step_s, host_s = decode(model, make(), ids, args.steps, dev, wait=wait)
                row = dict(round=r, cache=name, sync_each_step=wait, step_ms_median=statistics.median(step_s) * 1e3,
                           host_ms_median=statistics.median(host_s) * 1e3, step_ms_min=min(step_s) * 1e3,
                           total_ms_per_step=sum(step_s) / len(step_s) * 1e3)
                res["rounds"].append(row)
                print(json.dumps(row), flush=True)
    res["summary"] = {}
    for name in CACHES:
        for wait in (True, False):
            rows = [x for x in res["rounds"] if x["cache"] == name and x["sync_each_step"] == wait]
            res["summary"][f"{name}{'' if wait else ' (no sync)'}"] = dict(
                step_ms=statistics.median(x["step_ms_median"] for x in rows),
                host_ms=statistics.median(x["host_ms_median"] for x in rows))
    print(json.dumps(res["summary"], indent=1), flush=True)
    if args.no_profile:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return
    res["profile"] = {}
    for name, make in CACHES.items():
        prof = cProfile.Profile()
        decode(model, make(), ids, args.steps, dev, wait=False, prof=prof)
        res["profile"][name] = summ = profile_summary(prof, args.steps, args.top)
        print(f"== {name}: own us per step by package", json.dumps(summ["own_us_per_step_by_package"]), flush=True)
        for row in summ["top_own"][:15]:
            print(f"   {row['own_us_per_step']:8.1f} us  {row['calls_per_step']:6.1f} calls  {row['where']}")
    res["op_host_us"] = op_host_time(bg.MODELS[args.model], dtype, dev, args.prompt, 200)
    print("op host us per call", json.dumps(res["op_host_us"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

"""What a compiled decode step runs on the GPU: kernels per step, by name, with their GPU time (H200).

For transformers' ``StaticCache`` and ``StaticQuantizedPagedCache`` (both compiled by ``generate``: inductor and
CUDA graphs), batch 1, Llama-3-8B shape with random weights (``bench_generate.build_model``): each cache is warmed
up (two generates of the same lengths), then ``generate`` runs under ``torch.profiler`` twice, once with
``--new`` tokens and once with 1 (the prefill and the first token only); the difference of their kernel lists is
``--new - 1`` decode steps. Printed and saved (``--out``): per cache, kernels per step, GPU time per step (the sum of
the kernels' durations) and the table by kernel name (calls per step, us per step), and the wall time per step of a
plain timed ``generate`` (``--timed-new`` tokens, median of ``--repeats``).

    python eval/static_step_probe.py --prompt 1024 --new 17 --out $OUT/static_step_probe.json

``KIVI_CODE=dir``: import ``kivi_cache`` from ``dir`` (e.g. an older commit's ``git archive``, with its
``kivi_cache/kernels`` link) instead of this checkout, for a before/after comparison in separate processes.
"""

import argparse
import collections
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("KIVI_CODE") or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kivi_cache  # noqa: E402, I001  (first: bench_generate puts this checkout first on sys.path)

from transformers import StaticCache  # noqa: E402

from bench_generate import MODELS, build_model, require_kernels  # noqa: E402
from kivi_cache import StaticQuantizedPagedCache, cache_kwargs  # noqa: E402


def make(name, model, total):
    if name == "fp16-static":
        return StaticCache(config=model.config, max_cache_len=total)
    return StaticQuantizedPagedCache(model, total)


def gen(model, ids, cache, new):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)


def kernels(model, ids, name, total, new):
    """{kernel name: [count, total us]} of one generate of ``new`` tokens, from the profiler's CUDA events."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    cache = make(name, model, total)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        gen(model, ids, cache, new)
        torch.cuda.synchronize()
    table = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            table[e.name][0] += 1
            table[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=17)
    ap.add_argument("--timed-new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--caches", default="fp16-static,kivi-int4-static")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_kernels("static_step_probe")
    dev = torch.device("cuda")
    model = build_model("llama3-8b", dev, torch.float16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=g).to(dev)
    total = args.prompt + max(args.new, args.timed_new)
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, kivi_cache_from=kivi_cache.__file__,
               transformers=__import__("transformers").__version__, triton=__import__("triton").__version__,
               model=dict(name="llama3-8b", dtype="float16", **MODELS["llama3-8b"]), batch=1, prompt=args.prompt,
               decode_steps=args.new - 1, timed_new=args.timed_new, caches={})
    names = args.caches.split(",")
    for name in names:
        t0 = time.perf_counter()
        for _ in range(2):  # compile, then the retrace a second cache object may cause (bench_generate does the same)
            gen(model, ids, make(name, model, total), args.new)
        warm = time.perf_counter() - t0
        full = kernels(model, ids, name, total, args.new)
        one = kernels(model, ids, name, total, 1)
        steps = args.new - 1
        rows = []
        for k, (n, us) in full.items():
            n1, us1 = one.get(k, (0, 0.0))
            if n - n1 > 0:
                rows.append(dict(kernel=k[:120], per_step=(n - n1) / steps, us_per_step=(us - us1) / steps))
        rows.sort(key=lambda r: -r["us_per_step"])
        res["caches"][name] = dict(warmup_s=warm, kernels_per_step=sum(x["per_step"] for x in rows),
                                   gpu_us_per_step=sum(x["us_per_step"] for x in rows), wall_ms_repeats=[], table=rows)
    for rep in range(args.repeats):  # alternating, the order reversed every other round
        for name in (names if rep % 2 == 0 else names[::-1]):
            torch.cuda.synchronize()
            a = time.perf_counter()
            gen(model, ids, make(name, model, total), 1)
            torch.cuda.synchronize()
            b = time.perf_counter()
            gen(model, ids, make(name, model, total), args.timed_new)
            torch.cuda.synchronize()
            c = time.perf_counter()
            res["caches"][name]["wall_ms_repeats"].append(((c - b) - (b - a)) / (args.timed_new - 1) * 1e3)
    for name in names:
        r = res["caches"][name]
        r["wall_ms_per_step"] = statistics.median(r["wall_ms_repeats"])
        print(f"\n{name}: warm-up {r['warmup_s']:.0f} s; {r['kernels_per_step']:.1f} kernels and "
              f"{r['gpu_us_per_step'] / 1e3:.3f} ms of kernel time per decode step; "
              f"wall {r['wall_ms_per_step']:.2f} ms per step (repeats "
              f"{', '.join(f'{w:.2f}' for w in r['wall_ms_repeats'])})")
        for x in r["table"][:30]:
            print(f"  {x['per_step']:6.1f} x {x['us_per_step']:9.1f} us  {x['kernel']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

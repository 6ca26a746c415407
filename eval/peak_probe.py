"""Where does a batch-1 generate's peak memory come from? (issue 4's unexplained ~2.8 GiB at 32k, session 3)

Runs ``bench_generate.run_generate`` (the benchmark's own model, caches and ``generate`` call: prompt
``--prompt`` tokens + ``--new``, batch 1) with caches in the order given by ``--order`` in ONE process, as
``bench_generate.py`` does, and prints per run: memory allocated before, the peak it reports, the peak
minus what was allocated before, and the multi-token SDPA calls of the prefill (query shape, mask
shape/dtype or None, is_causal): a materialized ``[1, 1, T, T]`` mask at 32k is 1-2 GiB. Repeating a cache
after compiled ones shows whether state left behind (CUDA-graph pools, a cache's binding to the model)
raises later peaks. Usage (GPU):
    python eval/peak_probe.py --order fp16,kivi-int4,fp16-static,kivi-int4-static,fp16,kivi-int4
    python eval/peak_probe.py --no-expandable ...   (without PYTORCH_CUDA_ALLOC_CONF=expandable_segments)
CPU smoke run: ``python eval/peak_probe.py --device cpu --model tiny --prompt 300 --order fp16,kivi-int4``.
A max-batch configuration: ``--order fp16:441,kivi-int4:967 --prompt 1024 --new 64 --chunked --snapshot`` (an entry
``CACHE:BATCH``; ``--chunked``: the max-batch rows' chunked prefill) says what besides the KV is live at each peak.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_generate as bg  # noqa: E402  (sets expandable_segments unless --no-expandable is in argv)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--order", default="fp16,kivi-int4,fp16-static,kivi-int4-static,fp16,kivi-int4",
                help=f"comma list of CACHE[:BATCH] (batch 1 by default), CACHE one of {list(bg.ALL_CACHES)}")
ap.add_argument("--chunked", action="store_true", help="chunked prefill as the max-batch rows (--prefill-tokens)")
ap.add_argument("--prefill-tokens", type=int, default=None, help="with --chunked: tokens per prefill forward "
                "(bench_generate's default if not given)")
ap.add_argument("--model", default="llama3-8b", choices=sorted(bg.MODELS))
ap.add_argument("--prompt", type=int, default=32768)
ap.add_argument("--new", type=int, default=4)
ap.add_argument("--device", default="cuda")
ap.add_argument("--no-expandable", action="store_true")
ap.add_argument("--snapshot", action="store_true",
                help="record the CUDA allocator's history per run and print what is live at its peak, by source line")
ap.add_argument("--top", type=int, default=12, help="with --snapshot: source lines listed per run")
ap.add_argument("--max-entries", type=int, default=4_000_000,
                help="with --snapshot: allocator events kept (a longer run keeps only its tail: `truncated`)")
ap.add_argument("--out", default=None)
args = ap.parse_args()
bg.require_kernels("peak_probe")
order = []
for entry in args.order.split(","):
    name, _, batch = entry.partition(":")
    if name not in bg.ALL_CACHES:
        raise SystemExit(f"--order: unknown cache {name!r}; allowed: {', '.join(bg.ALL_CACHES)}")
    if batch and (not batch.isdigit() or int(batch) < 1):
        raise SystemExit(f"--order: {entry!r}: BATCH must be a positive integer")
    order.append((name, int(batch or 1)))

calls = []
_sdpa = F.scaled_dot_product_attention
OURS = ("kivi_cache", "transformers", "bench_generate", "peak_probe", "kernels")


def where(frames) -> str:
    """The innermost Python frame of an allocation that is not torch's own (file tail:line function)."""
    for f in frames or []:
        name = f.get("filename", "")
        if any(k in name for k in OURS):
            return f"{'/'.join(name.split('/')[-2:])}:{f.get('line')} {f.get('name')}"
    return "other: " + ("; ".join(f"{f.get('filename', '').split('/')[-1]}:{f.get('line')}" for f in (frames or [])[:3])
                        or "no frames")


def live_at_peak(snapshot: dict, top: int, max_entries: int) -> dict:
    """Replay the allocator trace (allocations made while recording): the peak of bytes allocated by them, and
    what was live at that moment grouped by source line (largest first). A trace of ``max_entries`` events is the
    tail of a longer history (``truncated``): blocks allocated before it (a preallocated pool, say) are not in it."""
    trace = snapshot["device_traces"][0] if snapshot.get("device_traces") else []
    cur = peak = 0
    peak_i = -1
    sizes = {}
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            sizes[ev["addr"]] = ev["size"]
            cur += ev["size"]
            if cur > peak:
                peak, peak_i = cur, i
        elif ev["action"] == "free_completed" and ev["addr"] in sizes:
            cur -= sizes.pop(ev["addr"])
    live = {}
    for ev in trace[:peak_i + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    groups: dict = {}
    for ev in live.values():
        g = groups.setdefault(where(ev.get("frames")), [0, 0])
        g[0] += ev["size"]
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(events=len(trace), truncated=len(trace) >= max_entries, peak_GiB=peak / 2**30,
                live_at_peak=[dict(where=k, GiB=v[0] / 2**30, blocks=v[1]) for k, v in rows])


def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
    if q.shape[-2] > 1:
        calls.append(dict(q=list(q.shape), k=list(k.shape), is_causal=bool(is_causal),
                          mask=None if attn_mask is None else [list(attn_mask.shape), str(attn_mask.dtype)]))
    return _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)


F.scaled_dot_product_attention = spy

dev = bg.Dev(torch.device(args.device))
model = bg.build_model(args.model, dev.device, torch.float16 if dev.cuda else torch.float32)
bench_args = bg.parse_args((["--no-expandable"] if args.no_expandable else [])
                           + ([] if args.prefill_tokens is None else ["--prefill-tokens", str(args.prefill_tokens)]))
quanto = bg.setup_quanto(False) if any(n.startswith("quanto") for n, _ in order) else {"available": False}
ctx = dict(model=model, dev=dev, args=bench_args, shapes=bg.model_shapes(model), quanto=quanto)

rows = []
for name, batch in order:
    calls.clear()
    dev.free()
    before = dev.allocated()
    if args.snapshot and dev.cuda:
        torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python")
    res = bg.run_generate(ctx, name, batch, args.prompt, args.new, chunked=args.chunked, keep_cache=True)
    row = dict(cache=name, batch=batch, prompt=args.prompt, new=args.new, prefill_chunk=res.get("prefill_chunk"),
               prefill_sdpa_calls=len(calls), first_prefill_call=calls[0] if calls else None,
               kv_allocated_GiB=res["cache_stats"]["kv_bytes_allocated"] / 2**30)
    if dev.cuda:
        row.update(before_GiB=before / 2**30, peak_GiB=res["peak"] / 2**30,
                   reserved_GiB=torch.cuda.memory_reserved() / 2**30)
        row["peak_above_before_GiB"] = row["peak_GiB"] - row["before_GiB"]
        if args.snapshot:
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            row["snapshot"] = live_at_peak(snap, args.top, args.max_entries)
            del snap
    rows.append(row)
    print(json.dumps(row), flush=True)
if args.out:
    json.dump(dict(args=vars(args), torch=torch.__version__, rows=rows,
                   gpu=torch.cuda.get_device_name() if dev.cuda else "cpu"), open(args.out, "w"), indent=1)

"""Sliding-window attention on the GPU: the decode kernel with a window, and ``generate`` on a Mistral-7B shape.

Before session 22 a sliding-window layer (Mistral, Gemma 2/3, Qwen2, Phi3, Starcoder2, Cohere2) was read from the
pages only while the sequence was shorter than its window; past it, every step dequantized the layer's whole history
and ran SDPA with transformers' window mask (the "fallback"), and the pages of every token stayed allocated. Now the
hook passes the window to the kernels, which read only the pages it covers, and the layer releases the pages no query
can see again (a long prompt's hidden part is never written).

Part 1, kernels (one layer, one decode step; eager launches timed with ``triton.testing.do_bench`` and CUDA-graph
replays with ``do_bench_cudagraph`` (GPU time without the host's launch work), medians of 3 interleaved rounds): batch
{1, 8}, 32 query / 8 KV heads, head_dim 128, ``--context`` stored tokens (128 in the fp16 residual window), window
``--window``:
  - ``kivi-int4-window``: ``paged_decode_attention(..., sliding_window=W)`` over the full pool (only the window's
    pages are read),
  - ``kivi-int4-full``: the same without the window (a full-attention layer at this context),
  - ``fallback``: what a step cost before: ``dequantize_pages`` of the whole history + SDPA with a window mask,
  - ``fp16-window``: SDPA over W fp16 tokens (transformers' ``DynamicSlidingWindowLayer`` keeps W - 1 + the new one).
  Each row checks the windowed kernel against the torch reference on its first sequence.
Part 2, ``generate`` (random-weight Mistral-7B shape: 32 layers, 32/8 heads, head_dim 128, window ``--window``, fp16;
batch 1, ``--prompts`` tokens, ``--new`` new tokens): ``DynamicCache(config=model.config)`` (sliding layers: fp16,
W - 1 tokens), ``Int4PagedCache()`` served with the window, and ``Int4PagedCache()`` with the hook's pattern check
forced to the fallback (the behaviour before). Per cache and prompt (``--prompts``): time per decode step (median of
the per-step times, median over 3 rounds alternating between the caches), peak memory above the weights
(``torch.cuda.max_memory_allocated``), the cache's bytes after generation (ours: everything allocated), the layers
served with a window and the pages in use, and the leading generated tokens that agree with DynamicCache's.

    . eval/device_env.sh && python eval/bench_sliding.py --out $OUT/bench_sliding.json    # H200, ~3 minutes
    python eval/bench_sliding.py --quick                                                  # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from unittest import mock

QUICK = "--quick" in sys.argv
if QUICK:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))  # smollm2.py

import transformers  # noqa: E402
import triton  # noqa: E402
from smollm2 import leading_agreement  # noqa: E402  (examples/smollm2.py)
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, MistralConfig, MistralForCausalLM  # noqa: E402,E501

from eval.bench_kernels import graph_bench, make_pool  # noqa: E402
from kivi_cache import Int4PagedCache, cache_kwargs, hook  # noqa: E402
from kivi_cache import reference as REF  # noqa: E402
from kivi_cache.kernels import api as KK  # noqa: E402

MISTRAL_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=32000, head_dim=128)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, vocab_size=256, head_dim=64)


def log(*a):
    print(*a, flush=True)


def bench(fn, device, graph: bool = False) -> float:
    if device.type == "cuda" and graph:
        return graph_bench(fn, rep=60)
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def interleaved(fns: dict, device, graph: bool, rounds: int) -> dict:
    """Median ms of each function over ``rounds`` rounds that alternate between them (the host's and the GPU's
    phases spread over all of them alike)."""
    got = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            got[name].append(bench(fn, device, graph))
    return {name: statistics.median(v) for name, v in got.items()}


# ----------------------------------------------------------------------------- part 1: kernels

def kernel_rows(args, device) -> list[dict]:
    rows = []
    for b in args.batches:
        rows.append(kernel_row(args, b, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def kernel_row(args, b: int, device) -> dict:
    hq, hkv, d, g, p, res, w = 32, 8, 128, 32, 64, 128, args.window
    if args.quick:
        hq, hkv, d, res = 4, 2, 64, 16
    sm = 1 / math.sqrt(d)
    gen = torch.Generator(device=device).manual_seed(0)
    t_quant = (args.context - res) // g * g
    pool = make_pool(b, hkv, t_quant, d, p, g, 4, 4, device, gen)
    rk = torch.randn(b, hkv, res + g, d, device=device, dtype=torch.float16, generator=gen)
    rv = torch.randn_like(rk)
    rl = torch.full((b,), res, dtype=torch.int32, device=device)
    q = torch.randn(b, hq, d, device=device, dtype=torch.float16, generator=gen)
    tensors = (pool["k_codes"], pool["k_scale"], pool["k_zero"], pool["v_codes"], pool["v_scale"], pool["v_zero"])
    pa = (q, pool["block_table"], pool["lengths"], *tensors, rk, rv, rl, 4, 4, g, sm)
    # the windowed kernel against the reference on the first sequence
    one = (q[:1], pool["block_table"][:1], pool["lengths"][:1], *tensors, rk[:1], rv[:1], rl[:1], 4, 4, g, sm)
    out = KK.paged_decode_attention(*one, sliding_window=w).float()
    ref = REF.paged_decode_attention(*one, sliding_window=w).float()
    err = ((out - ref).norm() / ref.norm()).item()
    fp_k = torch.randn(b, hkv, w, d, device=device, dtype=torch.float16, generator=gen)
    fp_v = torch.randn_like(fp_k)
    q4 = q[:, :, None]
    total = t_quant + res
    # the fallback's window mask (the newest token's query)
    visible = (torch.arange(total, device=device) >= total - w)[None, None, None]

    def fallback():
        hk, hv = KK.dequantize_pages(pool["block_table"], pool["lengths"], *tensors, 4, 4, g, max_len=t_quant)
        k = torch.cat([hk.to(torch.float16), rk[:, :, :res]], 2)
        v = torch.cat([hv.to(torch.float16), rv[:, :, :res]], 2)
        return F.scaled_dot_product_attention(q4, k, v, attn_mask=visible, scale=sm, enable_gqa=True)

    def fns(merge: bool) -> dict:  # merge=False where captured: no arrival counts kept between calls
        return {
            "kivi-int4-window": lambda: KK.paged_decode_attention(*pa, sliding_window=w, merge=merge),
            "kivi-int4-full": lambda: KK.paged_decode_attention(*pa, merge=merge),
            "fallback": fallback,
            "fp16-window": lambda: F.scaled_dot_product_attention(q4, fp_k, fp_v, scale=sm, enable_gqa=True),
        }

    rounds = 1 if args.quick else 3
    eager = interleaved(fns(True), device, False, rounds)
    graph = interleaved(fns(False), device, True, rounds) if device.type == "cuda" else {}
    main = graph or eager
    row = dict(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, context=total, window=w, rel_err_window=err,
               eager_ms=eager, graph_ms=graph, speedup_over_fallback=main["fallback"] / main["kivi-int4-window"],
               vs_fp16_window=main["fp16-window"] / main["kivi-int4-window"],
               vs_full=main["kivi-int4-full"] / main["kivi-int4-window"])
    for label, times in (("eager", eager), ("graph", graph)):
        if times:
            log(f"b={b} ctx={total} window={w} {label}: "
                + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in times.items()))
    log(f"  window vs fallback {row['speedup_over_fallback']:.1f}x, vs full {row['vs_full']:.2f}x, vs fp16 window "
        f"{row['vs_fp16_window']:.2f}x ({'graphs' if graph else 'eager'}), err {err:.1e}")
    return row


# ----------------------------------------------------------------------------- part 2: generate

def build_model(args, device):
    spec = TINY if args.quick else MISTRAL_7B
    cfg = MistralConfig(**spec, sliding_window=args.window, max_position_embeddings=131072,
                        attn_implementation="sdpa", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16 if device.type == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = MistralForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False)


def cache_bytes(cache) -> int:
    if hasattr(cache, "memory_report"):  # ours: pools (free pages included) and residual windows
        return cache.memory_report().allocated
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


class StepTimer(LogitsProcessor):
    """Records the time of each decode step's logits (after a device sync): the steps' durations are the
    differences (the first call ends the prefill)."""

    def __init__(self, device):
        self.device, self.marks = device, []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.marks.append(time.perf_counter())
        return scores


def compare_generate(model, device, caches: dict, prompts, new: int, quick: bool, ref: str, agree_key: str,
                     weights: int = 0, batch: int = 1, **generate_kwargs) -> list[dict]:
    """Greedy ``generate`` (``batch`` sequences, ``generate_kwargs`` passed on) for each prompt length in
    ``prompts`` and each cache of ``caches`` (name -> a function that sets the model up and returns ``(cache, context
    manager the run goes in)``): a warm-up run each, then 3 rounds alternating between the caches (1 when ``quick``).
    One row per prompt and cache: median time per decode step (the per-step times' median in each round), median
    prefill, peak memory above ``weights``, the cache's bytes, the leading tokens of the first sequence agreeing with
    the ``ref`` cache's (``agree_key``), and for our caches the layers served with a window and the pages in use. A
    run out of GPU memory is recorded as such (``error``)."""

    def run(name, ids, n):
        cache, context = caches[name]()
        timer = StepTimer(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            with context, torch.no_grad():
                t0 = time.perf_counter()
                out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, logits_processor=LogitsProcessorList([timer]),
                                     **generate_kwargs)
        except torch.OutOfMemoryError as exc:
            del cache
            torch.cuda.empty_cache()
            return dict(error=f"OutOfMemoryError: {str(exc)[:160]}")
        peak = torch.cuda.max_memory_allocated(device) - weights if device.type == "cuda" else 0
        steps = [b - a for a, b in zip(timer.marks, timer.marks[1:], strict=False)]
        got = dict(prefill=timer.marks[0] - t0, step=statistics.median(steps), tokens=out[0, ids.shape[1]:].tolist(),
                   peak=peak, cache_bytes=cache_bytes(cache))
        if hasattr(cache, "memory_report"):  # ours
            got["sliding_layers"] = sum(layer.sliding_window is not None for layer in cache.layers)
            got["pages_in_use"] = sum(layer.pool.pages_in_use for layer in cache.layers)
        return got

    rows = []
    for prompt in prompts:
        ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)
        if not quick:
            for name in caches:  # warm-up: kernels compiled, allocator primed
                run(name, ids, 3)
                torch.cuda.empty_cache()
        got = {name: [] for name in caches}
        for _ in range(1 if quick else 3):  # rounds alternating between the caches
            for name in caches:
                got[name].append(run(name, ids, new))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        ok_ref = [r for r in got[ref] if "error" not in r]
        ref_tokens = ok_ref[0]["tokens"] if ok_ref else None
        for name, runs in got.items():
            ok = [r for r in runs if "error" not in r]
            if not ok:
                row = dict(cache=name, batch=batch, prompt=prompt, new=new, error=runs[0]["error"])
                log(f"prompt {prompt} {name:20s} {row['error']}")
                rows.append(row)
                continue
            last = ok[-1]
            row = dict(cache=name, batch=batch, prompt=prompt, new=new, runs=len(ok), errors=len(runs) - len(ok),
                       step_ms=statistics.median(r["step"] for r in ok) * 1e3,
                       step_ms_rounds=[r["step"] * 1e3 for r in ok],
                       prefill_s=statistics.median(r["prefill"] for r in ok),
                       peak_above_weights_bytes=max(r["peak"] for r in ok), cache_bytes=last["cache_bytes"],
                       **{agree_key: leading_agreement(last["tokens"], ref_tokens) if ref_tokens is not None else None},
                       **{k: last[k] for k in ("sliding_layers", "pages_in_use") if k in last})
            log(f"prompt {prompt} {name:20s} step {row['step_ms']:.2f} ms (rounds "
                f"{', '.join(f'{x:.2f}' for x in row['step_ms_rounds'])}), prefill {row['prefill_s']:.2f} s, peak "
                f"above weights {row['peak_above_weights_bytes'] / 2**30:.2f} GiB, cache "
                f"{row['cache_bytes'] / 2**20:.1f} MiB, agree {row[agree_key]}/{new}"
                + (f", {row['sliding_layers']} sliding layers, {row['pages_in_use']} pages" if "pages_in_use" in row
                   else ""))
            rows.append(row)
    return rows


def generate_rows(args, device) -> list[dict]:
    model = build_model(args, device)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    fallback = lambda: mock.patch.object(hook, "_pattern", lambda module, kwargs: (False, None))  # noqa: E731
    caches = {
        "fp16-DynamicCache": lambda: (DynamicCache(config=model.config), contextlib.nullcontext()),
        "kivi-int4": lambda: (Int4PagedCache(), contextlib.nullcontext()),
        "kivi-int4-fallback": lambda: (Int4PagedCache(), fallback()),  # the hook's pattern check forced off
    }
    return compare_generate(model, device, caches, args.prompts, args.new, args.quick, "fp16-DynamicCache",
                            "agree_with_fp16", weights)


def run_parts(args, name: str, parts: dict, settings: dict) -> dict:
    """Run the parts named in ``args.parts`` (name -> ``fn(args, device)`` returning rows) on the GPU if there is one,
    and write ``{"meta": ..., part: rows}`` to ``args.out`` (default ``eval/results/<name>[_quick].json``); meta
    holds the machine, versions, ``settings`` and the shapes in ``args``."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = dict(gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                python=platform.python_version(), **settings, context=args.context, prompts=args.prompts,
                new=args.new, timing="kernels: do_bench (eager) and do_bench_cudagraph medians of 3 interleaved "
                "rounds; generate: median per-step time (a logits processor after a device sync), median of 3 "
                "interleaved rounds")
    log(json.dumps(meta))
    result = dict(meta=meta)
    for part in args.parts.split(","):
        result[part] = parts[part](args, device)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"{name}_quick.json" if args.quick else f"{name}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {out}")
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--context", type=int, default=32768, help="kernel part: stored tokens per sequence")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts", default="16384,32768", help="generate part: prompt tokens")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--parts", default="kernels,generate")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.window, args.context, args.prompts, args.new, args.batches = 40, 200, "120", 6, "1,2"
    args.batches = [int(x) for x in args.batches.split(",")]
    args.prompts = [int(x) for x in args.prompts.split(",")]
    return run_parts(args, "bench_sliding", dict(kernels=kernel_rows, generate=generate_rows),
                     dict(window=args.window))


if __name__ == "__main__":
    main()

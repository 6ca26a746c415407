"""Sliding-window attention on the GPU: the decode kernel with a window, and ``generate`` on a Mistral-7B shape.

Before session 22 a sliding-window layer (Mistral, Gemma 2/3, Qwen2, Phi3, Starcoder2, Cohere2) was read from the
pages only while the sequence was shorter than its window; past it, every step dequantized the layer's whole history
and ran SDPA with transformers' window mask (the "fallback"), and the pages of every token stayed allocated. Now the
hook passes the window to the kernels, which read only the pages it covers, and the layer releases the pages no query
can see again (a long prompt's hidden part is never written).

Part 1, kernels (one layer, one decode step; eager launches timed with ``triton.testing.do_bench``, median): batch
{1, 8}, 32 query / 8 KV heads, head_dim 128, ``--context`` stored tokens (128 in the fp16 residual window), window
``--window``:
  - ``kivi-int4-window``: ``paged_decode_attention(..., sliding_window=W)`` over the full pool (only the window's
    pages are read),
  - ``kivi-int4-full``: the same without the window (a full-attention layer at this context),
  - ``fallback``: what a step cost before: ``dequantize_pages`` of the whole history + SDPA with a window mask,
  - ``fp16-window``: SDPA over W fp16 tokens (transformers' ``DynamicSlidingWindowLayer`` keeps W - 1 + the new one).
  Each row checks the windowed kernel against the torch reference on its first sequence.
Part 2, ``generate`` (random-weight Mistral-7B shape: 32 layers, 32/8 heads, head_dim 128, window ``--window``, fp16;
batch 1, ``--prompt`` tokens, ``--new`` new tokens): ``DynamicCache(config=model.config)`` (sliding layers: fp16,
W - 1 tokens), ``Int4PagedCache()`` served with the window, and ``Int4PagedCache()`` with the hook's pattern check
forced to the fallback (the behaviour before). Per cache: time per decode step ((t_N - t_1) / (N - 1), two runs),
peak memory above the weights (``torch.cuda.max_memory_allocated``), the cache's bytes after generation, and the
leading generated tokens that agree with DynamicCache's.

    . eval/device_env.sh && python eval/bench_sliding.py --out $OUT/bench_sliding.json    # H200, ~3 minutes
    python eval/bench_sliding.py --quick                                                  # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from unittest import mock

QUICK = "--quick" in sys.argv
if QUICK:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402
import triton  # noqa: E402
from transformers import DynamicCache, MistralConfig, MistralForCausalLM  # noqa: E402

from eval.bench_kernels import make_pool  # noqa: E402
from kivi_cache import Int4PagedCache, cache_kwargs, hook  # noqa: E402
from kivi_cache import kernels as KK  # noqa: E402
from kivi_cache import reference as REF  # noqa: E402
from kivi_cache.models import leading_agreement  # noqa: E402

MISTRAL_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=32000, head_dim=128)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, vocab_size=256, head_dim=64)


def log(*a):
    print(*a, flush=True)


def bench(fn, device) -> float:
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


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
        hk, hv = KK.dequantize_pages(pool["block_table"], pool["lengths"], *tensors, 4, 4, g)
        k = torch.cat([hk.to(torch.float16), rk[:, :, :res]], 2)
        v = torch.cat([hv.to(torch.float16), rv[:, :, :res]], 2)
        return F.scaled_dot_product_attention(q4, k, v, attn_mask=visible, scale=sm, enable_gqa=True)

    times = {
        "kivi-int4-window": bench(lambda: KK.paged_decode_attention(*pa, sliding_window=w), device),
        "kivi-int4-full": bench(lambda: KK.paged_decode_attention(*pa), device),
        "fallback": bench(fallback, device),
        "fp16-window": bench(lambda: F.scaled_dot_product_attention(q4, fp_k, fp_v, scale=sm, enable_gqa=True),
                             device),
    }
    row = dict(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, context=total, window=w, rel_err_window=err,
               ms=times, speedup_over_fallback=times["fallback"] / times["kivi-int4-window"],
               vs_fp16_window=times["fp16-window"] / times["kivi-int4-window"])
    log(f"b={b} ctx={total} window={w}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in times.items())
        + f"; window vs fallback {row['speedup_over_fallback']:.1f}x, vs fp16 window "
          f"{row['vs_fp16_window']:.2f}x, err {err:.1e}")
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
    if isinstance(cache, DynamicCache):
        return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return cache.memory_report().allocated  # pools (free pages included) and residual windows


def generate_rows(args, device) -> list[dict]:
    model = build_model(args, device)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    caches = {
        "fp16-DynamicCache": lambda: DynamicCache(config=model.config),
        "kivi-int4": Int4PagedCache,
        "kivi-int4-fallback": Int4PagedCache,
    }

    def run(name, new):
        cache = caches[name]()
        patch = (mock.patch.object(hook, "_pattern", lambda module, kwargs: (False, None))
                 if name.endswith("fallback") else mock.patch.dict(os.environ, {}))
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        with patch, torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) - weights if device.type == "cuda" else 0
        return dt, out[0, ids.shape[1]:].tolist(), peak, cache

    with torch.no_grad():  # warm-up: kernels compiled, allocator primed
        for name in caches:
            run(name, 3) if not args.quick else None
    rows, ref_tokens = [], None
    for name in caches:
        t1 = min(run(name, 1)[0] for _ in range(2))
        tn, tokens, peak, cache = min((run(name, args.new) for _ in range(2)), key=lambda x: x[0])
        step = (tn - t1) / (args.new - 1)
        if ref_tokens is None:
            ref_tokens = tokens
        row = dict(cache=name, prompt=args.prompt, new=args.new, step_ms=step * 1e3, prefill_s=t1,
                   peak_above_weights_bytes=peak, cache_bytes=cache_bytes(cache),
                   agree_with_fp16=leading_agreement(tokens, ref_tokens))
        if name.startswith("kivi"):
            row["sliding_layers"] = sum(layer.sliding_window is not None for layer in cache.layers)
            row["pages_in_use"] = sum(layer.pool.pages_in_use for layer in cache.layers)
        log(f"{name:20s} step {row['step_ms']:.2f} ms, prefill {t1:.2f} s, peak above weights "
            f"{peak / 2**30:.2f} GiB, cache {row['cache_bytes'] / 2**20:.1f} MiB, agree {row['agree_with_fp16']}/"
            f"{args.new}" + (f", {row['sliding_layers']} sliding layers, {row['pages_in_use']} pages"
                             if "pages_in_use" in row else ""))
        rows.append(row)
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--context", type=int, default=32768, help="kernel part: stored tokens per sequence")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=16384, help="generate part: prompt tokens")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--parts", default="kernels,generate")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.window, args.context, args.prompt, args.new, args.batches = 40, 200, 120, 6, "1,2"
    args.batches = [int(x) for x in args.batches.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = dict(gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                python=platform.python_version(), window=args.window, context=args.context, prompt=args.prompt,
                new=args.new, timing="eager, triton.testing.do_bench median (kernels); wall clock (generate)")
    log(json.dumps(meta))
    result = dict(meta=meta)
    parts = args.parts.split(",")
    if "kernels" in parts:
        result["kernels"] = kernel_rows(args, device)
    if "generate" in parts:
        result["generate"] = generate_rows(args, device)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   "bench_sliding_quick.json" if args.quick else "bench_sliding.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()

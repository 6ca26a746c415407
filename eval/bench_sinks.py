"""Learned attention sinks (GPT-OSS) on the GPU: the decode kernel with sink logits, and ``generate`` on a
GPT-OSS-20B shape.

GPT-OSS adds one learned logit per query head to every softmax (``s_aux``, weighing no value). Before session 23 our
cache could serve it only through the model's default eager attention, which reads the dequantized history (the
"fallback": every step dequantizes every layer's whole history, and every token's pages stay allocated); with
``attn_implementation="kivi"`` it was refused (sdpa would have dropped the sinks). Now the kernels add the sinks where
they merge their partial results, and the prompt runs sdpa with the sink as one more key (``hook.sdpa_with_sinks``).

Part 1, kernels (one layer, one decode step; CUDA-graph replays, medians of 3 interleaved rounds; eager launches in
the JSON): GPT-OSS's attention shape (64 query / 8 KV heads, head_dim 64), batch {1, 8}, ``--context`` stored tokens
(128 in the fp16 residual window), full attention and its 128-token sliding window:
  - ``kivi-int4`` / ``kivi-int4-sinks``: ``paged_decode_attention`` without / with ``sink_logits`` (the sinks cost
    only the merge: the two should tie),
  - ``eager-fp16``: GPT-OSS's own ``eager_attention_forward`` over fp16 keys and values of the same length (what
    its default attention does with ``DynamicCache``; repeat_kv, matmul, softmax with the sink column, matmul),
  - ``sdpa-sinks-fp16``: ``hook.sdpa_with_sinks`` over the same (our sink-aware sdpa, used for the prompt and for
    other caches).
  Each row checks the kernel with sinks against the torch reference on its first sequence.
Part 2, ``generate`` (random-weight GPT-OSS-20B shape: 24 layers alternating sliding-128 and full attention, 64/8
heads, head_dim 64, 32 experts top-4, bf16; batch 1, ``--prompts`` tokens, ``--new`` new tokens):
  - ``eager-DynamicCache``: the model's default attention (eager) with ``DynamicCache(config=...)`` (its sliding
    layers keep 127 tokens),
  - ``eager-int4-fallback``: eager attention with ``Int4PagedCache()`` (the history dequantized every step: what our
    cache gave GPT-OSS before),
  - ``kivi-int4``: ``attn_implementation="kivi"`` with ``Int4PagedCache()`` (served: sinks in the kernels).
  Per cache and prompt: time per decode step (median of the per-step times, median over 3 rounds alternating
  between the caches), prefill time, peak memory above the weights, the cache's bytes, leading tokens agreeing
  with eager-DynamicCache's; an out-of-memory run is recorded as such.

Part 3, ``--parts static`` (not in the default parts): the static caches at ``--static-batch`` sequences and
``--static-max-len`` (see :func:`static_rows`): memory of StaticQuantizedPagedCache with and without the sliding
layers' ring of pages, against transformers' StaticCache.

    . eval/device_env.sh && python eval/bench_sinks.py --out $OUT/bench_sinks.json    # H200, ~4 minutes
    python eval/bench_sinks.py --quick                                                # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from unittest import mock

QUICK = "--quick" in sys.argv
if QUICK:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from transformers import DynamicCache, GptOssConfig, GptOssForCausalLM, StaticCache  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss as G  # noqa: E402

from eval.bench_kernels import make_pool  # noqa: E402
from eval.bench_sliding import compare_generate, interleaved, log, run_parts  # noqa: E402
from kivi_cache import Int4PagedCache, StaticQuantizedPagedCache, hook  # noqa: E402
from kivi_cache import reference as REF  # noqa: E402
from kivi_cache.cache import INT4_PRESET  # noqa: E402
from kivi_cache.kernels import api as KK  # noqa: E402
from kivi_cache.static import StaticQuantizedPagedLayer  # noqa: E402

GPT_OSS_20B = dict(hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                   vocab_size=201088, sliding_window=128)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, vocab_size=256, sliding_window=40)


# ----------------------------------------------------------------------------- part 1: kernels

def kernel_row(args, b: int, window, device) -> dict:
    hq, hkv, d, g, p, res = 64, 8, 64, 32, 64, 128
    if args.quick:
        hq, hkv, res = 8, 2, 16
    sm = 1 / math.sqrt(d)
    dt = torch.float16
    gen = torch.Generator(device=device).manual_seed(0)
    t_quant = (args.context - res) // g * g
    pool = make_pool(b, hkv, t_quant, d, p, g, 4, 4, device, gen)
    rk = torch.randn(b, hkv, res + g, d, device=device, dtype=dt, generator=gen)
    rv = torch.randn_like(rk)
    rl = torch.full((b,), res, dtype=torch.int32, device=device)
    q = torch.randn(b, hq, d, device=device, dtype=dt, generator=gen)
    sinks = (torch.randn(hq, device=device, generator=gen) * 2).to(dt)
    tensors = (pool["k_codes"], pool["k_scale"], pool["k_zero"], pool["v_codes"], pool["v_scale"], pool["v_zero"])
    pa = (q, pool["block_table"], pool["lengths"], *tensors, rk, rv, rl, 4, 4, g, sm)
    one = (q[:1], pool["block_table"][:1], pool["lengths"][:1], *tensors, rk[:1], rv[:1], rl[:1], 4, 4, g, sm)
    out = KK.paged_decode_attention(*one, sliding_window=window, sink_logits=sinks).float()
    ref = REF.paged_decode_attention(*one, sliding_window=window, sink_logits=sinks).float()
    err = ((out - ref).norm() / ref.norm()).item()
    total = t_quant + res
    fp_len = total if window is None else window  # DynamicCache's sliding layers keep the window
    fp_k = torch.randn(b, hkv, fp_len, d, device=device, dtype=dt, generator=gen)
    fp_v = torch.randn_like(fp_k)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training, module.sinks = hq // hkv, False, sinks
    q4 = q[:, :, None]

    def fns(merge: bool) -> dict:  # merge=False where captured: no arrival counts kept between calls
        return {
            "kivi-int4": lambda: KK.paged_decode_attention(*pa, sliding_window=window, merge=merge),
            "kivi-int4-sinks": lambda: KK.paged_decode_attention(*pa, sliding_window=window, sink_logits=sinks,
                                                                 merge=merge),
            "eager-fp16": lambda: G.eager_attention_forward(module, q4, fp_k, fp_v, None, scaling=sm),
            "sdpa-sinks-fp16": lambda: hook.sdpa_with_sinks(module, q4, fp_k, fp_v, None, scaling=sm, s_aux=sinks),
        }

    rounds = 1 if args.quick else 3
    eager = interleaved(fns(True), device, False, rounds)
    graph = interleaved(fns(False), device, True, rounds) if device.type == "cuda" else {}
    main = graph or eager
    row = dict(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, context=total, window=window, rel_err_sinks=err,
               eager_ms=eager, graph_ms=graph, sinks_cost=main["kivi-int4-sinks"] / main["kivi-int4"],
               vs_eager_fp16=main["eager-fp16"] / main["kivi-int4-sinks"],
               vs_sdpa_sinks_fp16=main["sdpa-sinks-fp16"] / main["kivi-int4-sinks"])
    for label, times in (("eager", eager), ("graph", graph)):
        if times:
            log(f"b={b} ctx={total} window={window} {label}: "
                + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in times.items()))
    log(f"  sinks cost {row['sinks_cost']:.3f}x, vs eager fp16 {row['vs_eager_fp16']:.2f}x, vs sdpa+sinks fp16 "
        f"{row['vs_sdpa_sinks_fp16']:.2f}x ({'graphs' if graph else 'eager'}), err {err:.1e}")
    return row


def kernel_rows(args, device) -> list[dict]:
    rows = []
    for window in (None, 128 if not args.quick else 40):
        for b in args.batches:
            rows.append(kernel_row(args, b, window, device))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- part 2: generate

def build_model(args, device):
    spec = TINY if args.quick else GPT_OSS_20B
    n = spec["num_hidden_layers"]
    cfg = GptOssConfig(**spec, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
                       max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = GptOssForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    for module in model.modules():  # random sinks of the trained model's order (its init's 0.02 hardly matters)
        if hasattr(module, "sinks"):
            torch.nn.init.normal_(module.sinks, std=2.0)
    return model.eval().requires_grad_(False)


def generate_rows(args, device) -> list[dict]:
    model = build_model(args, device)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    log(f"model built: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
        f"{weights / 2**30:.1f} GiB")

    def setup(impl, make):  # the attention implementation, then a fresh cache
        def go():
            model.set_attn_implementation(impl)
            return make(), contextlib.nullcontext()
        return go

    caches = {
        "eager-DynamicCache": setup("eager", lambda: DynamicCache(config=model.config)),
        "eager-int4-fallback": setup("eager", Int4PagedCache),
        "kivi-int4": setup("kivi", Int4PagedCache),
    }
    return compare_generate(model, device, caches, args.prompts, args.new, args.quick, "eager-DynamicCache",
                            "agree_with_eager_dynamic", weights)


def static_rows(args, device) -> list[dict]:
    """Part 3: the static (compileable) caches on the GPT-OSS-20B shape at ``--static-batch`` sequences, under
    ``attn_implementation="kivi"`` (sinks served; transformers' StaticCache then runs sdpa with the sink key), the
    step not compiled (``disable_compile``: what changes is memory, and compiling a 20B MoE three times would not fit
    one device call): ``StaticQuantizedPagedCache`` int4 (its sliding layers reuse a ring of pages), the same with
    the ring turned off (every sequence owning the pages of max_cache_len in every layer: the cache before session
    24), and transformers' ``StaticCache`` (bf16; its sliding layers hold the window only)."""
    model = build_model(args, device)
    model.set_attn_implementation("kivi")
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    rows = []
    for prompt in args.prompts:
        max_len = max(args.static_max_len, prompt + args.new + 8)

        def ours(ring: bool, max_len=max_len):
            def go():
                cache = StaticQuantizedPagedCache(model, max_len, **INT4_PRESET)
                patch = (contextlib.nullcontext() if ring else
                         mock.patch.object(StaticQuantizedPagedLayer, "_ring_pages", lambda self, maxp: None))
                return cache, patch
            return go

        caches = {
            "hf-StaticCache-bf16": lambda: (StaticCache(config=model.config, max_cache_len=max_len),  # noqa: B023
                                            contextlib.nullcontext()),
            "kivi-static-int4": ours(True),
            "kivi-static-int4-no-ring": ours(False),
        }
        if args.static_compile:  # generate compiles the step (inductor, CUDA graphs): the ring changes no code
            caches = {f"{name}-compiled": caches[name] for name in ("hf-StaticCache-bf16", "kivi-static-int4")}
        ref = next(iter(caches))
        rows += compare_generate(model, device, caches, [prompt], args.new, args.quick, ref, "agree_with_hf_static",
                                 weights, batch=args.static_batch, disable_compile=not args.static_compile)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    ap.add_argument("--context", type=int, default=32768, help="kernel part: stored tokens per sequence")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts", default="4096,16384", help="generate part: prompt tokens")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--parts", default="kernels,generate", help="of kernels, generate, static")
    ap.add_argument("--static-batch", type=int, default=4, help="static part: sequences")
    ap.add_argument("--static-compile", action="store_true", help="static part: compiled steps (two caches)")
    ap.add_argument("--static-max-len", type=int, default=32768,
                    help="static part: max_cache_len (a server's setting: larger than the prompt + new tokens)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.context, args.prompts, args.new, args.batches, args.static_max_len = 200, "120", 6, "1,2", 400
    args.batches = [int(x) for x in args.batches.split(",")]
    args.prompts = [int(x) for x in args.prompts.split(",")]
    return run_parts(args, "bench_sinks", dict(kernels=kernel_rows, generate=generate_rows, static=static_rows),
                     dict(static_batch=args.static_batch, static_max_len=args.static_max_len,
                          static_compile=args.static_compile))


if __name__ == "__main__":
    main()

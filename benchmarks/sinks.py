"""Learned attention sinks (GPT-OSS): the decode kernel with sink logits, and ``generate`` on a GPT-OSS-20B shape.

GPT-OSS adds one learned logit per query head to every softmax (``s_aux``, weighing no value). With
``attn_implementation="kivi"`` the kernels add the sinks where they merge their partial results, and the prompt runs
SDPA with the sink as one more key (``hook.sdpa_with_sinks``). The model's default eager attention reads a quantized
cache through its dequantized history (every layer's whole history dequantized every step, every token's pages kept).

Part ``kernels`` (one layer, one decode step): GPT-OSS's attention shape (64 query / 8 KV heads, head_dim 64), batch
``--batches``, ``--context`` stored tokens (128 in the fp16 window), full attention and its 128-token sliding
window; timed in turns (``harness.time_alternating``: CUDA-graph replays timed with CUDA events, the order reversed
every other repetition; ``--no-graphs``: eager launches):

* ``int4`` / ``int4_sinks``: ``paged_decode_attention`` without / with ``sink_logits`` (the sinks cost only the
  merge: the two should tie);
* ``eager_fp16``: GPT-OSS's own ``eager_attention_forward`` over fp16 keys and values of the same length (what its
  default attention does with ``DynamicCache``: repeat_kv, matmul, softmax with the sink column, matmul);
* ``sdpa_sinks_fp16``: ``hook.sdpa_with_sinks`` over the same (the sink-aware SDPA of the prompt and of other
  caches).

Each row first checks the kernel with sinks against the torch reference on its first sequence (``rel_err``).

Part ``generate`` (random-weight GPT-OSS-20B shape: 24 layers alternating sliding-128 and full attention, 64/8 heads,
head_dim 64, 32 experts top-4, bf16; batch 1, ``--prompts`` tokens, ``--new`` new tokens), caches
``eager-DynamicCache`` (the default eager attention with ``DynamicCache(config=...)``, whose sliding layers keep 127
tokens), ``eager-int4-fallback`` (eager attention with ``Int4PagedCache()``: the history dequantized every step) and
``kivi-int4`` (``attn_implementation="kivi"`` with ``Int4PagedCache()``: sinks in the kernels). Rows as in
``benchmarks/sliding.py``'s generate part (StepClock step times, alternating generates), agreement against
``eager-DynamicCache``.

Part ``static`` (not in the default parts): the static (compileable) caches at ``--static-batch`` sequences and
``max_cache_len`` ``--static-max-len`` (:func:`static_rows`): the memory of ``StaticQuantizedPagedCache`` with and
without its sliding layers' ring of pages, against transformers' ``StaticCache``.

Usage::

    python benchmarks/sinks.py [--parts kernels,generate,static] [--context 32768] [--batches 1,8]
                               [--prompts 4096,16384] [--new 32] [--out F.json] [--commit SHA]
    python benchmarks/sinks.py --quick         # tiny CPU smoke run (Triton's interpreter; times are no result)

Output: ``benchmarks/results/sinks_<gpu>_<date>.json`` (``--out`` to change it), written after every row; the tables
are printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from unittest import mock

import harness as H
import torch

if str(H.ROOT) not in sys.path:
    sys.path.insert(0, str(H.ROOT))

import sliding as S  # noqa: E402  (benchmarks/sliding.py: the generate comparison, options, the runner)

GPT_OSS_20B = dict(hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                   vocab_size=201088, sliding_window=128)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, vocab_size=256, sliding_window=40)
PARTS = ("kernels", "generate", "static")
KERNEL_COLS = [("batch", "B", "d"), ("context", "context", "d"), ("window", "window", ""),
               ("ms_int4", "int4 ms", ".4f"), ("ms_int4_sinks", "int4+sinks ms", ".4f"),
               ("ms_eager_fp16", "eager fp16 ms", ".4f"), ("ms_sdpa_sinks_fp16", "sdpa+sinks fp16 ms", ".4f"),
               ("sinks_cost", "sinks cost", ".3f"), ("vs_eager_fp16", "x eager fp16", ".2f"),
               ("vs_sdpa_sinks_fp16", "x sdpa fp16", ".2f"), ("rel_err", "rel err", ".1e")]


def parse_args(argv=None) -> argparse.Namespace:
    ap = S.common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), PARTS)
    ap.add_argument("--prompts", default="4096,16384", help="generate and static parts: prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="generate and static parts: new tokens")
    ap.add_argument("--static-batch", type=int, default=4, help="static part: sequences")
    ap.add_argument("--static-compile", action="store_true", help="static part: compiled steps (two caches)")
    ap.add_argument("--static-max-len", type=int, default=32768,
                    help="static part: max_cache_len (a server's setting: larger than the prompt + new tokens)")
    args = ap.parse_args(argv)
    if args.quick:
        args.context, args.prompts, args.new, args.batches, args.static_max_len = 200, "120", 6, "1,2", 400
    args = S.check_args(ap, args, PARTS)
    if args.static_batch < 1 or args.context <= 128:
        ap.error("--static-batch must be positive and --context above 128")
    return args


# ----------------------------------------------------------------------------- part 1: kernels

def kernel_row(args, kk, dev, b: int, window) -> dict:
    from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss

    from kivi_cache import hook, reference
    from kivi_cache.testing import decode_args, random_pool

    hq, hkv, d, g, p, res = 64, 8, 64, 32, 64, 128
    if args.quick:
        hq, hkv, res = 8, 2, 16
    sm = 1 / math.sqrt(d)
    dt = torch.float16
    gen = torch.Generator(device=dev).manual_seed(0)
    t_quant = (args.context - res) // g * g
    pool = random_pool(b, hkv, t_quant, d, p, g, 4, 4, dev, gen)
    rk = torch.randn(b, hkv, res + g, d, device=dev, dtype=dt, generator=gen)
    rv = torch.randn_like(rk)
    rl = torch.full((b,), res, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, d, device=dev, dtype=dt, generator=gen)
    sinks = (torch.randn(hq, device=dev, generator=gen) * 2).to(dt)
    pa = decode_args(pool, q, rk, rv, rl, 4, 4, g, sm)
    one = decode_args(dict(pool, block_table=pool["block_table"][:1], lengths=pool["lengths"][:1]), q[:1], rk[:1],
                      rv[:1], rl[:1], 4, 4, g, sm)
    err = S.rel_err(kk.paged_decode_attention(*one, sliding_window=window, sink_logits=sinks),
                    reference.paged_decode_attention(*one, sliding_window=window, sink_logits=sinks))
    total = t_quant + res
    fp_len = total if window is None else window  # DynamicCache's sliding layers keep the window
    fp_k = torch.randn(b, hkv, fp_len, d, device=dev, dtype=dt, generator=gen)
    fp_v = torch.randn_like(fp_k)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training, module.sinks = hq // hkv, False, sinks
    q4 = q[:, :, None]
    ms, reps = S.time_kernels(args, dev, {
        "int4": lambda: kk.paged_decode_attention(*pa, sliding_window=window),
        "int4_sinks": lambda: kk.paged_decode_attention(*pa, sliding_window=window, sink_logits=sinks),
        "eager_fp16": lambda: gpt_oss.eager_attention_forward(module, q4, fp_k, fp_v, None, scaling=sm),
        "sdpa_sinks_fp16": lambda: hook.sdpa_with_sinks(module, q4, fp_k, fp_v, None, scaling=sm, s_aux=sinks),
    })
    row = dict(part="kernels", batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, context=total,
               window="full" if window is None else window, rel_err=err, **{f"ms_{k}": v for k, v in ms.items()},
               ms_reps=reps, sinks_cost=ms["int4_sinks"] / ms["int4"],
               vs_eager_fp16=ms["eager_fp16"] / ms["int4_sinks"],
               vs_sdpa_sinks_fp16=ms["sdpa_sinks_fp16"] / ms["int4_sinks"])
    H.log(f"b={b} ctx={total} window={window}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in ms.items())
          + f"; err {err:.1e}")
    return row


def kernel_rows(args, kk, dev, emit) -> None:
    cases = [(b, w) for w in (None, 40 if args.quick else 128) for b in args.batch_list]
    for b, window in H.progress(cases, desc="sinks kernels"):
        emit(kernel_row(args, kk, dev, b, window))
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- part 2: generate

def build_model(args, dev):
    from transformers import GptOssConfig, GptOssForCausalLM

    spec = TINY if args.quick else GPT_OSS_20B
    n = spec["num_hidden_layers"]
    cfg = GptOssConfig(**spec, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
                       max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = S.model_with(GptOssForCausalLM, cfg, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    for module in model.modules():  # random sinks of the trained model's order (its init's 0.02 hardly matters)
        if hasattr(module, "sinks"):
            torch.nn.init.normal_(module.sinks, std=2.0)
    return model


def generate_rows(args, kk, dev, emit) -> None:
    from transformers import DynamicCache

    from kivi_cache import Int4PagedCache

    model = build_model(args, dev)
    weights = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    H.log(f"model built: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
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
    S.compare_generate(model, dev, caches, args.prompt_list, args.new, args, "eager-DynamicCache", emit, weights)


# ----------------------------------------------------------------------------- part 3: static caches

def static_rows(args, kk, dev, emit) -> None:
    """The static (compileable) caches on the GPT-OSS-20B shape at ``--static-batch`` sequences, under
    ``attn_implementation="kivi"`` (sinks served; transformers' StaticCache then runs SDPA with the sink key), the step
    not compiled unless ``--static-compile`` (what changes is memory): ``StaticQuantizedPagedCache`` int4 (its sliding
    layers reuse a ring of pages), the same with the ring turned off (every sequence owning the pages of
    max_cache_len in every layer), and transformers' ``StaticCache`` (bf16; its sliding layers hold the window
    only). With ``--static-compile``: the first and second, compiled (the ring changes no code)."""
    from transformers import StaticCache

    from kivi_cache import StaticQuantizedPagedCache
    from kivi_cache.cache import INT4_PRESET
    from kivi_cache.static import StaticQuantizedPagedLayer

    model = build_model(args, dev)
    model.set_attn_implementation("kivi")
    weights = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    for prompt in args.prompt_list:
        max_len = max(args.static_max_len, prompt + args.new + 8)

        def ours(ring: bool, max_len=max_len):
            def go():
                cache = StaticQuantizedPagedCache(model, max_len, **INT4_PRESET)
                patch = (contextlib.nullcontext() if ring else
                         mock.patch.object(StaticQuantizedPagedLayer, "_ring_pages", lambda self, maxp: None))
                return cache, patch
            return go

        caches = {
            "hf-StaticCache-bf16": lambda max_len=max_len: (StaticCache(config=model.config, max_cache_len=max_len),
                                                            contextlib.nullcontext()),
            "kivi-static-int4": ours(True),
            "kivi-static-int4-no-ring": ours(False),
        }
        if args.static_compile:
            caches = {f"{name}-compiled": caches[name] for name in ("hf-StaticCache-bf16", "kivi-static-int4")}

        def tagged(row, max_len=max_len):
            emit(dict(row, part="static", max_cache_len=max_len))

        S.compare_generate(model, dev, caches, [prompt], args.new, args, next(iter(caches)), tagged, weights,
                           batch=args.static_batch, disable_compile=not args.static_compile)


def main(argv=None) -> dict:
    args = parse_args(argv)
    return S.run("sinks", args, dict(kernels=kernel_rows, generate=generate_rows, static=static_rows),
                 dict(kernels=KERNEL_COLS, generate=S.GENERATE_COLS, static=S.GENERATE_COLS),
                 timing="kernels: " + ("CUDA graph replays" if args.graphs else "eager launches") + ", alternating, "
                 f"median of {args.reps}; generate/static: StepClock (CUDA events between tokens' logits), median step "
                 f"of a generate, median over {args.rounds} alternating generates")


if __name__ == "__main__":
    main()

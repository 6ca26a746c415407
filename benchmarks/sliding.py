"""Sliding-window attention: the decode kernel with a window, and ``generate`` on a Mistral-7B shape.

A sliding-window layer (Mistral, Gemma 2/3, Qwen2, Phi3, Starcoder2, Cohere2) is served with its window: the hook
passes the window to the kernels, which read only the pages it covers, and the layer releases the pages no query can
see again. The hook's fallback, for a layer it does not serve, dequantizes the layer's whole history every step and
runs SDPA with transformers' window mask.

Part ``kernels`` (one layer, one decode step): batch ``--batches``, 32 query / 8 KV heads, head_dim 128, ``--context``
stored tokens (128 in the fp16 window), window ``--window``; timed in turns (``harness.time_alternating``: CUDA-graph
replays timed with CUDA events, the order reversed every other repetition; ``--no-graphs``: eager launches):

* ``window``: ``paged_decode_attention(..., sliding_window=W)`` over the full pool (only the window's pages read);
* ``full``: the same without the window (a full-attention layer at this context);
* ``fallback``: ``dequantize_pages`` of the whole history + SDPA with a window mask;
* ``fp16_window``: SDPA over W fp16 tokens (transformers' ``DynamicSlidingWindowLayer`` keeps W - 1 + the new one).

Each row first checks the windowed kernel against the torch reference on its first sequence (``rel_err``).

Part ``generate`` (random-weight Mistral-7B shape: 32 layers, 32/8 heads, head_dim 128, window ``--window``, fp16;
batch 1, ``--prompts`` tokens, ``--new`` new tokens), caches ``fp16-DynamicCache`` (``DynamicCache(config=...)``:
sliding layers hold W - 1 tokens), ``kivi-int4`` (``Int4PagedCache()``, served with the window) and
``kivi-int4-fallback`` (``Int4PagedCache()`` with the hook's pattern check forced to the fallback). Per cache and
prompt: the decode step time (``harness.StepClock``: the interval between consecutive tokens' logits, CUDA events,
no sync; the median step of a generate, then the median over ``--rounds`` generates alternating between the caches
after a warm-up generate each), the prefill time, the peak memory above the weights, the cache's bytes after
generation (ours: everything allocated), the layers served with a window and the pages in use, and the leading
generated tokens that agree with DynamicCache's. A run out of GPU memory is recorded as such.

Usage::

    python benchmarks/sliding.py [--parts kernels,generate] [--window 4096] [--context 32768] [--batches 1,8]
                                 [--prompts 16384,32768] [--new 64] [--out F.json] [--commit SHA]
    python benchmarks/sliding.py --quick       # tiny CPU smoke run (Triton's interpreter; times are no result)

Output: ``benchmarks/results/sliding_<gpu>_<date>.json`` (``--out`` to change it), written after every row; the
tables are printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from unittest import mock

import harness as H
import torch

for _path in (H.ROOT, H.ROOT / "examples"):  # the package; examples/smollm2.py (leading_agreement)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from smollm2 import leading_agreement  # noqa: E402

MISTRAL_7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=32000, head_dim=128)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, vocab_size=256, head_dim=64)
PARTS = ("kernels", "generate")
KERNEL_COLS = [("batch", "B", "d"), ("context", "context", "d"), ("window", "window", ""),
               ("ms_window", "window ms", ".4f"), ("ms_full", "full ms", ".4f"), ("ms_fallback", "fallback ms", ".4f"),
               ("ms_fp16_window", "fp16 window ms", ".4f"), ("speedup_over_fallback", "x fallback", ".1f"),
               ("vs_full", "x full", ".2f"), ("vs_fp16_window", "x fp16 window", ".2f"), ("rel_err", "rel err", ".1e")]
GENERATE_COLS = [("cache", "cache", ""), ("batch", "B", "d"), ("prompt", "prompt", "d"), ("step_ms", "step ms", ".2f"),
                 ("prefill_s", "prefill s", ".2f"), ("peak_gib", "peak GiB", ".2f"), ("cache_mib", "cache MiB", ".1f"),
                 ("agree", "agree", "d"), ("sliding_layers", "sliding layers", "d"), ("pages_in_use", "pages", "d"),
                 ("error", "error", "")]


def ints(text: str, name: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a comma list of integers") from None
    if min(out) < 1:
        raise ValueError(f"{name}: {text!r} holds a value below 1")
    return out


def common_args(ap: argparse.ArgumentParser, parts: tuple) -> argparse.ArgumentParser:
    """The options sliding.py and sinks.py share."""
    H.add_common_args(ap)
    ap.add_argument("--parts", default="kernels,generate", help=f"comma list of {parts}")
    ap.add_argument("--batches", default="1,8", help="kernel part: sequences")
    ap.add_argument("--context", type=int, default=32768, help="kernel part: stored tokens per sequence")
    ap.add_argument("--reps", type=int, default=None, help="kernel part: alternating repetitions (default 15, quick 1)")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="kernel part: time CUDA-graph replays (default) or eager launches (--no-graphs)")
    ap.add_argument("--rounds", type=int, default=None, help="generate part: timed generates per cache, alternating "
                    "(default 3, quick 1)")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace, parts: tuple) -> argparse.Namespace:
    """Lists parsed, parts checked (``ap.error`` for a bad one)."""
    try:
        args.batch_list = ints(args.batches, "--batches")
        args.prompt_list = ints(args.prompts, "--prompts")
    except ValueError as exc:
        ap.error(str(exc))
    args.part_list = [p for p in args.parts.split(",") if p]
    bad = [p for p in args.part_list if p not in parts]
    if bad or not args.part_list:
        ap.error(f"--parts: unknown {bad} (parts: {parts})")
    args.reps = args.reps or (1 if args.quick else 15)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.new < 2 or args.context < 1 or args.reps < 1 or args.rounds < 1:
        ap.error("--new must be at least 2, --context, --reps and --rounds positive")
    return args


def parse_args(argv=None) -> argparse.Namespace:
    ap = common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), PARTS)
    ap.add_argument("--window", type=int, default=4096, help="the sliding window (tokens)")
    ap.add_argument("--prompts", default="16384,32768", help="generate part: prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="generate part: new tokens")
    args = ap.parse_args(argv)
    if args.quick:
        args.window, args.context, args.prompts, args.new, args.batches = 40, 200, "120", 6, "1,2"
    args = check_args(ap, args, PARTS)
    if args.window < 1 or args.window >= args.context:
        ap.error(f"--window {args.window}: must be positive and below --context {args.context}")
    return args


def time_kernels(args, dev, fns: dict) -> tuple[dict, dict]:
    """``(median ms, ms of every repetition)`` of each function, timed in turns."""
    times = H.time_alternating(fns, dev, reps=args.reps, graphs=args.graphs)
    return {k: H.median(v) for k, v in times.items()}, {k: [round(x, 6) for x in v] for k, v in times.items()}


def rel_err(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


# ----------------------------------------------------------------------------- part 1: kernels

def kernel_row(args, kk, dev, b: int) -> dict:
    from kivi_cache import reference
    from kivi_cache.testing import decode_args, pool_of, random_pool

    hq, hkv, d, g, p, res, w = 32, 8, 128, 32, 64, 128, args.window
    if args.quick:
        hq, hkv, d, res = 4, 2, 64, 16
    sm = 1 / math.sqrt(d)
    gen = torch.Generator(device=dev).manual_seed(0)
    t_quant = (args.context - res) // g * g
    pool = random_pool(b, hkv, t_quant, d, p, g, 4, 4, dev, gen)
    rk = torch.randn(b, hkv, res + g, d, device=dev, dtype=torch.float16, generator=gen)
    rv = torch.randn_like(rk)
    rl = torch.full((b,), res, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, d, device=dev, dtype=torch.float16, generator=gen)
    pa = decode_args(pool, q, rk, rv, rl, 4, 4, g, sm)
    one = decode_args(dict(pool, block_table=pool["block_table"][:1], lengths=pool["lengths"][:1]), q[:1], rk[:1],
                      rv[:1], rl[:1], 4, 4, g, sm)
    err = rel_err(kk.paged_decode_attention(*one, sliding_window=w),
                  reference.paged_decode_attention(*one, sliding_window=w))
    fp_k = torch.randn(b, hkv, w, d, device=dev, dtype=torch.float16, generator=gen)
    fp_v = torch.randn_like(fp_k)
    q4 = q[:, :, None]
    total = t_quant + res
    visible = (torch.arange(total, device=dev) >= total - w)[None, None, None]  # the newest token's window mask
    tensors = pool_of(pool)

    def fallback():
        hk, hv = kk.dequantize_pages(pool["block_table"], pool["lengths"], *tensors, 4, 4, g, max_len=t_quant)
        k = torch.cat([hk.to(torch.float16), rk[:, :, :res]], 2)
        v = torch.cat([hv.to(torch.float16), rv[:, :, :res]], 2)
        return torch.nn.functional.scaled_dot_product_attention(q4, k, v, attn_mask=visible, scale=sm,
                                                                 enable_gqa=True)

    ms, reps = time_kernels(args, dev, {
        "window": lambda: kk.paged_decode_attention(*pa, sliding_window=w),
        "full": lambda: kk.paged_decode_attention(*pa),
        "fallback": fallback,
        "fp16_window": lambda: torch.nn.functional.scaled_dot_product_attention(q4, fp_k, fp_v, scale=sm,
                                                                                enable_gqa=True),
    })
    row = dict(part="kernels", batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, context=total, window=w, rel_err=err,
               **{f"ms_{k}": v for k, v in ms.items()}, ms_reps=reps,
               speedup_over_fallback=ms["fallback"] / ms["window"], vs_fp16_window=ms["fp16_window"] / ms["window"],
               vs_full=ms["full"] / ms["window"])
    H.log(f"b={b} ctx={total} window={w}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in ms.items())
          + f"; err {err:.1e}")
    return row


def kernel_rows(args, kk, dev, emit) -> None:
    for b in H.progress(args.batch_list, desc="sliding kernels"):
        emit(kernel_row(args, kk, dev, b))
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- part 2: generate

def model_with(cls, cfg, dev, dtype):
    """``cls(cfg)`` with random weights in ``dtype`` on ``dev``, for inference."""
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval().requires_grad_(False)


def build_model(args, dev):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(**(TINY if args.quick else MISTRAL_7B), sliding_window=args.window,
                        max_position_embeddings=131072, attn_implementation="sdpa", bos_token_id=1, eos_token_id=2,
                        pad_token_id=0)
    return model_with(MistralForCausalLM, cfg, dev, torch.float16 if dev.type == "cuda" else torch.float32)


def cache_bytes(cache) -> int:
    if hasattr(cache, "memory_report"):  # ours: pools (free pages included) and windows
        return cache.memory_report().allocated
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def compare_generate(model, dev, caches: dict, prompts, new: int, args, ref: str, emit, weights: int = 0,
                     batch: int = 1, **generate_kwargs) -> None:
    """Greedy ``generate`` (``batch`` sequences, ``generate_kwargs`` passed on) for each prompt length and each cache
    of ``caches`` (name -> a function that sets the model up and returns ``(cache, context manager the run goes
    in)``): a warm-up generate each (not with ``--quick``), then ``args.rounds`` rounds alternating between the caches
    (the order reversed every other round). ``emit`` gets one row per prompt and cache (see the module docstring);
    ``agree``: the leading tokens of the first sequence agreeing with the ``ref`` cache's."""
    from transformers import LogitsProcessorList

    from kivi_cache import cache_kwargs

    cuda = dev.type == "cuda"

    def run(name, ids, n):
        cache, context = caches[name]()
        clock = H.StepClock(cuda)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = time.perf_counter()
        try:
            with context, torch.no_grad():
                out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, logits_processor=LogitsProcessorList([clock]), **generate_kwargs)
        except torch.OutOfMemoryError as exc:
            del cache
            torch.cuda.empty_cache()
            return dict(error=f"OutOfMemoryError: {str(exc)[:160]}")
        steps = clock.steps_ms()  # synchronizes
        prefill_ms = start.elapsed_time(clock.marks[0]) if cuda else (clock.marks[0] - start) * 1e3
        got = dict(prefill_ms=prefill_ms, step_ms=H.median(steps), tokens=out[0, ids.shape[1]:].tolist(),
                   peak=torch.cuda.max_memory_allocated(dev) - weights if cuda else None,
                   cache_bytes=cache_bytes(cache))
        if hasattr(cache, "memory_report"):  # ours
            got["sliding_layers"] = sum(layer.sliding_window is not None for layer in cache.layers)
            got["pages_in_use"] = sum(layer.pool.pages_in_use for layer in cache.layers)
        return got

    names = list(caches)
    for prompt in prompts:
        ids = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
        ids = ids.to(dev)
        if not args.quick:
            for name in names:  # warm-up: kernels compiled, allocator primed
                run(name, ids, 3)
                torch.cuda.empty_cache()
        got = {name: [] for name in names}
        for r in H.progress(range(args.rounds), desc=f"generate prompt {prompt}"):
            for name in names if r % 2 == 0 else names[::-1]:
                got[name].append(run(name, ids, new))
                if cuda:
                    torch.cuda.empty_cache()
        ok_ref = [x for x in got[ref] if "error" not in x]
        ref_tokens = ok_ref[0]["tokens"] if ok_ref else None
        for name, runs in got.items():
            ok = [x for x in runs if "error" not in x]
            row = dict(part="generate", cache=name, batch=batch, prompt=prompt, new=new)
            if not ok:
                emit(dict(row, error=runs[0]["error"]))
                H.log(f"prompt {prompt} {name}: {runs[0]['error']}")
                continue
            last = ok[-1]
            peak = max(x["peak"] for x in ok) if cuda else None
            row.update(runs=len(ok), errors=len(runs) - len(ok), step_ms=H.median(x["step_ms"] for x in ok),
                       step_ms_rounds=[round(x["step_ms"], 4) for x in ok],
                       prefill_s=H.median(x["prefill_ms"] for x in ok) / 1e3, peak_above_weights_bytes=peak,
                       peak_gib=None if peak is None else peak / 2**30, cache_bytes=last["cache_bytes"],
                       cache_mib=last["cache_bytes"] / 2**20,
                       agree=None if ref_tokens is None else leading_agreement(last["tokens"], ref_tokens),
                       **{k: last[k] for k in ("sliding_layers", "pages_in_use") if k in last})
            H.log(f"prompt {prompt} {name}: step {row['step_ms']:.2f} ms, prefill {row['prefill_s']:.2f} s, cache "
                  f"{row['cache_mib']:.1f} MiB, agree {row['agree']}/{new}")
            emit(row)


def generate_rows(args, kk, dev, emit) -> None:
    from transformers import DynamicCache

    from kivi_cache import Int4PagedCache, hook

    model = build_model(args, dev)
    weights = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    fallback = lambda: mock.patch.object(hook, "_pattern", lambda module, kwargs: (False, None))
    caches = {
        "fp16-DynamicCache": lambda: (DynamicCache(config=model.config), contextlib.nullcontext()),
        "kivi-int4": lambda: (Int4PagedCache(), contextlib.nullcontext()),
        "kivi-int4-fallback": lambda: (Int4PagedCache(), fallback()),  # the hook's pattern check forced off
    }
    compare_generate(model, dev, caches, args.prompt_list, args.new, args, "fp16-DynamicCache", emit, weights)


def run(name: str, args, parts: dict, tables: dict, **extra) -> dict:
    """Runs the parts named in ``args.part_list`` (name -> ``fn(args, kernels, device, emit)``), the record saved
    after every row; prints one table per part."""
    kk = H.kernels(args.quick)
    dev = H.device()
    rec = H.record(name, args, dev, interpreter=kk.interpreting(), **extra)
    out = H.out_path(name, args, rec)
    H.log(f"{name} on {rec['machine'].get('gpu') or 'CPU'} -> {out}")

    def emit(row):
        rec["rows"].append(row)
        H.save(out, rec)

    for part in args.part_list:
        parts[part](args, kk, dev, emit)
    rec["complete"] = True
    H.save(out, rec)
    for part in args.part_list:
        print(f"\n{part}:")
        print(H.table([r for r in rec["rows"] if r["part"] == part], tables[part]))
    H.log(f"saved {out}")
    return rec


def main(argv=None) -> dict:
    args = parse_args(argv)
    return run("sliding", args, dict(kernels=kernel_rows, generate=generate_rows),
               dict(kernels=KERNEL_COLS, generate=GENERATE_COLS),
               timing="kernels: " + ("CUDA graph replays" if args.graphs else "eager launches") + ", alternating, "
               f"median of {args.reps}; generate: StepClock (CUDA events between tokens' logits), median step of a "
               f"generate, median over {args.rounds} alternating generates")


if __name__ == "__main__":
    main()

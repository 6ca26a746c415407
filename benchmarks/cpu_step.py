"""The CPU decode step of SmolLM2: transformers' ``DynamicCache`` and ``QuantizedCache`` against ours, on the torch
path.

What a CPU user of ``generate``, the notebook or lm-eval waits for per token. For each prompt length it prefills a
prompt of that many tokens of the sample text (``examples/smollm2.py``; repeated where it is shorter), then times
``--steps`` one-token forwards (wall clock per step, ``time.perf_counter``) per cache, the caches alternating over
``--rounds`` rounds (the order reversed every other round). Caches:

* ``dynamic``: transformers ``DynamicCache`` (the model's dtype, fp32 here): the baseline;
* ``quanto_int4``: transformers ``QuantizedCache(backend="quanto", nbits=4)`` (needs optimum-quanto, its unpack op
  routed to pure PyTorch; recorded as skipped, with the reason, where it is not installed);
* ``kivi_int4`` / ``kivi_int2``: ``Int4PagedCache`` / ``Int2PagedCache`` on the default backend, which on the CPU is
  the chunked torch path (:mod:`kivi_cache.torch_ops`);
* ``kivi_int4_reference``: ``Int4PagedCache`` with ``set_backend("torch")``: the reference, which dequantizes the
  whole history every step.

``--attn eager`` loads the model with transformers' eager attention (the default of Gemma 2 and GPT-OSS), which our
cache serves through the dequantized history instead of the pages. A row (prompt, cache) holds the median step of
every round, their median and the ratio to ``dynamic``; the record holds the machine, versions and torch threads.

Usage::

    python benchmarks/cpu_step.py [--prompts 1024,4096] [--steps 16] [--rounds 2] [--caches dynamic,kivi_int4]
                                  [--attn sdpa|eager] [--threads N] [--out F.json] [--commit SHA]
    python benchmarks/cpu_step.py --quick      # one short prompt, two steps, one round

Output: ``benchmarks/results/cpu_step_cpu_<date>.json`` (``--out`` to change it), written after every prompt; the
table is printed at the end.
"""

from __future__ import annotations

import argparse
import sys
import time

import harness as H
import torch

for _path in (H.ROOT, H.ROOT / "examples"):  # the package; examples/smollm2.py (the model's loader, the text)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

CACHES = ("dynamic", "quanto_int4", "kivi_int4", "kivi_int2", "kivi_int4_reference")
COLS = [("prompt", "prompt", "d"), ("cache", "cache", ""), ("ms", "ms/step", ".1f"), ("vs_dynamic", "x dynamic", ".2f"),
        ("skipped", "skipped", "")]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    H.add_common_args(ap)
    ap.add_argument("--prompts", default=None, help="comma list of prompt lengths in tokens (default 1024,4096; "
                    "quick 64)")
    ap.add_argument("--steps", type=int, default=None, help="timed one-token steps per run (default 16, quick 2)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds alternating the caches (default 2, quick 1)")
    ap.add_argument("--caches", default=",".join(CACHES), help=f"comma list of {CACHES}")
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="the model's attention implementation")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    q = args.quick
    args.prompts = args.prompts or ("64" if q else "1024,4096")
    args.steps = args.steps or (2 if q else 16)
    args.rounds = args.rounds or (1 if q else 2)
    args.cache_list = [c for c in args.caches.split(",") if c]
    bad = [c for c in args.cache_list if c not in CACHES]
    if bad or not args.cache_list:
        ap.error(f"--caches: unknown {bad}; allowed: {CACHES}")
    try:
        args.prompt_list = [int(x) for x in args.prompts.split(",")]
    except ValueError:
        ap.error(f"--prompts: {args.prompts!r} is not a comma list of integers")
    if min(args.prompt_list) < 1 or args.steps < 1 or args.rounds < 1 or (args.threads is not None
                                                                           and args.threads < 1):
        ap.error("--prompts, --steps, --rounds and --threads must be positive")
    return args


def make_cache(name: str, model):
    from transformers import DynamicCache

    from kivi_cache import Int2PagedCache, Int4PagedCache

    if name == "dynamic":
        return DynamicCache()
    if name == "quanto_int4":
        from transformers import QuantizedCache

        return QuantizedCache(backend="quanto", config=model.config, nbits=4)
    return Int2PagedCache() if name == "kivi_int2" else Int4PagedCache()


def steps_ms(model, ids, name: str, steps: int) -> list[float]:
    """Prefill ``ids`` into a fresh cache ``name``, then ``steps`` greedy one-token forwards: ms of each."""
    import kivi_cache

    prev = kivi_cache.get_backend()
    kivi_cache.set_backend("torch" if name == "kivi_int4_reference" else "auto")
    try:
        cache = make_cache(name, model)
        times = []
        with torch.no_grad():
            out = model(ids, **kivi_cache.cache_kwargs(model, cache), use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            for _ in range(steps):
                t0 = time.perf_counter()
                out = model(tok, **kivi_cache.cache_kwargs(model, cache), use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                times.append((time.perf_counter() - t0) * 1e3)
        return times
    finally:
        kivi_cache.set_backend(prev)


def main(argv=None, loaded=None) -> dict:
    """``loaded``: ``(model, tokenizer)`` already loaded (the tests'), else SmolLM2 is loaded here."""
    args = parse_args(argv)
    import smollm2

    if args.threads:
        torch.set_num_threads(args.threads)
    names = list(args.cache_list)
    skipped = {}
    quanto = None
    if "quanto_int4" in names:
        from generate_models import setup_quanto  # benchmarks/generate_models.py

        quanto = setup_quanto(use_ext=False)
        if not quanto["available"]:
            skipped["quanto_int4"] = quanto["error"]
            names.remove("quanto_int4")
    dev = torch.device("cpu")
    rec = H.record("cpu_step", args, dev, model="SmolLM2-135M-Instruct (Q4_1 GGUF, loaded as fp32)", attn=args.attn,
                   threads=torch.get_num_threads(), quanto=quanto, skipped=skipped,
                   timing=f"wall clock per one-token forward; median of {args.steps} steps per run, median over "
                          f"{args.rounds} rounds alternating the caches")
    out = H.out_path("cpu_step", args, rec)
    model, tok = loaded or smollm2.load_smollm2(torch.float32)
    attn_before = model.config._attn_implementation
    if attn_before != args.attn:
        model.set_attn_implementation(args.attn)
    try:
        text = tok(smollm2.sample_text(), return_tensors="pt").input_ids
        for n in args.prompt_list:
            if n > text.shape[1]:
                text = torch.cat([text] * (n // text.shape[1] + 1), dim=1)  # the sample repeated (a longer prompt)
            ids = text[:, :n]
            rounds = {name: [] for name in names}
            for r in H.progress(range(args.rounds), desc=f"prompt {n}"):
                for name in names if r % 2 == 0 else names[::-1]:
                    rounds[name].append(H.median(steps_ms(model, ids, name, args.steps)))
                    H.log(f"prompt {n} round {r}: {name} {rounds[name][-1]:.1f} ms a step")
            med = {name: H.median(v) for name, v in rounds.items()}
            for name in names:
                rec["rows"].append(dict(prompt=n, cache=name, ms=med[name], round_ms=rounds[name], steps=args.steps,
                                        vs_dynamic=med[name] / med["dynamic"] if "dynamic" in med else None))
            rec["rows"] += [dict(prompt=n, cache=name, skipped=why) for name, why in skipped.items()]
            H.save(out, rec)
    finally:
        if model.config._attn_implementation != attn_before:
            model.set_attn_implementation(attn_before)
    rec["complete"] = True
    return H.finish(out, rec, COLS)


if __name__ == "__main__":
    main()

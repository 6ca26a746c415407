"""CPU decode step of SmolLM2 (the torch reference path): fp16-equivalent ``DynamicCache`` against ``Int4PagedCache``.

What a CPU user of ``generate``, the notebook or lm-eval waits for per token. Prefill a prompt of ``--prompt``
tokens from the Austen sample, then ``--steps`` one-token forwards per cache, alternating the caches over
``--rounds`` rounds; reports each cache's median step (ms) per round and overall, with machine and versions.

    python eval/cpu_step.py [--prompt 1024] [--steps 24] [--rounds 2] [--out eval/results/cpu_step.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import transformers
from transformers import DynamicCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kivi_cache import Int4PagedCache, cache_kwargs, models  # noqa: E402


def steps_ms(model, ids, make, steps: int) -> list[float]:
    cache = make()
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


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model, tok = models.load_smollm2()
    ids = tok(models.sample_text(), return_tensors="pt").input_ids[:, :args.prompt]
    caches = {"fp16_dynamic": DynamicCache, "kivi_int4": Int4PagedCache}
    rounds = {name: [] for name in caches}
    for r in range(args.rounds):
        for name, make in caches.items():
            rounds[name].append(statistics.median(steps_ms(model, ids, make, args.steps)))
            print(f"round {r}: {name} {rounds[name][-1]:.1f} ms a step", flush=True)
    res = dict(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(), torch=torch.__version__,
               transformers=transformers.__version__, model="SmolLM2-135M-Instruct (Q4_1 GGUF, fp32)",
               prompt=int(ids.shape[1]), steps=args.steps, round_medians_ms=rounds,
               median_ms={n: statistics.median(v) for n, v in rounds.items()})
    print(json.dumps(res["median_ms"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()

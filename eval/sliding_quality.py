"""Quality with sliding-window attention on real weights and text (CPU): SmolLM2 run as a sliding-window model.

SmolLM2-135M is a Llama; ``MistralForCausalLM`` is the same network plus a sliding window, so SmolLM2's weights load
into it unchanged (checked: with a window longer than the text its logits equal the Llama's). With ``--window`` W
(default 256: beyond the 128-token residual window, so the window reaches into the quantized pages) every layer is
a sliding-window layer, and this measures streaming perplexity (``eval/perplexity.stream_nll``: a 64-token prefill,
then one token at a time through the cache) on Austen chapters for:

* ``fp``: ``DynamicCache(config=model.config)`` (transformers' sliding layers, full precision): the reference;
* ``int8``, ``int4``, ``int2``: ``Int8PagedCache()``, ``Int4PagedCache()``, ``Int2PagedCache()``, served from the pages
  with the window (the sliding layers drop their sinks and release the pages the window left);
* ``int4-fallback``: ``Int4PagedCache()`` with the hook's window path off (every step dequantizes the whole history
  and runs sdpa with transformers' window mask, the sinks kept): what dropping the sinks and the pages costs.

Reports perplexity, its change against ``fp``, top-1 agreement with ``fp``, and each cache's bytes after the run;
writes ``eval/results/sliding_quality_smollm2_cpu_<date>[_quick].json`` (``--out``), ``meta`` holding the settings,
versions, machine, date, command and commit.

    python eval/sliding_quality.py                    # 4 docs x 1024 tokens (~15 min on 2 cores)
    python eval/sliding_quality.py --quick            # 1 doc x 160 tokens, window 48
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402
from transformers import DynamicCache, MistralConfig, MistralForCausalLM  # noqa: E402

from eval.perplexity import (  # noqa: E402
    environment,
    load_texts,
    provenance,
    result_path,
    smollm2_module,
    stream_nll,
    token_batch,
)
from kivi_cache import Int2PagedCache, Int4PagedCache, Int8PagedCache, hook  # noqa: E402

ROWS = {
    "fp": lambda model: DynamicCache(config=model.config),
    "int8": lambda model: Int8PagedCache(),
    "int4": lambda model: Int4PagedCache(),
    "int2": lambda model: Int2PagedCache(),
    "int4-fallback": lambda model: Int4PagedCache(),
}


def as_sliding(llama, window: int) -> MistralForCausalLM:
    """The Llama's weights in a ``MistralForCausalLM`` with ``sliding_window=window``."""
    c = llama.config
    cfg = MistralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
                        hidden_act=c.hidden_act, max_position_embeddings=c.max_position_embeddings,
                        rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters),
                        tie_word_embeddings=c.tie_word_embeddings, sliding_window=window,
                        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, attn_implementation="sdpa")
    model = MistralForCausalLM(cfg).to(next(llama.parameters()).dtype)
    missing, unexpected = model.load_state_dict(llama.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def cache_bytes(cache) -> int:
    if isinstance(cache, DynamicCache):
        return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return cache.memory_report().live


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--start", type=int, default=64)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--out", default=None,
                    help="JSON path (default eval/results/sliding_quality_smollm2_cpu_<date>[_quick].json)")
    ap.add_argument("--commit", default=None, help="the commit of this tree, recorded in the JSON (default: git)")
    args = ap.parse_args(argv)
    prov = provenance("sliding_quality.py", argv, args.commit)
    if args.quick:
        args.window, args.docs, args.tokens = 48, 1, 160
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    demo = smollm2_module()  # examples/smollm2.py
    llama, tok = demo.load_smollm2(torch.float32)
    model = as_sliding(llama, args.window)
    ids, picked = token_batch(tok, load_texts(demo.austen_path()), args.docs, args.tokens)
    with torch.no_grad():  # the same network: a window longer than the text changes nothing
        ref = llama(ids[:1, :200]).logits
        wide = as_sliding(llama, 4096)(ids[:1, :200]).logits
    same = ((wide - ref).norm() / ref.norm()).item()
    print(f"Mistral form of SmolLM2 vs the Llama (window 4096, 200 tokens): relative logit difference {same:.1e}")
    assert same < 1e-4, same
    del llama
    rows, fp_nll, fp_top1 = [], None, None
    for name in args.rows.split(","):
        cache = ROWS[name](model)
        patch = (mock.patch.object(hook, "_pattern", lambda module, kwargs: (False, None))
                 if name.endswith("fallback") else mock.patch.dict(os.environ, {}))
        t0 = time.perf_counter()
        with patch, torch.no_grad():
            nll, top1 = stream_nll(model, ids, cache, start=args.start, chunk=1, progress=False)
        row = dict(row=name, ppl=math.exp(nll.mean().item()), seconds=time.perf_counter() - t0,
                   cache_bytes=cache_bytes(cache))
        if name == "fp":
            fp_nll, fp_top1 = nll, top1
        if fp_nll is not None:
            row["ppl_change_pct"] = 100 * (math.exp(nll.mean().item() - fp_nll.mean().item()) - 1)
            row["top1_agree"] = (top1 == fp_top1).float().mean().item()
        if name != "fp":
            row["sliding_layers"] = sum(layer.sliding_window is not None for layer in cache.layers)
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = dict(meta=dict(**prov, model="SmolLM2-135M-Instruct (Q4_1 GGUF, fp32) as MistralForCausalLM",
                            window=args.window, docs=picked, tokens=args.tokens, start=args.start,
                            torch=torch.__version__, transformers=transformers.__version__,
                            python=platform.python_version(), machine=environment(),
                            mistral_vs_llama_logit_diff=same), rows=rows)
    out = Path(args.out) if args.out else result_path("sliding_quality_smollm2", args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()

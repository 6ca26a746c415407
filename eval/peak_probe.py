"""Where does a batch-1 generate's peak memory come from? (issue 4's unexplained ~2.8 GiB at 32k, session 3)

Runs ``generate`` (prompt ``--prompt`` tokens + ``--new``) with caches in the order given by ``--order``
in ONE process (as ``bench_generate.py`` does), and prints per run: memory allocated before, the peak
(``torch.cuda.max_memory_allocated`` after a reset), the peak minus what was allocated before, and the
multi-token SDPA calls of the prefill (query shape, mask shape/dtype or None, is_causal): a materialized
``[1, 1, T, T]`` mask at 32k is 1-2 GiB. Repeating a cache after compiled ones shows whether state left
behind (CUDA-graph pools, a cache's binding to the model) raises later peaks. Usage (GPU):
    python eval/peak_probe.py --order fp16,kivi-int4,fp16-static,kivi-int4-static,fp16,kivi-int4
    python eval/peak_probe.py --no-expandable ...   (without PYTORCH_CUDA_ALLOC_CONF=expandable_segments)
CPU smoke run: ``python eval/peak_probe.py --device cpu --model tiny --prompt 300 --order fp16,kivi-int4``.
"""

import argparse
import json
import os
import sys

if "--no-expandable" not in sys.argv:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402

from kivi_cache import Int4PagedCache, cache_kwargs  # noqa: E402
from kivi_cache.static import StaticQuantizedPagedCache  # noqa: E402

MODELS = {
    "llama3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                      vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                 vocab_size=256),
}

ap = argparse.ArgumentParser()
ap.add_argument("--order", default="fp16,kivi-int4,fp16-static,kivi-int4-static,fp16,kivi-int4")
ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
ap.add_argument("--layers", type=int, default=32)
ap.add_argument("--prompt", type=int, default=32768)
ap.add_argument("--new", type=int, default=4)
ap.add_argument("--device", default="cuda")
ap.add_argument("--no-expandable", action="store_true")
ap.add_argument("--out", default=None)
args = ap.parse_args()
dev = torch.device(args.device)
cuda = dev.type == "cuda"

calls = []
_sdpa = F.scaled_dot_product_attention


def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
    if q.shape[-2] > 1:
        calls.append(dict(q=list(q.shape), k=list(k.shape), is_causal=bool(is_causal),
                          mask=None if attn_mask is None else [list(attn_mask.shape), str(attn_mask.dtype)]))
    return _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)


F.scaled_dot_product_attention = spy

cfg = LlamaConfig(**MODELS[args.model], num_hidden_layers=args.layers, max_position_embeddings=131072,
                  attn_implementation="sdpa", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
torch.manual_seed(0)
dtype = torch.float16 if cuda else torch.float32
prev = torch.get_default_dtype()
torch.set_default_dtype(dtype)
with torch.device(dev):
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
torch.set_default_dtype(prev)
ids = torch.randint(3, cfg.vocab_size, (1, args.prompt), device=dev)
total = args.prompt + args.new


def make(name):
    if name == "fp16":
        return DynamicCache()
    if name == "kivi-int4":
        return Int4PagedCache()
    if name == "fp16-static":
        return StaticCache(config=cfg, max_cache_len=total)
    if name == "kivi-int4-static":
        return StaticQuantizedPagedCache(model, max_cache_len=total)
    raise SystemExit(f"--order: unknown cache {name!r}; allowed: fp16, kivi-int4, fp16-static, kivi-int4-static")


rows = []
for name in args.order.split(","):
    cache = make(name)
    calls.clear()
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                       **cache_kwargs(model, cache))
    row = dict(cache=name, prefill_sdpa_calls=len(calls), first_prefill_call=calls[0] if calls else None)
    if cuda:
        torch.cuda.synchronize()
        row.update(before_GiB=before / 2**30, peak_GiB=torch.cuda.max_memory_allocated() / 2**30,
                   reserved_GiB=torch.cuda.memory_reserved() / 2**30)
        row["peak_above_before_GiB"] = row["peak_GiB"] - row["before_GiB"]
    rows.append(row)
    print(json.dumps(row), flush=True)
    del cache
    if cuda:
        torch.cuda.empty_cache()
if args.out:
    json.dump(dict(args=vars(args), torch=torch.__version__, rows=rows,
                   gpu=torch.cuda.get_device_name() if cuda else "cpu"), open(args.out, "w"), indent=1)

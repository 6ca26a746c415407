"""A model spread over several GPUs (accelerate ``device_map``) with kivi_cache: same tokens as on one GPU.

Builds a random-weight Llama (GQA; default 8 layers, hidden 1024, fp16, seeded), generates
greedily on one GPU with ``Int4PagedCache`` and ``DynamicCache``, then dispatches the same weights
over every visible GPU (layers split evenly with ``device_map``) and generates again with
``Int4PagedCache``. Checks: the multi-GPU tokens equal the single-GPU tokens of the same cache,
and each layer's pages, residual window and block-table state live on that layer's device.

    python eval/multi_gpu.py [--out eval/results/multi_gpu.json]   # needs >= 2 GPUs for the split
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from accelerate import dispatch_model  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kivi_cache import Int4PagedCache, cache_kwargs  # noqa: E402


def build(layers, hidden, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
                      max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).eval().half()


def generate(model, ids, cache, n):
    with torch.no_grad():
        return model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=n, min_new_tokens=n, do_sample=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=700)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    n_gpu = torch.cuda.device_count()
    print(f"GPUs: {n_gpu} x {torch.cuda.get_device_name(0) if n_gpu else '-'}; torch {torch.__version__}")
    model = build(args.layers, args.hidden).to("cuda:0")
    ids = torch.randint(0, 4096, (2, args.prompt), generator=torch.Generator().manual_seed(1)).to("cuda:0")
    one_int4 = generate(model, ids, Int4PagedCache(), args.new).cpu()
    one_fp16 = generate(model, ids, DynamicCache(), args.new).cpu()
    model = model.cpu()
    per = -(-args.layers // max(1, n_gpu))
    dmap = {"model.embed_tokens": 0, "model.rotary_emb": 0}
    dmap.update({f"model.layers.{i}": min(i // per, n_gpu - 1) for i in range(args.layers)})
    dmap.update({"model.norm": n_gpu - 1, "lm_head": n_gpu - 1})
    model = dispatch_model(model, device_map=dmap)
    cache = Int4PagedCache()
    multi = generate(model, ids.to("cuda:0"), cache, args.new).cpu()
    placement = []
    for i, layer in enumerate(cache.layers):
        want = torch.device(f"cuda:{dmap[f'model.layers.{i}']}")
        devs = {str(t.device) for t in layer.pool.tensors.values()} | {str(layer.res_k.device)}
        devs |= {str(t.device) for t in layer._device_state()}
        placement.append(dict(layer=i, expected=str(want), found=sorted(devs), ok=devs == {str(want)}))
    new = slice(args.prompt, None)
    res = dict(gpus=n_gpu, gpu=torch.cuda.get_device_name(0), torch=torch.__version__, layers=args.layers,
               hidden=args.hidden, prompt=args.prompt, new=args.new, device_map=dmap,
               multi_equals_single_int4=bool(torch.equal(multi, one_int4)),
               int4_vs_fp16_agreement=float((one_int4[:, new] == one_fp16[:, new]).float().mean()),
               placement_ok=all(p["ok"] for p in placement), placement=placement,
               quantized_tokens=int(sum(sum(layer.paged_lens) for layer in cache.layers)))
    print(json.dumps({k: v for k, v in res.items() if k != "placement"}, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        json.dump(res, open(args.out, "w"), indent=1)
    assert res["multi_equals_single_int4"] and res["placement_ok"], "multi-GPU check failed"
    print("OK: multi-GPU tokens equal single-GPU tokens; every layer's cache state is on its layer's device")


if __name__ == "__main__":
    main()

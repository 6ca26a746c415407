"""One rank of tests/test_tp.py: a saved model loaded with ``tp_plan="auto"`` under ``torchrun`` (gloo on the CPU),
or loaded whole without ``torchrun``; greedy tokens of generate with each cache and of transformers' continuous
batching (fp16 pages and int4 pages), and the bytes each rank's quantized caches hold. Rank 0 writes them to
``--out`` (torch.save)."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig

import kivi_cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tp = "WORLD_SIZE" in os.environ
    parallel = dict(tp_plan="auto") if tp else {}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, **parallel)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (2, 150), generator=g)
    mask = torch.ones_like(ids)
    out = {"world_size": dist.get_world_size() if tp else 1}
    caches = {"dynamic": lambda: DynamicCache(config=model.config), "int8": kivi_cache.Int8PagedCache,
              "int4": kivi_cache.Int4PagedCache, "static": lambda: kivi_cache.StaticQuantizedPagedCache(model, 200)}
    for name, make in caches.items():
        cache = make()
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                                **kivi_cache.cache_kwargs(model, cache))
        out[name] = tokens[:, ids.shape[1]:].tolist()
        if name != "dynamic":
            out[f"{name}_live_bytes"] = cache.memory_report().live
            out[f"{name}_kv_heads"] = cache.layers[0].num_heads
    for name in ("cb_fp", "cb_int4") if kivi_cache.cb.unsupported_reason() is None else ():
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        gen = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=-1, pad_token_id=0)
        cfg = ContinuousBatchingConfig(page_size=64, num_blocks=64, max_batch_tokens=512, max_requests_per_batch=8)
        if name == "cb_int4":
            kivi_cache.enable_continuous_batching(model, preset="int4")
        res = model.generate_batch(ids.tolist(), generation_config=gen, continuous_batching_config=cfg)
        out[name] = [res[k].generated_tokens for k in sorted(res, key=lambda k: int(k.split("_")[-1]))]
        kivi_cache.disable_continuous_batching(model)
    if not tp or dist.get_rank() == 0:
        torch.save(out, args.out)
    if tp:
        dist.barrier()


if __name__ == "__main__":
    main()

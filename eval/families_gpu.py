"""kivi_cache on the GPU across model families: greedy tokens and logits against ``DynamicCache``.

Tiny random-weight models (no download) of several architectures, fp16 on one GPU, a left-padded batch of two
prompts longer than the residual window (so pages and the Triton kernels are used), ``--new`` greedy tokens with
``DynamicCache``, ``Int8PagedCache``-like 8-bit (near lossless) and ``Int4PagedCache``-like 4-bit settings (small
window, no sinks). Per family: leading tokens that agree with ``DynamicCache`` per sequence, the max relative error
of the step logits (teacher-forced: every cache decodes the ``DynamicCache`` tokens), whether the decode kernel
ran (``ops`` warns once when it falls back to the torch reference) and how often the hook fell back to the
materialized history (``fallback_calls``: 0 where every layer is served, sliding windows included; the layers
served with a window and the pages they released are counted too).

    python eval/families_gpu.py --out $OUT/families_gpu.json --commit SHA  # on the GPU (~1 minute)
    python eval/families_gpu.py --device cpu --new 4 --families llama     # CPU smoke run

The JSON's ``meta`` holds the versions, the device, the settings, the date, the command and the commit (``--commit``
where the tree has no ``.git``, as on a device machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))  # smollm2.py

import transformers as T  # noqa: E402
from smollm2 import leading_agreement  # noqa: E402  (examples/smollm2.py)
from transformers import DynamicCache  # noqa: E402

from eval.perplexity import provenance  # noqa: E402
from kivi_cache import QuantizedPagedCache, cache_kwargs  # noqa: E402
from kivi_cache.layer import QuantizedPagedLayer  # noqa: E402

# head_dim 64 or 128 (the kernels' sizes), GQA where the family has it
BASE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0)
FAMILIES = {
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**BASE)),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**BASE, head_dim=64, sliding_window=4096)),
    "mistral-window64": lambda: T.MistralForCausalLM(T.MistralConfig(**BASE, head_dim=64, sliding_window=64)),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**BASE)),
    "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**BASE, head_dim=64)),
    "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**BASE)),
    "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**dict(BASE, num_attention_heads=2, num_key_value_heads=1),
                                                      head_dim=128)),
    "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=2048, rotary_pct=0.25, pad_token_id=0)),
    "starcoder2": lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(**BASE, sliding_window=4096)),
    # windows shorter than the sequence, held by the module on some layers (config.layer_types)
    "gemma3-window64": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        **dict(BASE, num_hidden_layers=3), head_dim=64, sliding_window=64,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "qwen2-window64": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=64,
                                                               max_window_layers=1)),
    # learned sink logits (s_aux) on a window-64 layer and a full one, served under attn_implementation="kivi"; the
    # reference is the model's own eager attention (EAGER_REF)
    "gpt_oss-window64": lambda: _with_sinks(T.GptOssForCausalLM(T.GptOssConfig(
        **dict(BASE, intermediate_size=256), head_dim=64, num_local_experts=2, num_experts_per_tok=1,
        sliding_window=64, layer_types=["sliding_attention", "full_attention"]))),
}
EAGER_REF = {"gpt_oss-window64"}  # DynamicCache runs the model's eager attention; the caches "kivi"
def _with_sinks(model):
    """Sink logits of order 1-5 (GPT-OSS's init gives ~0.02, which would hardly matter)."""
    for module in model.modules():
        if hasattr(module, "sinks"):
            torch.nn.init.normal_(module.sinks, std=2.0)
    return model


SETTINGS = {
    "int8": dict(key_bits=8, value_bits=8, group_size=32, residual_length=32, sink_length=0),
    "int4": dict(key_bits=4, value_bits=4, group_size=32, residual_length=32, sink_length=0),
}


def forced_logits(model, ids, mask, tokens, cache):
    """Prompt, then the given continuation one token at a time through ``cache``: the logits ``[B, N, V]``."""
    out = []
    with torch.no_grad():
        kw = cache_kwargs(model, cache)
        pos = mask.long().cumsum(-1) - 1
        o = model(ids, attention_mask=mask, position_ids=pos.clamp(min=0), **kw)
        out.append(o.logits[:, -1].float())
        for i in range(tokens.shape[1] - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            pos = pos[:, -1:] + 1
            o = model(tokens[:, i:i + 1], attention_mask=mask, position_ids=pos, **kw)
            out.append(o.logits[:, -1].float())
    return torch.stack(out, 1)


def run_family(name, args, dev):
    torch.manual_seed(0)
    model = FAMILIES[name]().eval().to(dev, torch.float16 if dev.type == "cuda" else torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (2, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :args.pad] = 0
    mask[1, :args.pad] = 0
    ids, mask = ids.to(dev), mask.to(dev)
    gen = dict(attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    if name in EAGER_REF:
        model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model.generate(ids, **cache_kwargs(model, DynamicCache()), **gen)[:, ids.shape[1]:]
    ref_logits = forced_logits(model, ids, mask, ref, DynamicCache())
    if name in EAGER_REF:
        model.set_attn_implementation("kivi")
    row = {"family": name, "type": type(model).__name__, "attn": model.config._attn_implementation}
    real = QuantizedPagedLayer.materialize
    for label, setting in SETTINGS.items():
        calls = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                seq = model.generate(ids, **cache_kwargs(model, QuantizedPagedCache(**setting)), **gen)
            cache = QuantizedPagedCache(**setting)
            QuantizedPagedLayer.materialize = lambda self, *a, _c=calls: _c.append(1) or real(self, *a)
            try:
                logits = forced_logits(model, ids, mask, ref, cache)
            finally:
                QuantizedPagedLayer.materialize = real
        seq = seq[:, ids.shape[1]:]
        err = ((logits - ref_logits).abs().amax() / ref_logits.abs().amax()).item()
        rep = cache.memory_report()
        row[label] = {
            "leading_agree": [leading_agreement(seq[i].tolist(), ref[i].tolist()) for i in range(seq.shape[0])],
            "max_rel_logit_err": err,
            "quantized_tokens": rep.quantized_tokens,
            "fallback_calls": len(calls),
            "sliding_layers": [layer.sliding_window for layer in cache.layers],
            "hidden_pages": [sum(layer.hidden) for layer in cache.layers],
            "warnings": sorted({str(w.message)[:200] for w in caught if "kivi_cache" in str(w.message)}),
        }
    print(f"{name:18s} " + "  ".join(f"{k}: agree {row[k]['leading_agree']} / {args.new}, logit err "
                                     f"{row[k]['max_rel_logit_err']:.2e}, {len(row[k]['warnings'])} warnings, "
                                     f"{row[k]['fallback_calls']} fallbacks"
                                     for k in SETTINGS), flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--pad", type=int, default=37)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=None, help="the commit of this tree, recorded in the JSON (default: git)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    meta = {**provenance("families_gpu.py", argv, args.commit),
            "torch": torch.__version__, "transformers": T.__version__, "python": platform.python_version(),
            "device": (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                       else platform.processor() or platform.machine()),
            "prompt": args.prompt, "pad": args.pad, "new": args.new, "settings": SETTINGS}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    print(meta, flush=True)
    rows = []
    for name in args.families.split(","):
        try:
            rows.append(run_family(name, args, dev))
        except Exception as exc:  # one family's failure is recorded, the others still run
            print(f"{name}: ERROR {type(exc).__name__}: {exc}", flush=True)
            rows.append({"family": name, "error": f"{type(exc).__name__}: {exc}"})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

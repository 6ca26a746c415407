"""Models, caches and one timed ``generate`` for benchmarks/generate.py.

Models are Llama configurations built with random weights directly on the device (no download). Caches are
transformers' own (``DynamicCache``, ``StaticCache``, quanto's ``QuantizedCache``) and kivi_cache's presets.
``run_generate`` runs one ``generate`` and returns its time, peak memory, per-step timer and cache figures.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
import types

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList

import kivi_cache
from kivi_cache import Int2PagedCache, Int4PagedCache, QuantizedPagedCache, cache_kwargs

GiB = float(1 << 30)
MiB = float(1 << 20)

MODELS = {
    "llama2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=11008, vocab_size=32000, rope_theta=10000.0),
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, rope_theta=500000.0),
    # --quick: a tiny Llama with grouped-query attention (2 query heads per KV head); head_dim 64 takes every
    # cache's groups (Int2PagedCache groups 64 channels)
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=256, vocab_size=256, rope_theta=10000.0),
}
CACHES = ("fp16", "kivi-int4", "kivi-int2", "quanto-int4", "quanto-int2")
# compiled decoding (opt-in with --caches): generate compiles the decode step of a compileable cache on its own
STATIC_CACHES = ("fp16-static", "kivi-int4-static")
# opt-in variants of the kivi presets
EXTRA_CACHES = ("kivi-kv2", "kivi-int4-r32", "kivi-kv2-r32", "kivi-int4-g64", "kivi-int2-rot", "kivi-kv2-rot",
                "kivi-int2-noclip", "kivi-int2-static", "kivi-int2-rot-static", "kivi-int2-noclip-static")
ALL_CACHES = CACHES + STATIC_CACHES + EXTRA_CACHES
KIVI_CLASSES = {"kivi-int4": Int4PagedCache, "kivi-int2": Int2PagedCache,
                # 2-bit keys and values, group 32, 4 sinks (0.375 bytes per element; Int2PagedCache keeps 4-bit keys)
                "kivi-kv2": functools.partial(QuantizedPagedCache, key_bits=2, value_bits=2, group_size=32,
                                              residual_length=128, sink_length=4),
                # a 32-token full-precision window instead of 128: less memory per sequence
                "kivi-int4-r32": functools.partial(Int4PagedCache, residual_length=32),
                "kivi-kv2-r32": functools.partial(QuantizedPagedCache, key_bits=2, value_bits=2, group_size=32,
                                                  residual_length=32, sink_length=4),
                # 64-token / 64-channel groups: fewer scale and zero-point bytes than group 32
                "kivi-int4-g64": functools.partial(Int4PagedCache, group_size=64),
                # keys and values stored Hadamard-rotated (queries rotated, outputs turned back: QuantConfig.rotate)
                "kivi-int2-rot": functools.partial(Int2PagedCache, rotate="both"),
                # key groups quantized with their full min/max range (the preset clips them: QuantConfig.clip)
                "kivi-int2-noclip": functools.partial(Int2PagedCache, clip="none"),
                "kivi-kv2-rot": functools.partial(QuantizedPagedCache, key_bits=2, value_bits=2, group_size=32,
                                                  residual_length=128, sink_length=4, rotate="both")}


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------- device helpers

class Dev:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset_peak(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self):
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def allocated(self):
        return torch.cuda.memory_allocated(self.device) if self.cuda else None

    def alloc_counters(self) -> dict | None:
        """Caching-allocator counters: ``num_alloc_retries`` counts allocations that failed, freed the cached
        blocks and retried (slow: device frees and syncs; happens near the memory-fraction budget)."""
        if not self.cuda:
            return None
        st = torch.cuda.memory_stats(self.device)
        return {k: st.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}

    def free(self):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


_OOM_TYPES = tuple({getattr(torch, "OutOfMemoryError", MemoryError),
                    getattr(torch.cuda, "OutOfMemoryError", MemoryError)})


def human(n) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024.0)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, _OOM_TYPES):
        return True
    s = str(exc).lower()
    return "out of memory" in s or "alloc_failed" in s


def err_text(exc: BaseException, limit: int = 400) -> str:
    s = f"{type(exc).__name__}: {exc}".strip()
    if is_oom(exc):
        s = "OOM: " + s.splitlines()[0]
    s = " ".join(s.split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


class TimeBudget(Exception):
    pass


def attempt(fn):
    """``(result, None)`` or ``(None, error)``; memory is freed after a failure."""
    err = None
    try:
        return fn(), None
    except TimeBudget:
        raise
    except Exception as exc:  # noqa: BLE001  (one failing configuration must not stop the run)
        err = exc
    msg, oom = err_text(err), is_oom(err)
    del err
    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001  (a broken context: later rows record their own errors)
            pass
    return None, {"error": msg, "oom": oom}


def require_kernels(script: str, cuda: bool | None = None) -> None:
    """Exit where a GPU run would time kivi_cache's torch reference instead of its Triton kernels (they do not
    load, e.g. a checkout without the ``kivi_cache/kernels`` link)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    err = kivi_cache.kernel_error() if cuda else None
    if err is not None and kivi_cache.get_backend() != "torch":
        raise SystemExit(f"{script}: kivi_cache's Triton kernels do not load on this GPU ({err}); the kivi rows would "
                         "time the torch reference. Install the project (pip install -e .), or pass --allow-fallback "
                         "to time the torch path anyway")


# ----------------------------------------------------------------------------- quanto

def setup_quanto(use_ext: bool) -> dict:
    """Import optimum-quanto; unless ``use_ext``, route its ``unpack`` op to pure PyTorch (its extension compiles
    with nvcc on first use, for minutes)."""
    try:
        import optimum.quanto as oq  # noqa: PLC0415
        from transformers.utils import is_optimum_quanto_available  # noqa: PLC0415

        if not is_optimum_quanto_available():
            raise ImportError("transformers does not see optimum-quanto (is_optimum_quanto_available() is False)")
    except Exception as exc:  # noqa: BLE001  (ImportError, or a broken install)
        return {"available": False, "error": f"optimum-quanto not usable: {err_text(exc)}", "unpack": None}
    info = {"available": True, "version": getattr(oq, "__version__", "?"), "error": None}
    if use_ext:
        info["unpack"] = "quanto extension (compiled on first use)"
        return info
    try:
        from optimum.quanto.library.extensions import get_extension, is_extension_available  # noqa: PLC0415

        def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:  # = quanto's own "default" unpack
            mask = (1 << bits) - 1
            return torch.cat([(packed >> (bits * i)) & mask for i in range(8 // bits)]).to(torch.uint8)

        patched = []
        for name in ("quanto_cuda", "quanto_cpp", "quanto_hip", "quanto_mps"):
            if is_extension_available(name):
                get_extension(name)._lib = types.SimpleNamespace(unpack=unpack)
                patched.append(name)
        info["unpack"] = f"pure PyTorch (extensions {patched} not compiled)"
    except Exception as exc:  # noqa: BLE001
        info["unpack"] = f"quanto extension (could not patch: {err_text(exc)})"
    return info


def tensor_bytes(t) -> int:
    """Bytes of a tensor, looking inside tensor subclasses (quanto's QTensors) through ``__tensor_flatten__``."""
    if t is None or not isinstance(t, torch.Tensor):
        return 0
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


# ----------------------------------------------------------------------------- model and caches

def build_model(name: str, device: torch.device, dtype: torch.dtype):
    spec = dict(MODELS[name])
    cfg = LlamaConfig(**spec, max_position_embeddings=131072, attn_implementation="sdpa", tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, use_cache=True)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # random normal init straight on the device
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model.eval().requires_grad_(False)
    gc_ = model.generation_config
    gc_.pad_token_id, gc_.bos_token_id, gc_.eos_token_id = 0, 1, 2
    return model


def model_shapes(model) -> dict:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    wbytes += sum(b.numel() * b.element_size() for b in model.buffers())
    elt = next(model.parameters()).element_size()
    return dict(hidden_size=c.hidden_size, layers=c.num_hidden_layers, heads=c.num_attention_heads,
                kv_heads=c.num_key_value_heads, head_dim=head_dim, intermediate_size=c.intermediate_size,
                vocab_size=c.vocab_size, rope_theta=(getattr(c, "rope_parameters", None) or {}).get(
                    "rope_theta", getattr(c, "rope_theta", None)),
                dtype=str(next(model.parameters()).dtype).replace("torch.", ""), weight_bytes=wbytes,
                params=sum(p.numel() for p in model.parameters()),
                kv_bytes_per_token_fp=2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * elt)


def kv_theory(cache_name: str, shapes: dict, args) -> float:
    """Bytes per token of the stored KV, all layers, without any full-precision residual window."""
    elems = 2 * shapes["layers"] * shapes["kv_heads"] * shapes["head_dim"]  # keys + values
    elt = shapes["kv_bytes_per_token_fp"] / elems
    cache_name = cache_name.removesuffix("-static")
    if cache_name == "fp16":
        return float(shapes["kv_bytes_per_token_fp"])
    bits = 4 if cache_name.endswith("int4") else 2
    if cache_name.startswith("kivi"):  # the preset's bits and group: a scale and a zero point per group
        c = KIVI_CLASSES[cache_name]().quant_config
        return elems / 2 * ((c.key_bits + c.value_bits) / 8 + 4 * elt / c.group_size)
    return elems * (bits / 8 + 2 * elt / args.quanto_group)  # quanto: scale + shift per group


def make_cache(name: str, model, batch: int, total_len: int, args, quanto_info: dict):
    if name == "fp16":
        return DynamicCache(config=model.config)
    if name == "fp16-static":
        from transformers import StaticCache  # noqa: PLC0415

        return StaticCache(config=model.config, max_cache_len=total_len)
    if name == "kivi-int4-static":
        from kivi_cache import StaticQuantizedPagedCache  # noqa: PLC0415

        return StaticQuantizedPagedCache(model, total_len)
    if name.startswith("kivi-int2") and name.endswith("-static"):
        # the Int2 preset compiled; -rot: rotated keys and values; -noclip: unclipped keys
        from kivi_cache import StaticQuantizedPagedCache  # noqa: PLC0415
        from kivi_cache.config import PRESETS  # noqa: PLC0415

        kw = dict(PRESETS["int2"])
        if "-rot" in name:
            kw["rotate"] = "both"
        if "-noclip" in name:
            kw["clip"] = "none"
        return StaticQuantizedPagedCache(model, total_len, **kw)
    if name.startswith("quanto-"):
        if not quanto_info["available"]:
            raise ImportError(quanto_info["error"])
        from transformers import QuantizedCache  # noqa: PLC0415

        return QuantizedCache(backend="quanto", config=model.config, nbits=4 if name.endswith("int4") else 2,
                              q_group_size=args.quanto_group, residual_length=args.quanto_residual)
    cls = KIVI_CLASSES[name]
    if args.no_prealloc:
        return cls()
    return cls(max_batch_size=batch, max_cache_len=total_len)  # exactly the pages batch x total_len tokens need


def cache_stats(name: str, cache, batch: int, shapes: dict) -> dict:
    """Measured KV bytes held by ``cache`` after a generate, per (sequence x cached token)."""
    seq = int(cache.get_seq_length())
    tokens = max(1, batch * seq)
    out = {"cached_tokens_per_seq": seq}
    if name.startswith("kivi"):
        rep = cache.memory_report()
        out.update(kv_bytes=rep.live, kv_bytes_allocated=rep.allocated, kv_report=rep.to_dict())
    elif name.startswith("quanto"):
        b = 0
        for layer in cache.layers:
            for attr in ("_quantized_keys", "_quantized_values", "keys", "values"):
                b += tensor_bytes(getattr(layer, attr, None))
        out.update(kv_bytes=b, kv_bytes_allocated=b)
    else:
        b = sum(tensor_bytes(layer.keys) + tensor_bytes(layer.values) for layer in cache.layers
                if getattr(layer, "keys", None) is not None)
        out.update(kv_bytes=b, kv_bytes_allocated=b)
    out["kv_bytes_per_token"] = out["kv_bytes"] / tokens
    out["kv_bytes_per_token_allocated"] = out["kv_bytes_allocated"] / tokens
    return out


# ----------------------------------------------------------------------------- one generate

class StepTimer(StoppingCriteria):
    """Stamps every generated token after a device sync (wall clock, so that the first stamp gives the time to the
    first token), and reads the allocator counters once, at the first token; never stops generation."""

    def __init__(self, dev: Dev):
        self.dev = dev
        self.times: list[float] = []
        self.first_counters: dict | None = None

    def __call__(self, input_ids, scores, **kwargs):
        self.dev.sync()
        self.times.append(time.perf_counter())
        if len(self.times) == 1:
            self.first_counters = self.dev.alloc_counters()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def prompt_ids(batch: int, length: int, vocab: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 7919 * length + batch)
    return torch.randint(3, vocab, (batch, length), generator=g).to(device)


def prefill_chunk(args, batch: int, prompt: int) -> int | None:
    """``prefill_chunk_size`` for generate: about ``--prefill-tokens`` tokens per forward over the batch
    (None: one forward for the whole prompt)."""
    if not args.prefill_tokens or batch * prompt <= args.prefill_tokens:
        return None
    return max(16, args.prefill_tokens // batch // 16 * 16)


def run_generate(ctx, cache_name: str, batch: int, prompt: int, new: int, keep_cache: bool = False,
                 cache_len: int | None = None, chunked: bool = False) -> dict:
    """One timed ``generate``; raises on failure (the caller records it). ``cache_len``: the static
    caches' ``max_cache_len`` (default prompt + new); the batch-1 cases give every run of a case the
    same one, so the compiled decode step is traced once per case, in the warm-up."""
    model, dev, args = ctx["model"], ctx["dev"], ctx["args"]
    ids = prompt_ids(batch, prompt, model.config.vocab_size, dev.device)
    total = cache_len if cache_len and cache_name.endswith("static") else prompt + new
    chunk = prefill_chunk(args, batch, prompt) if chunked else None
    # static caches: the prompt chunks go through kivi_cache.prefill (eager) instead of generate's
    # prefill_chunk_size, which would compile every chunk's forward for a compileable cache (CUDA-graph pools)
    eager_prefill = chunk is not None and cache_name.endswith("static")
    extra = {} if chunk is None or eager_prefill else {"prefill_chunk_size": chunk}
    cache = make_cache(cache_name, model, batch, total, args, ctx["quanto"])
    timer = StepTimer(dev)
    dev.free()
    dev.reset_peak()
    dev.sync()
    held = dev.allocated()  # weights plus whatever the process still holds (e.g. compiled runs' graph pools)
    t0 = time.perf_counter()
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if eager_prefill:
            kivi_cache.prefill(model, cache, ids, attention_mask=mask, chunk_size=chunk)
        out = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                             stopping_criteria=StoppingCriteriaList([timer]), **extra)
    dev.sync()
    t = time.perf_counter() - t0
    res = {"t": t, "peak": dev.peak(), "held_before": held, "generated": int(out.shape[1] - prompt),
           "prefill_chunk": chunk, "prefill": "kivi_cache.prefill" if eager_prefill else "generate"}
    del out
    stamps = timer.times
    if stamps:
        res["ttft"] = stamps[0] - t0
        if batch * prompt >= 512 and res["ttft"] > 0:  # the best prefill rate seen: time estimates
            ctx["prefill_rate"] = max(ctx.get("prefill_rate") or 0.0, batch * prompt / res["ttft"])
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        res["step_timer"] = statistics.median(gaps) if gaps else None
    if timer.first_counters is not None and len(stamps) > 1:  # from the first token to the end of generate
        a, b = timer.first_counters, dev.alloc_counters()
        res["decode_alloc"] = {k.removeprefix("num_"): b[k] - a[k] for k in a}
    if res["generated"] != new:
        raise RuntimeError(f"generate produced {res['generated']} tokens instead of {new}")
    if keep_cache:
        res["cache_stats"] = cache_stats(cache_name, cache, batch, ctx["shapes"])
    del cache, ids, mask
    return res


def base_row(model, case, cache, batch, prompt, new, shapes, args) -> dict:
    return dict(model=model, case=case, cache=cache, batch=batch, prompt=prompt, new=new,
                kv_bytes_per_token_theory=kv_theory(cache, shapes, args), error=None)


def skipped_row(base: dict, reason: str, text: str) -> dict:
    return dict(base, status="skipped", skip_reason=reason, error=text)

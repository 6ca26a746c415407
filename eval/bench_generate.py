"""End-to-end ``model.generate`` benchmark of kivi_cache against fp16 and quanto caches (issue #4).

Usage (one H200, default run: every model x cache x case, JSON + table + 2 PNGs):

    python eval/bench_generate.py [--out eval/results/bench_generate.json]
    python eval/bench_generate.py --resume          # a second run fills rows the first had to skip
    python eval/bench_generate.py --resume --resume-from other.json     # also continue rows recorded there
    python eval/bench_generate.py --models llama3-8b --cases maxbatch --batch-prompts 4096 --caches kivi-int2 \\
        --maxbatch-at kivi-int2:4096:417                                # throughput at batch 417, no search
    python eval/bench_generate.py --profile --profile-only --models llama3-8b   # kernel table only
    python eval/bench_generate.py --quick           # tiny random model, CPU-capable, < 1 minute
                                                    # (default output eval/results/bench_generate_quick.json)

Models are built from their configs with random fp16 weights directly on the GPU
(no download): ``llama2-7b`` (32 layers, 32 KV heads, vocab 32000) and ``llama3-8b``
(32 layers, 8 KV heads, vocab 128256, rope_theta 5e5). Caches, side by side:

* ``fp16``: transformers ``DynamicCache`` at the model dtype;
* ``quanto-int4`` / ``quanto-int2``: transformers ``QuantizedCache(backend="quanto")`` with
  its defaults (axis 0, q_group_size 64, residual_length 128). Rows are ``skipped`` with
  the ImportError text when optimum-quanto is not importable. quanto unpacks its codes
  with a CUDA/C++ extension that it compiles on first use (nvcc + ninja, minutes); unless
  ``--quanto-ext`` is given the script routes that op to an equivalent pure-PyTorch
  unpack instead (recorded in the JSON under ``meta.quanto.unpack``);
* ``kivi-int4`` / ``kivi-int2``: ``Int4PagedCache`` / ``Int2PagedCache`` (group 32,
  residual 128, page 64), their page pools preallocated for the known final length
  (``max_batch_size``/``max_cache_len``: exactly the pages; ``--no-prealloc``: grow on demand, as the
  library does by default); extra names: ``kivi-kv2`` (2/2 bits g32, 4 sinks), ``kivi-int4-r32`` and
  ``kivi-kv2-r32`` (the same with a 32-token window: memory-lean, quality in eval/NOTES.md session 6),
  ``kivi-int4-g64`` (int4 in 64-token / 64-channel groups: 10% fewer bytes, session 9).

Cases, each a row per (model, cache):

* ``short``: batch 1, prompt ``--prompt`` (1024), ``--new`` (256) new tokens;
* ``long``: batch 1, prompt ``--long-prompt`` (32768), ``--long-new`` (64) new tokens;
* ``ctx``: batch 1, prompts ``--ctx-prompts`` (4k, 8k, 16k), ``--ctx-new`` (8) tokens, one
  cold run each: peak memory against context length (with short and long);
* ``maxbatch``: for each prompt in ``--batch-prompts`` (1024, 4096), the largest batch whose
  ``generate`` fits the memory budget (``--budget-gb`` GiB, enforced with
  ``torch.cuda.set_per_process_memory_fraction`` so that OOM happens at the budget). Two
  probe batches give a linear memory model and a predicted maximum; the search doubles its
  step from there (from batch 1 with ``--no-predict``) until a trial runs out of memory,
  then bisects until the bracket is within ``--batch-tol`` (4 %). Trials generate
  ``--trial-new`` tokens, by default ``--batch-new`` (64): a trial then sizes the pools exactly as the
  measurement does, and the fitting trial at the batch found *is* the measurement (``measured_in_search``;
  no second million-token prefill, ~50-90 s saved per row on the H200). With a smaller ``--trial-new``
  (runs before session 7 used 16) the batch found gets a separate ``--batch-new`` generate.
  Every trial is logged in the row's ``search`` (batch, fit or OOM, peak, time, step timer; an OOM
  also ``t_fail``, its time to the failure), and the row so far is written to the JSON after each
  trial (``skip_reason: "interrupted"`` until the row is finished), so a command killed mid-search
  loses no trial. ``--maxbatch-at [MODEL:]CACHE:PROMPT:BATCH`` (repeatable): no search for that row,
  only the measurement at BATCH (``batch_given: true``; after a warm-up generate at the probe batch
  with 2 new tokens; ``decode_step_ms_tN`` is None unless a trial at BATCH is recorded).

Timing. Every configuration is warmed up first (one generate: 40 new tokens at prompts up
to 4k, 8 at longer prompts; triton compiles, cuBLAS and the allocator settle), then the
``--repeats`` (2) measurements are interleaved across configurations, alternating their
order. A measurement is ``generate`` with N new tokens (t_N) and with 1 new token (t_1):
decode step = (t_N - t_1) / (N - 1), decode tokens/s = batch / decode step, prefill =
t_1, medians over the repeats. For ``maxbatch`` the step is the per-step timer's median (below);
with ``--trial-new`` < ``--batch-new`` also (t_N - t_trial) / (N - trial_new) (``decode_step_ms_tN``).
A per-step timer (a stopping criterion that synchronizes and stamps each generated token) gives a second
estimate, ``step_ms_timer`` (median step interval), and the time to first token. Peak
memory is ``torch.cuda.max_memory_allocated`` of the t_N run (reset before each generate).
KV bytes per token: measured from the cache after the t_N run (kivi:
``memory_report().live``, fp16: the tensors' bytes, quanto: the bytes of its packed
tensors, scales, shifts and residual) over batch x cached tokens, and the theoretical
value (fp16 ``2*layers*kv_heads*head_dim*2``; quantized: codes + per-group scale/zero,
no residual window).

Time on one H200 (estimates; eager decode of a 7-8B model is some 25-40 ms a step, quanto
adds a full dequantization of its cache every step). Per model: build ~5 s, warm-ups
~30 s (with triton compiles), short 5 caches x 2 repeats x ~8 s ~ 80 s, long ~70 s
(quanto ~2x the others at 32k), ctx ~15 s: ~3.3 minutes, so ~6.5 minutes of batch-1 rows
for both models. A max-batch row costs ~20-35 s (a few prefills of 100-400k tokens at
~40k tokens/s, then the measurement), 20 rows ~8-10 minutes: a complete default set does
not fit one 10-minute device command. ``--time-budget`` (default 510 s, counted from
start-up) keeps a run under 9 minutes: the time left is split evenly over the models still
to run, batch-1 rows come first, and work whose estimated cost does not fit is not started:
its row gets ``status: "skipped"``, ``skip_reason: "time budget"`` (a search cut short
reports its best fitting batch with ``search_stopped_early``; a repeat that does not fit is
dropped, noted in the row). The same command again with ``--resume`` keeps the JSON's
finished rows (``ok``/``error``) and runs only the others (a second run of ~8-9 minutes: ~1 minute
of builds, then max-batch rows); unfinished rows that this run does not cover stay in the JSON as
they were. An unfinished max-batch row with a ``search`` log is continued, not restarted: its fits
and OOMs at the same ``--trial-new`` become the search's trials (probes included, so the memory
and time models are the recorded ones; nothing recorded is run again, nor a batch that a
recorded fit or OOM decides, fitting being monotone in the batch), the predicted maximum is the
line through the smallest and the largest recorded fits (``predicted_from``), the search goes on
from the first batch without an answer, then the measurement. The row records ``resumed``
(source file, its start time, ``reused_trials``/``reused_fits``/``reused_ooms``) and its reused
``search`` entries carry ``reused: true``. Trials recorded under other settings (prefill tokens,
budget, allocator, quanto group/residual, device kind) are not reused (``resume_note`` says why).
``--resume-from FILE`` (repeatable, implies ``--resume``) reads rows from other result files too;
per row the finished one wins, else the longest search log, else the ``--out`` file's. So: first
run ~8.5 minutes (batch-1 rows + a few max-batch rows), second run ``--resume`` ~8.5 minutes (the
remaining max-batch rows; a third ``--resume`` if any are still skipped: it loses only the ~40 s
of start-up, builds and warm-ups, since the searches continue).
Failures of one configuration (OOM, errors) are recorded in its row and the run goes on.
The JSON is rewritten after every row (and after every max-batch trial).

``--profile``: torch.profiler over ``--profile-steps`` decode steps of kivi-int4 at batch 1
(prompt ``--prompt``; the prefill is not recorded), the top CUDA kernels by time printed
and saved under ``profile``: attention during decode should be only kivi_cache's Triton
kernels (``kivi`` tag), with no sdpa/flash kernels (``attention-like`` tag).
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import types

T_START = time.perf_counter()

if "--no-expandable" not in sys.argv:  # before torch touches CUDA: less fragmentation for every cache alike
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StoppingCriteria, StoppingCriteriaList  # noqa: E402

import kivi_cache  # noqa: E402
from kivi_cache import Int2PagedCache, Int4PagedCache, QuantizedPagedCache, cache_kwargs  # noqa: E402

GiB = float(1 << 30)
MiB = float(1 << 20)

MODELS = {
    "llama2-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      intermediate_size=11008, vocab_size=32000, rope_theta=10000.0),
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, rope_theta=500000.0),
    # --quick: a tiny Llama with grouped-query attention (2 query heads per KV head)
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=256, vocab_size=256, rope_theta=10000.0),
}
CACHES = ("fp16", "kivi-int4", "kivi-int2", "quanto-int4", "quanto-int2")
# compiled decoding (issue 4 part 3), opt-in with --caches: generate compiles the decode step of a
# compileable cache on its own (CUDA graphs with the default compile config)
STATIC_CACHES = ("fp16-static", "kivi-int4-static")
# opt-in: KIVI-2 proper, 2-bit keys and values (g32, 4 sinks; 0.375 B/element): the memory class of the
# issue's "int2" (Int2PagedCache keeps 4-bit keys for retrieval quality, 0.4375 B/element)
EXTRA_CACHES = ("kivi-kv2", "kivi-int4-r32", "kivi-kv2-r32", "kivi-int4-g64")
ALL_CACHES = CACHES + STATIC_CACHES + EXTRA_CACHES
CASES = ("short", "long", "ctx", "maxbatch")
KIVI_CLASSES = {"kivi-int4": Int4PagedCache, "kivi-int2": Int2PagedCache,
                "kivi-kv2": functools.partial(QuantizedPagedCache, key_bits=2, value_bits=2, group_size=32,
                                              residual_length=128, sink_length=4),
                # memory-lean windows (session 6, SmolLM2: int4 R=32 +0.20% perplexity, 2/2 R=32 +6.56%)
                "kivi-int4-r32": functools.partial(Int4PagedCache, residual_length=32),
                "kivi-kv2-r32": functools.partial(QuantizedPagedCache, key_bits=2, value_bits=2, group_size=32,
                                                  residual_length=32, sink_length=4),
                # 64-token / 64-channel groups (session 8-9, SmolLM2: +0.02% perplexity, 98.2% top-1, needle
                # 15/15; decode attention 9-11% faster than g32 on the H200, eval/results/ab_s9_candidates.json)
                "kivi-int4-g64": functools.partial(Int4PagedCache, group_size=64)}
# kernel names that would mean decode attention ran outside kivi_cache's kernels
ATTENTION_LIKE = ("flash", "fmha", "sdpa", "scaled_dot_product", "attention", "attn", "efficient")


def log(*a):
    print(*a, flush=True)


def tqdm_bar(**kw):
    try:
        from tqdm import tqdm

        return tqdm(**kw, file=sys.stdout, dynamic_ncols=True, mininterval=2.0)
    except ImportError:  # pragma: no cover
        class _Bar:
            def update(self, n=1):
                pass

            def set_postfix_str(self, s):
                pass

            def write(self, s):
                log(s)

            def close(self):
                pass

        return _Bar()


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


# ----------------------------------------------------------------------------- quanto

def setup_quanto(use_ext: bool) -> dict:
    """Import optimum-quanto; unless ``use_ext``, route its ``unpack`` op to pure PyTorch."""
    try:
        import optimum.quanto as oq  # noqa: PLC0415
        from transformers.utils import is_optimum_quanto_available  # noqa: PLC0415

        if not is_optimum_quanto_available():
            raise ImportError("transformers does not see optimum-quanto (is_optimum_quanto_available() is False)")
    except Exception as exc:  # ImportError, or a broken install
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
    except Exception as exc:
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
    if name.startswith("quanto-"):
        if not quanto_info["available"]:
            raise ImportError(quanto_info["error"])
        from transformers import QuantizedCache  # noqa: PLC0415

        return QuantizedCache(backend="quanto", config=model.config, nbits=4 if name.endswith("int4") else 2,
                              q_group_size=args.quanto_group, residual_length=args.quanto_residual)
    cls = KIVI_CLASSES[name]
    if args.no_prealloc:
        return cls()
    # exactly the pages `batch` sequences of total_len tokens need (session 6; before: batch * ceil(total_len /
    # page), which also counted the tokens that stay in the full-precision window: ~2 pages per sequence)
    return cls(max_batch_size=batch, max_cache_len=total_len)


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
    """Stamps every generated token (after a device sync); never stops generation."""

    def __init__(self, dev: Dev):
        self.dev = dev
        self.times: list[float] = []
        self.first_counters: dict | None = None  # allocator counters at the first token (read once: not per step)

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
    # static caches: the prompt chunks go through kivi_cache.prefill (eager) instead of generate's prefill_chunk_size,
    # which compiles every chunk's forward for a compileable cache (2.6 GiB of CUDA-graph pools at 4k x 320, s10)
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
        except Exception:  # a broken context: later rows record their own errors
            pass
    return None, {"error": msg, "oom": oom}


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ----------------------------------------------------------------------------- the run

# settings under which a recorded max-batch trial is valid for a resumed search (and the trial's own "new")
REUSE_SETTINGS = ("prefill_tokens", "no_prealloc", "no_expandable", "quanto_group", "quanto_residual")
# how make_cache sizes a kivi pool; runs before session 6 (no such setting) sized it by total_len // page
PREALLOC_RULE = "max_batch_size/max_cache_len"


def row_rank(row: dict, keep_import: bool) -> float:
    """Which of several resumed rows of one key to use: finished > a search log (the longer the better) > other."""
    if row.get("status") in ("ok", "error") or (keep_import and row.get("skip_reason") == "import"):
        return 3.0
    if row.get("search"):
        return 2.0 + min(len(row["search"]), 999) / 1000
    return 1.0


class Runner:
    def __init__(self, args, dev: Dev, quanto_info: dict, out_path: str):
        self.args, self.dev, self.quanto = args, dev, quanto_info
        self.out_path = out_path
        self.rows: list[dict] = []
        self.kept: dict = {}  # finished rows of the resumed JSONs: not run again
        self.pending: dict = {}  # their unfinished rows: in the JSON until run again (max batch: trials reused)
        self.pending_src: dict = {}
        self.in_progress: dict | None = None  # the max-batch row being searched, as far as it got
        self.result = {}
        self.deadline = T_START + args.time_budget
        self.model_deadline = self.deadline
        self.memory_lines: list[str] = []

    # time -------------------------------------------------------------
    def left(self) -> float:
        return self.model_deadline - time.perf_counter()

    def fits_in_time(self, est: float | None) -> bool:
        return est is None or time.perf_counter() + est <= self.model_deadline

    # rows -------------------------------------------------------------
    def key(self, model, case, cache, prompt):
        return f"{model}|{case}|{cache}|{prompt}"

    def rkey(self, row: dict) -> str:
        return self.key(row.get("model"), row.get("case"), row.get("cache"), row.get("prompt"))

    def done(self, model, case, cache, prompt) -> bool:
        return self.key(model, case, cache, prompt) in self.kept

    def add_row(self, row: dict):
        row.setdefault("status", "ok" if not row.get("error") else "error")
        self.rows.append(row)
        self.in_progress = None
        self.save()

    def progress(self, row: dict):
        """The unfinished row being worked on, saved now (replaced by ``add_row``)."""
        self.in_progress = row
        self.save()

    def load_resume(self, paths: list[str]) -> dict | None:
        """Rows of earlier result files (``--resume``: ``--out``, then ``--resume-from`` files). Per key the
        best row is used (``row_rank``; ties: the earlier file). Returns the first file's content."""
        keep_import = not self.quanto["available"]
        best, first = {}, None
        for path in paths:
            with open(path) as f:
                data = json.load(f)
            first = first or data
            src = dict(file=path, started=data.get("meta", {}).get("started"), git=data.get("meta", {}).get("git"),
                       device=data.get("meta", {}).get("device"), settings=data.get("settings", {}))
            for r in data.get("rows", []):
                k = self.rkey(r)
                if k not in best or row_rank(r, keep_import) > row_rank(best[k][0], keep_import):
                    best[k] = (r, src)
        for k, (r, src) in best.items():
            if row_rank(r, keep_import) >= 3 and not self.stale_pool(r, src):
                self.kept[k] = r
            else:
                self.pending[k], self.pending_src[k] = r, src
        return first

    def other_pool_rule(self, row: dict, src: dict) -> bool:
        """A kivi row recorded with pools sized by another rule than this run's (runs before session 6
        preallocated ~2 spare pages per sequence): its trials and measurements do not hold here."""
        return (row.get("cache", "").startswith("kivi") and not self.args.no_prealloc
                and src["settings"].get("prealloc_rule") != PREALLOC_RULE)

    def stale_pool(self, row: dict, src: dict) -> bool:
        """A finished max-batch row of this run's caches with another pool rule: measured again, not kept."""
        return (row.get("case") == "maxbatch" and row.get("cache") in (self.args.caches or ())
                and self.other_pool_rule(row, src))

    def prior_search(self, key: str, budget) -> tuple[dict | None, str | None]:
        """The recorded search of an unfinished max-batch row, if its trials are valid here, else a note why not."""
        row = self.pending.get(key)
        if not row or not row.get("search"):
            return None, None
        src, args = self.pending_src[key], self.args
        diffs = [k for k in REUSE_SETTINGS if k in src["settings"] and src["settings"][k] != getattr(args, k)]
        if self.other_pool_rule(row, src):
            diffs.append("prealloc_rule")
        if row.get("budget_bytes") != budget:
            diffs.append("budget_bytes")
        if src.get("device") and src["device"].split(":")[0] != self.dev.device.type:
            diffs.append("device")
        if diffs:
            return None, f"recorded trials of {src['file']} not reused: settings differ ({', '.join(diffs)})"
        return dict(search=row["search"], source=src["file"], started=src.get("started"), git=src.get("git")), None

    def given_batch(self, model: str, cache: str, prompt: int) -> int | None:
        for g in self.args.maxbatch_at:
            if g["model"] in (None, model) and g["cache"] == cache and g["prompt"] == prompt:
                return g["batch"]
        return None

    def save(self):
        new = {self.rkey(r) for r in self.rows} | ({self.rkey(self.in_progress)} if self.in_progress else set())
        self.result["rows"] = (list(self.kept.values()) + [r for k, r in self.pending.items() if k not in new]
                               + self.rows + ([self.in_progress] if self.in_progress else []))
        self.result["memory_arithmetic"] = self.memory_lines
        self.result["elapsed_s"] = time.perf_counter() - T_START
        os.makedirs(os.path.dirname(os.path.abspath(self.out_path)), exist_ok=True)
        tmp = self.out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1, default=str)
        os.replace(tmp, self.out_path)


def base_row(model, case, cache, batch, prompt, new, shapes, args) -> dict:
    return dict(model=model, case=case, cache=cache, batch=batch, prompt=prompt, new=new,
                kv_bytes_per_token_theory=kv_theory(cache, shapes, args), error=None)


def skipped_row(base: dict, reason: str, text: str) -> dict:
    return dict(base, status="skipped", skip_reason=reason, error=text)


def batch1_phase(runner: Runner, ctx, mname: str, bar):
    """Cases short / long (warm-up, then interleaved repeats) and ctx (one cold run each)."""
    args, shapes, dev = runner.args, ctx["shapes"], runner.dev
    cfgs = []
    if "short" in args.cases:
        cfgs += [("short", c, args.prompt, args.new) for c in args.caches]
    if "long" in args.cases:
        cfgs += [("long", c, args.long_prompt, args.long_new) for c in args.caches]
    todo, meas = [], {}
    for case, cache, p, n in cfgs:
        if runner.done(mname, case, cache, p):
            continue
        base = base_row(mname, case, cache, 1, p, n, shapes, args)
        if cache.startswith("quanto") and not runner.quanto["available"]:
            runner.add_row(skipped_row(base, "import", runner.quanto["error"]))
            bar.update(1 + args.repeats)
            continue
        todo.append((case, cache, p, n, base))
    # warm-up, one generate per configuration
    alive = []
    for case, cache, p, n, base in todo:
        wn = min(n, 40 if p <= 4096 else 8)
        bar.set_postfix_str(f"{mname} warm-up {case} {cache}")
        res, err = attempt(lambda c=cache, p=p, wn=wn, n=n: run_generate(ctx, c, 1, p, wn, cache_len=p + n))
        bar.update(1)
        if err:
            runner.add_row(dict(base, **err, phase="warm-up"))
            bar.update(args.repeats)
            continue
        # cost of one measurement: t_N + t_1
        step = res.get("step_timer") or 0.0
        est = 2 * res.get("ttft", res["t"]) + (n - 1) * step
        meas[(case, cache)] = dict(base=base, tN=[], t1=[], peakN=[], heldN=[], peak1=[], timerN=[], ttft=[], est=est,
                                   stats=None, errors=[], warmup_s=res["t"])
        alive.append((case, cache, p, n))
    # static caches again: a compiled step is re-traced when another configuration's warm-up changed what its
    # guards check (binding a StaticQuantizedPagedCache to the model's attention modules does, once)
    for case, cache, p, n in alive:
        if cache.endswith("static"):
            bar.set_postfix_str(f"{mname} warm-up 2 {case} {cache}")
            attempt(lambda c=cache, p=p, n=n: run_generate(ctx, c, 1, p, min(n, 8), cache_len=p + n))
    # interleaved repeats, alternating the order
    for r in range(args.repeats):
        order = alive if r % 2 == 0 else alive[::-1]
        for case, cache, p, n in order:
            m = meas[(case, cache)]
            bar.set_postfix_str(f"{mname} {case} {cache} rep {r + 1}/{args.repeats}")
            if m["errors"]:
                bar.update(1)
                continue
            if not runner.fits_in_time(m["est"]):
                m.setdefault("time_skipped", 0)
                m["time_skipped"] += 1
                bar.update(1)
                continue
            first = m["stats"] is None
            res, err = attempt(lambda c=cache, p=p, n=n, k=first: run_generate(ctx, c, 1, p, n, keep_cache=k,
                                                                               cache_len=p + n))
            if err:
                m["errors"].append(err)
                bar.update(1)
                continue
            if m["stats"] is None:
                m["stats"] = res.get("cache_stats")
            m["tN"].append(res["t"])
            m["peakN"].append(res["peak"])
            m["heldN"].append(res["held_before"])
            m["timerN"].append(res.get("step_timer"))
            m["ttft"].append(res.get("ttft"))
            res1, err = attempt(lambda c=cache, p=p, n=n: run_generate(ctx, c, 1, p, 1, cache_len=p + n))
            if err:
                m["errors"].append(err)
            else:
                m["t1"].append(res1["t"])
                m["peak1"].append(res1["peak"])
            bar.update(1)
    for case, cache, _p, n in alive:
        m = meas[(case, cache)]
        row = dict(m["base"], repeats=len(m["tN"]), t_N_s=m["tN"], t_1_s=m["t1"], warmup_s=m["warmup_s"])
        if m["tN"] and m["t1"]:
            tn, t1 = med(m["tN"]), med(m["t1"])
            step = (tn - t1) / (n - 1) if n > 1 else None
            row.update(prefill_s=t1, ttft_s=med(m["ttft"]), decode_step_ms=None if step is None else step * 1e3,
                       decode_tok_s=None if not step or step <= 0 else 1 / step,
                       e2e_tok_s=n / tn, step_ms_timer=None if med(m["timerN"]) is None else med(m["timerN"]) * 1e3,
                       peak_bytes=max(m["peakN"]) if dev.cuda else None,
                       held_before_bytes=m["heldN"][m["peakN"].index(max(m["peakN"]))] if dev.cuda else None,
                       peak_prefill_bytes=max(m["peak1"]) if dev.cuda and m["peak1"] else None)
            row.update(m["stats"] or {})
        if m["errors"]:
            row.update(m["errors"][0], status="error" if not m["tN"] else "ok")
            if m["tN"]:
                row["note"] = f"{len(m['errors'])} repeat(s) failed: " + m["errors"][0]["error"]
                row["error"] = None
        elif not m["tN"]:
            row.update(status="skipped", skip_reason="time budget",
                       error="time budget: no measurement fitted in the time left (use --resume)")
        elif m.get("time_skipped"):
            row["note"] = f"{m['time_skipped']} repeat(s) skipped for the time budget"
        runner.add_row(row)
        if case == "long" and row.get("status") == "ok":
            memory_arithmetic(runner, ctx, row)
    # ctx: peak memory against context length, one cold run each
    if "ctx" in args.cases:
        rate = ctx.get("prefill_rate")  # tokens / s
        for p in args.ctx_prompts:
            for cache in args.caches:
                if runner.done(mname, "ctx", cache, p):
                    continue
                base = base_row(mname, "ctx", cache, 1, p, args.ctx_new, shapes, args)
                bar.set_postfix_str(f"{mname} ctx {p} {cache}")
                bar.update(1)
                if cache.startswith("quanto") and not runner.quanto["available"]:
                    runner.add_row(skipped_row(base, "import", runner.quanto["error"]))
                    continue
                est = None if not rate else p / rate + args.ctx_new * 0.06
                if not runner.fits_in_time(est):
                    runner.add_row(skipped_row(base, "time budget", "time budget (use --resume)"))
                    continue
                res, err = attempt(lambda c=cache, p=p: run_generate(ctx, c, 1, p, args.ctx_new, keep_cache=True))
                if err:
                    runner.add_row(dict(base, **err))
                    continue
                runner.add_row(dict(base, t_N_s=[res["t"]], ttft_s=res.get("ttft"), peak_bytes=res["peak"],
                                    step_ms_timer=None if res.get("step_timer") is None else res["step_timer"] * 1e3,
                                    note="single cold run (memory)", **res.get("cache_stats", {})))


def act_estimate(shapes: dict, batch: int, prompt: int) -> int:
    """Activation bytes at the prefill peak (last layer's MLP): 3 [P, I] + 3 [P, H] tensors."""
    elt = shapes["kv_bytes_per_token_fp"] // (2 * shapes["layers"] * shapes["kv_heads"] * shapes["head_dim"])
    return batch * prompt * elt * (3 * shapes["intermediate_size"] + 3 * shapes["hidden_size"])


def memory_arithmetic(runner: Runner, ctx, row: dict):
    shapes = ctx["shapes"]
    w = shapes["weight_bytes"]
    kv = row.get("kv_bytes_allocated") or 0
    act = act_estimate(shapes, row["batch"], row["prompt"])
    peak = row.get("peak_bytes")
    kind = "allocated, memory_report()" if row["cache"].startswith("kivi") else "held"
    line = (f"memory @ b={row['batch']}, {row['prompt']}+{row['new']} tokens, {row['model']} {row['cache']}: "
            f"weights {human(w)} + KV {human(kv)} ({kind}) + activations ~{human(act)} (est.) = {human(w + kv + act)}")
    held = row.get("held_before_bytes")
    other = max(0, held - w) if held else 0  # allocations the process held before this generate besides weights
    if peak:
        line += f"; measured peak {human(peak)} (unexplained {human(peak - w - kv - act - other)}"
        line += f", after {human(other)} held before the generate besides the weights)" if held else ")"
    runner.memory_lines.append(line)
    row["memory_arithmetic"] = dict(weights=w, kv=kv, activations_est=act, sum=w + kv + act, measured_peak=peak,
                                    held_before=held, held_before_besides_weights=other)
    log(line)


# ----------------------------------------------------------------------------- max batch

def find_max_batch(fits, start: int, cap: int, tol: float, known: dict | None = None):
    """Largest b <= cap with fits(b): doubling steps from ``start`` until a failure brackets it, then
    bisection until hi - lo <= max(1, tol * lo). ``fits`` returns True/False (OOM). Returns (lo, hi).

    ``known``: outcomes already measured ({batch: fits}, e.g. the trials of an interrupted search that is
    resumed). They are never asked of ``fits`` again, and neither is a batch they decide on the search's
    own assumption that fitting is monotone in the batch (at or below a known fit: fits; at or above a
    known failure: does not), so a resumed search walks its recorded steps for free and continues from
    the first batch it has no answer for."""
    known = {int(b): bool(v) for b, v in (known or {}).items()}

    def test(b: int) -> bool:
        if b not in known:
            if any(v and k >= b for k, v in known.items()):
                return True
            if any(not v and k <= b for k, v in known.items()):
                return False
            known[b] = bool(fits(b))
        return known[b]

    lo, hi = 0, None
    b = max(1, min(start, cap))
    step = max(1, int(math.ceil(b * tol))) if start > 1 else 1
    if test(b):
        lo = b
        while lo < cap:
            nb = min(cap, lo + step)
            if test(nb):
                lo, step = nb, step * 2
            else:
                hi = nb
                break
    else:
        hi = b
        while hi > 1:
            nb = max(1, hi - step)
            if test(nb):
                lo = nb
                break
            hi, step = nb, step * 2
    # the tightest bracket the known outcomes give (a recorded fit above the walk's last step, say)
    lo = max([lo] + [k for k, v in known.items() if v and k <= cap])
    hi = min([k for k, v in known.items() if not v and k > lo] + ([hi] if hi is not None and hi > lo else []),
             default=None)
    if lo == 0:
        return 0, hi
    while hi is not None and hi - lo > max(1, math.ceil(tol * lo)):
        mid = (lo + hi) // 2
        if test(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def maxbatch_phase(runner: Runner, ctx, mname: str, bar):
    args, shapes = runner.args, ctx["shapes"]
    budget = ctx["budget_bytes"]
    for p in args.batch_prompts:
        for cache in args.caches:
            given = runner.given_batch(mname, cache, p)
            if runner.done(mname, "maxbatch", cache, p):
                if given is not None:
                    log(f"--maxbatch-at {mname}:{cache}:{p}:{given}: the row is already finished in the resumed "
                        f"JSON and is kept (not measured again)")
                continue
            bar.set_postfix_str(f"{mname} maxbatch {p} {cache}")
            bar.update(1)
            base = base_row(mname, "maxbatch", cache, None, p, args.batch_new, shapes, args)
            base["budget_bytes"] = budget
            if cache.startswith("quanto") and not runner.quanto["available"]:
                runner.add_row(skipped_row(base, "import", runner.quanto["error"]))
                continue
            key = runner.key(mname, "maxbatch", cache, p)
            if runner.left() < args.min_row_s:
                if key in runner.pending:  # a resumed row (maybe with trials to reuse) stays as it is
                    log(f"{mname} maxbatch {cache} {p}: not started (time budget); its resumed row is kept")
                    continue
                runner.add_row(skipped_row(base, "time budget", "time budget: not started (use --resume)"))
                continue
            prior, note = runner.prior_search(key, budget)
            row = one_max_batch(runner, ctx, base, cache, p, budget, prior=prior, given=given)
            if note:
                row["resume_note"] = note
            runner.add_row(row)


def one_max_batch(runner: Runner, ctx, base: dict, cache: str, p: int, budget, prior: dict | None = None,
                  given: int | None = None) -> dict:
    """The max-batch row of one (cache, prompt): probes, search, measurement at the batch found.

    ``prior``: ``{"search": [trial entries], "source": ..., "started": ...}``, the search log of an earlier
    run's unfinished row (``--resume``): its fits and OOMs at this ``--trial-new`` are reused as trials
    (entries marked ``reused``; probes included, so the memory and time models are the recorded ones) and
    the search continues where it stopped. ``given``: no search; measure at this batch (``--maxbatch-at``),
    recorded as ``batch_given``."""
    args, dev = runner.args, runner.dev
    trials: dict[int, dict | None] = {}
    log_trials: list[dict] = []
    ran = []  # generates of this cache in this row (warm-up before a measurement that would be the first)
    resumed = None
    if prior:
        reused, ignored = [], 0
        for e in prior.get("search") or []:
            b = e.get("batch")
            if not isinstance(b, int) or e.get("new") != args.trial_new:
                ignored += 1
                continue
            if e.get("ok") and e.get("t") is not None:
                trials[b] = dict(t=e["t"], peak=e.get("peak"), ttft=e.get("ttft"), step_timer=e.get("step_timer"))
                if e.get("ttft") and b * p >= 512:  # the prefill rate of the time estimates, as if it had run
                    ctx["prefill_rate"] = max(ctx.get("prefill_rate") or 0.0, b * p / e["ttft"])
            elif e.get("oom"):
                trials.setdefault(b, None)  # a recorded fit at the same batch wins
            else:
                ignored += 1
                continue
            log_trials.append(dict(e, reused=True))
            reused.append(b)
        resumed = dict(source=prior.get("source"), started=prior.get("started"), reused_trials=reused,
                       reused_fits=sorted(b for b in set(reused) if trials.get(b) is not None),
                       reused_ooms=sorted(b for b in set(reused) if trials.get(b) is None), ignored_entries=ignored)
        log(f"resume {base['model']} maxbatch {cache} {p}: reusing {len(reused)} recorded trials "
            f"(fits {resumed['reused_fits']}, OOM {resumed['reused_ooms']})")

    def snapshot():  # the row so far, in the JSON after every trial: a command killed mid-search loses nothing
        runner.progress(dict(base, status="skipped", skip_reason="interrupted", search=list(log_trials),
                             trial_new=args.trial_new, resumed=resumed,
                             error="interrupted during the max-batch search (use --resume: its trials are reused)"))

    def trial(b: int, new: int) -> dict | None:
        t0 = time.perf_counter()
        # a trial of --batch-new tokens keeps the cache's figures: the trial at the batch found is its measurement
        res, err = attempt(lambda: run_generate(ctx, cache, b, p, new, chunked=True, keep_cache=new == args.batch_new))
        ran.append(b)
        entry = dict(batch=b, new=new, ok=err is None)
        if err:
            entry.update(err, t_fail=time.perf_counter() - t0)
        else:
            entry.update(t=res["t"], peak=res["peak"], ttft=res.get("ttft"), step_timer=res.get("step_timer"))
        log_trials.append(entry)
        snapshot()
        if err and not err["oom"]:
            raise RuntimeError(err["error"])
        return res

    # probes: a linear model of peak memory and time in the batch size. Both probes run a full
    # --prefill-tokens forward (a chunked prefill keeps it there for larger batches), so the slope is the
    # memory per sequence (KV cache) and not the prefill activations of a growing forward
    b1 = max(1, min(args.max_batch_cap // 2, (args.prefill_tokens or 8 * p) // p))
    b2 = min(args.max_batch_cap, 2 * b1)
    r1 = r2 = None
    try:
        if given is None or b1 in trials:
            r1 = trials[b1] if b1 in trials else trial(b1, args.trial_new)
            if r1 is None and given is None:
                return dict(base, error=f"OOM at batch {b1}", search=log_trials, status="error", resumed=resumed)
            trials[b1] = r1
        if given is None and b2 > b1:
            r2 = trials[b2] if b2 in trials else trial(b2, args.trial_new)
            trials[b2] = r2
    except RuntimeError as exc:
        return dict(base, error=str(exc), search=log_trials, status="error", resumed=resumed)

    def model_of(key):
        if r1 is None or r2 is None or r1.get(key) is None or r2.get(key) is None:
            return None
        slope = (r2[key] - r1[key]) / (b2 - b1)
        return r1[key], slope

    mem, tim = model_of("peak"), model_of("t")

    def largest_fit():
        fit = [b for b, r in trials.items() if r is not None]
        return max(fit) if fit else None

    def est_time(b):
        rate, bl = ctx.get("prefill_rate"), largest_fit()
        ref = r2 or r1 or (trials[bl] if bl else {})
        ests = [0.0]
        if r1 is not None:
            ests += [r1["t"], r1["t"] * b / b1 if tim is None else tim[0] + tim[1] * (b - b1)]
        if rate:  # a first, cold probe can make the linear model too flat
            ests.append(b * p / rate + args.trial_new * (ref.get("step_timer") or 0.0))
        if bl and bl > b2:  # the largest fit past the probes, scaled: the probes' rate is optimistic
            ests.append(trials[bl]["t"] * b / bl)
        return max(ests)

    # the predicted maximum: the line through the smallest and the largest fits (the two probes in a fresh
    # search; a resumed one also has its recorded large fits)
    predicted, predicted_from = None, None
    start = 1
    pts = sorted((b, r["peak"]) for b, r in trials.items() if r is not None and r.get("peak") is not None)
    if (dev.cuda and len(pts) >= 2 and pts[-1][0] > pts[0][0] and budget and not args.no_predict
            and given is None):
        (ba, pa), (bb, pb) = pts[0], pts[-1]
        slope = (pb - pa) / (bb - ba)
        if slope > 0:
            predicted = bb + (budget * 0.98 - pb) / slope  # 2 %: allocator slack below the budget
            predicted_from = [ba, bb]
            start = max(1, int(predicted))
    if r2 is None:
        start = 1

    def fits(b: int) -> bool:  # asked only for batches without a trial (find_max_batch knows the trials)
        est = est_time(b)
        if not runner.fits_in_time(est):
            raise TimeBudget(f"trial at batch {b} (~{est:.0f} s) does not fit the time left ({runner.left():.0f} s)")
        res = trial(b, args.trial_new)
        trials[b] = res
        return res is not None

    def oom_above(b: int) -> int | None:  # the smallest batch above b that ran out of memory
        return min([k for k, r in trials.items() if r is None and k > b], default=None)

    stopped = None
    if given is not None:
        lo = given
        hi = oom_above(given)
    else:
        try:
            lo, hi = find_max_batch(fits, start, args.max_batch_cap, args.batch_tol,
                                    known={b: r is not None for b, r in trials.items()})
        except TimeBudget as exc:
            stopped = str(exc)
            lo = largest_fit() or 0
            hi = oom_above(lo)
        except RuntimeError as exc:
            return dict(base, error=str(exc), search=log_trials, predicted_batch=predicted, status="error",
                        resumed=resumed)
    row = dict(base, batch=lo, batch_oom=hi, predicted_batch=predicted,
               capped=given is None and lo >= args.max_batch_cap, search=log_trials, trial_new=args.trial_new,
               memory_model=None if mem is None else dict(bytes_at_1=mem[0], bytes_per_seq=mem[1]),
               search_stopped_early=stopped, batch_given=given is not None, resumed=resumed)
    if predicted_from and predicted_from != [b1, b2]:
        row["predicted_from"] = predicted_from
    if lo == 0:
        return dict(row, status="error", error="no batch fits the budget")
    tr = trials.get(lo)  # the last fitting trial at that batch (None: a given batch that was never tried)
    if tr and tr.get("cache_stats") is not None:  # a trial of --batch-new tokens at lo: no second generate
        res, err = tr, None
        row["measured_in_search"] = True
    else:
        res, err = measure_at(runner, ctx, cache, p, lo, tr, row, ran, b1, largest_fit, est_time, trials)
        if res is None and err is None:
            return row  # skipped for time (the row says so)
    if err and given is not None and err["oom"]:  # not a finished row: a later --resume can still search
        return dict(row, **err, status="skipped", skip_reason="given batch OOM")
    if err:
        return dict(row, **err, status="error")
    row.update(t_N_s=[res["t"]], t_trial_s=None if not tr or tr is res else tr["t"], step_timer_s=res.get("step_timer"),
               ttft_s=res.get("ttft"), peak_bytes=res["peak"], prefill_chunk=res["prefill_chunk"],
               prefill=res.get("prefill"), decode_alloc=res.get("decode_alloc"), **res.get("cache_stats", {}))
    maxbatch_rates(row, args.batch_new, args.trial_new)
    row.update(best_fit_rate(log_trials, args.batch_new))
    if dev.cuda and budget and res["peak"] and res["peak"] > budget:
        row["note"] = "peak above the budget: the memory fraction was not enforced"
    row["status"] = "ok"
    return row


def measure_at(runner, ctx, cache, p, lo, tr, row, ran, b1, largest_fit, est_time, trials):
    """The throughput generate of a max-batch row at batch ``lo`` (``--batch-new`` tokens, after a warm-up when
    nothing of this cache ran in the row). Returns (result, error); (None, None) when it did not fit the time
    left (``row`` is then marked skipped)."""
    args = runner.args
    if tr:
        est = tr["t"] + (args.batch_new - args.trial_new) * (tr.get("step_timer") or 0.0)
    else:
        rate, bl = ctx.get("prefill_rate"), largest_fit()
        step = (trials[bl].get("step_timer") if bl else None) or 0.1
        est = None if not rate else lo * p / rate + args.batch_new * step
    skipped = dict(status="skipped", skip_reason="time budget",
                   error=f"time budget: measurement at batch {lo} (~{est or 0:.0f} s) did not fit (use --resume)")
    if not ran:  # nothing of this cache ran in this row (recorded probes, a given batch): compile and settle first
        t0 = time.perf_counter()
        wb = min(lo, b1)
        if not runner.fits_in_time((est or 0.0) + (est_time(wb) or 0.0)):
            row.update(skipped)
            return None, None
        _, werr = attempt(lambda: run_generate(ctx, cache, wb, p, 2, chunked=True))
        row["warmup"] = dict(batch=wb, new=2, t=time.perf_counter() - t0, error=None if not werr else werr["error"])
    if not runner.fits_in_time(est):
        row.update(skipped)
        return None, None
    return attempt(lambda: run_generate(ctx, cache, lo, p, args.batch_new, keep_cache=True, chunked=True))


def best_fit_rate(trials: list[dict], n: int) -> dict:
    """The best decode rate among a search's fitting trials of ``n`` new tokens (batch / per-step timer): at its
    largest batch a cache can decode slower than a little below it (allocator retries near the budget, seen
    with fp16), so throughput ratios should be taken against the best rate within the budget."""
    rates = [(t["batch"] / t["step_timer"], t["batch"]) for t in trials
             if t.get("ok") and t.get("new") == n and t.get("step_timer")]
    if not rates:
        return {}
    rate, batch = max(rates)
    return dict(best_fit_tok_s=rate, best_fit_batch=batch)


def maxbatch_rates(row: dict, n: int, m: int) -> dict:
    """Decode rates of a max-batch row. The decode step is the per-step timer's median: at these batches a
    generate is mostly a chunked prefill of a million tokens whose time varies by seconds between runs, so
    the difference of two generates ((t_N - t_trial) / (N - trial), kept as ``decode_step_ms_tN``; None
    without a trial at that batch, as with ``--maxbatch-at``) is noise and can come out negative."""
    b, tn, tt, timer = row["batch"], row["t_N_s"][0], row.get("t_trial_s"), row.get("step_timer_s")
    step_tn = (tn - tt) / (n - m) if n > m and tt is not None else None
    row.update(decode_step_ms_tN=None if step_tn is None else step_tn * 1e3,
               decode_step_ms=None if not timer else timer * 1e3, step_ms_timer=None if not timer else timer * 1e3,
               decode_tok_s=None if not timer else b / timer, e2e_tok_s=b * n / tn,
               prefill_s=row.get("ttft_s"),
               step_method="per-step timer (median)")
    return row


# ----------------------------------------------------------------------------- profile

def kivi_kernel_names() -> list[str]:
    names = []
    try:
        from kivi_cache.kernels import decode_merge, decode_split, dequant, quantize  # noqa: PLC0415

        for mod in (decode_split, decode_merge, dequant, quantize):
            for name, obj in vars(mod).items():
                if type(obj).__name__ in ("JITFunction", "Autotuner", "Heuristics") and name.endswith("kernel"):
                    names.append(name)
    except Exception:  # noqa: BLE001
        pass
    return sorted(set(names)) or ["_decode_split_kernel", "_decode_reduce_kernel", "_quantize_write_kernel"]


def profile_phase(runner: Runner, ctx, mname: str) -> dict:
    """torch.profiler over ``--profile-steps`` decode steps of kivi-int4 at batch 1 (prefill not recorded)."""
    from torch.profiler import ProfilerActivity, profile, schedule  # noqa: PLC0415

    args, dev, model = runner.args, runner.dev, ctx["model"]
    steps, p = args.profile_steps, args.prompt
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.cuda else [])
    captured = []
    ids = prompt_ids(1, p, model.config.vocab_size, dev.device)

    class Step(StoppingCriteria):
        def __init__(self, prof):
            self.prof = prof

        def __call__(self, input_ids, scores, **kwargs):
            dev.sync()
            self.prof.step()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def run():
        cache = make_cache("kivi-int4", model, 1, p + steps + 3, args, runner.quanto)
        run_generate(ctx, "kivi-int4", 1, p, 8)  # warm
        with profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=steps, repeat=1),
                     on_trace_ready=lambda pr: captured.append(pr.events())) as prof:
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                               max_new_tokens=steps + 3, min_new_tokens=steps + 3, do_sample=False, pad_token_id=0,
                               stopping_criteria=StoppingCriteriaList([Step(prof)]))
        return True

    _, err = attempt(run)
    if err:
        return dict(model=mname, **err)
    if not captured:
        return dict(model=mname, error="the profiler captured no events")
    events = captured[-1]
    ours = kivi_kernel_names()
    agg: dict[str, list] = {}
    device_kind = "cuda" if dev.cuda else "cpu"
    def add(name, us):
        a = agg.setdefault(name, [0, 0.0])
        a[0] += 1
        a[1] += us

    for e in events:
        if dev.cuda:
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
                add(e.name, e.time_range.elapsed_us())
        elif not e.name.startswith("ProfilerStep"):  # CPU: self time of each op
            add(e.name, e.self_cpu_time_total)
    if dev.cuda and not agg:  # older layouts: kernels hang off their CPU ops
        for e in events:
            for k in getattr(e, "kernels", []) or []:
                add(k.name, k.duration)
    total = sum(v[1] for v in agg.values()) or 1.0
    table = []
    for name, (calls, us) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        low = name.lower()
        tag = "kivi" if any(k in name for k in ours) else (
            "attention-like" if any(k in low for k in ATTENTION_LIKE) else "")
        table.append(dict(name=name, calls=calls, total_us=us, share=us / total, us_per_step=us / steps, tag=tag))
    attn_like = [r["name"] for r in table if r["tag"] == "attention-like"]
    res = dict(model=mname, cache="kivi-int4", batch=1, prompt=p, decode_steps=steps, events=device_kind,
               total_us_per_step=total / steps, kivi_kernels=ours,
               kivi_share=sum(r["share"] for r in table if r["tag"] == "kivi"),
               attention_like_kernels=attn_like, top=table[: args.profile_top])
    log(f"\nprofile: {mname} kivi-int4, batch 1, prompt {p}, {steps} decode steps ({device_kind} events), "
        f"{total / steps / 1e3:.2f} ms of {device_kind} time per step")
    log(f"  {'kernel':<70}{'calls':>7}{'us/step':>10}{'share':>8}  tag")
    for r in table[: args.profile_top]:
        nm = r["name"] if len(r["name"]) <= 68 else r["name"][:65] + "..."
        log(f"  {nm:<70}{r['calls']:>7}{r['us_per_step']:>10.1f}{100 * r['share']:>7.1f}%  {r['tag']}")
    log("  decode attention kernels outside kivi_cache: " + (", ".join(attn_like) if attn_like else "none"))
    return res


# ----------------------------------------------------------------------------- output

def fmt(x, spec, none="-"):
    return none if x is None else format(x, spec)


def print_table(rows: list[dict]):
    hdr = (f"{'model':<10} {'case':<8} {'cache':<12} {'batch':>5} {'prompt+new':>12} {'tok/s':>9} {'step ms':>8} "
           f"{'timer ms':>8} {'prefill s':>9} {'peak GiB':>8} {'KV B/tok':>9} {'theory':>8}  status")
    log("\n" + hdr)
    log("-" * len(hdr))
    for r in rows:
        pk = None if r.get("peak_bytes") is None else r["peak_bytes"] / GiB
        status = r.get("status", "")
        if r.get("error"):
            status += ": " + r["error"][:70]
        elif r.get("note"):
            status += " (" + r["note"][:60] + ")"
        retries = (r.get("decode_alloc") or {}).get("alloc_retries")
        if retries:  # the allocator hit the budget while decoding: freed its cache and retried (slow steps)
            status += f" [{retries} allocator retries while decoding]"
        log(f"{r['model']:<10} {r['case']:<8} {r['cache']:<12} {fmt(r.get('batch'), '>5'):>5} "
            f"{str(r['prompt']) + '+' + str(r['new']):>12} {fmt(r.get('decode_tok_s'), '9.1f'):>9} "
            f"{fmt(r.get('decode_step_ms'), '8.2f'):>8} {fmt(r.get('step_ms_timer'), '8.2f'):>8} "
            f"{fmt(r.get('prefill_s'), '9.3f'):>9} {fmt(pk, '8.2f'):>8} {fmt(r.get('kv_bytes_per_token'), '9.0f'):>9} "
            f"{fmt(r.get('kv_bytes_per_token_theory'), '8.0f'):>8}  {status}")


def plots(result: dict, out_path: str) -> list[str]:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except Exception as exc:  # noqa: BLE001
        log(f"no plots: {err_text(exc)}")
        return []
    rows = [r for r in result["rows"] if r.get("status") == "ok"]
    models = [m for m in result["settings"]["models"] if any(r["model"] == m for r in rows)]
    if not models:
        return []
    stem = os.path.splitext(out_path)[0]
    files = []
    colors = {c: f"C{i}" for i, c in enumerate(ALL_CACHES)}
    # throughput vs batch size
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        for cache in result["settings"]["caches"]:
            prompts = sorted({r["prompt"] for r in rows if r["case"] == "maxbatch"} | {result["settings"]["prompt"]})
            for p, style in zip(prompts, itertools.cycle(("-o", "--s", ":^", "-.v")), strict=False):
                pts = {(r["batch"], r["decode_tok_s"]) for r in rows if r["model"] == m and r["cache"] == cache
                       and r["prompt"] == p and r["case"] in ("short", "maxbatch") and r.get("decode_tok_s")}
                for r in result["rows"]:  # max-batch searches' fitting trials (also of rows whose final
                    # measurement was skipped): more batch sizes, per-step timer over the trial's tokens
                    if r["model"] == m and r["cache"] == cache and r["prompt"] == p and r["case"] == "maxbatch":
                        pts |= {(t["batch"], t["batch"] / t["step_timer"]) for t in r.get("search", [])
                                if t.get("ok") and t.get("step_timer")}
                pts = sorted(pts)
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], style, color=colors.get(cache),
                            label=f"{cache}, prompt {p}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (largest point: max batch within the budget)")
        ax.set_ylabel("decode tokens / s")
        ax.set_title(f"{m}: decode throughput vs batch")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    f1 = stem + "_throughput.png"
    fig.savefig(f1, dpi=110)
    plt.close(fig)
    files.append(f1)
    # peak memory vs context length (batch 1)
    mem_rows = [r for r in rows if r["batch"] == 1 and r.get("peak_bytes")]
    if mem_rows:
        fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
        for ax, m in zip(axes[0], models, strict=True):
            for cache in result["settings"]["caches"]:
                pts = sorted((r["prompt"] + r["new"], r["peak_bytes"] / GiB) for r in mem_rows
                             if r["model"] == m and r["cache"] == cache)
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], "-o", color=colors.get(cache), label=cache)
            w = result["models"].get(m, {}).get("weight_bytes")
            if w:
                ax.axhline(w / GiB, color="gray", ls=":", label="weights")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (prompt + new tokens), batch 1")
            ax.set_ylabel("peak GPU memory (GiB)")
            ax.set_title(f"{m}: peak memory vs context")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        f2 = stem + "_memory.png"
        fig.savefig(f2, dpi=110)
        plt.close(fig)
        files.append(f2)
    return files


def git_commit() -> str | None:
    try:
        # "-dirty" when the working tree differs from HEAD (the device tool runs a copy of the working tree on the
        # checkout's last commit: without the flag its rows would name a commit they did not run)
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                              text=True, timeout=10, cwd=here).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def names(s: str, allowed) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    bad = [x for x in out if x not in allowed]
    if bad:
        raise SystemExit(f"unknown {bad}; choose from {list(allowed)}")
    return out


def parse_maxbatch_at(spec: str, args) -> dict:
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise SystemExit(f"--maxbatch-at {spec}: expected [MODEL:]CACHE:PROMPT:BATCH")
    model = parts[0] if len(parts) == 4 else None
    cache, prompt, batch = parts[-3:]
    try:
        prompt, batch = int(prompt), int(batch)
    except ValueError:
        raise SystemExit(f"--maxbatch-at {spec}: PROMPT and BATCH are integers") from None
    problems = []
    if model is not None and model not in args.models:
        problems.append(f"model {model} not in --models {args.models}")
    if cache not in args.caches:
        problems.append(f"cache {cache} not in --caches {args.caches}")
    if prompt not in args.batch_prompts:
        problems.append(f"prompt {prompt} not in --batch-prompts {args.batch_prompts}")
    if "maxbatch" not in args.cases:
        problems.append("maxbatch not in --cases")
    if batch < 1:
        problems.append("batch < 1")
    if problems:
        raise SystemExit(f"--maxbatch-at {spec}: " + "; ".join(problems))
    return dict(model=model, cache=cache, prompt=prompt, batch=batch)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None,
                    help="JSON path; the PNGs go beside it (default eval/results/bench_generate.json, with --quick "
                         "eval/results/bench_generate_quick.json: a smoke run never overwrites the recorded results)")
    ap.add_argument("--quick", action="store_true", help="tiny random Llama, few tokens (CPU-capable smoke run)")
    ap.add_argument("--models", default=None, help=f"comma list of {list(MODELS)} (default llama2-7b,llama3-8b)")
    ap.add_argument("--caches", default=None,
                    help=f"comma list of {list(ALL_CACHES)} (default: {list(CACHES)})")
    ap.add_argument("--cases", default=None, help=f"comma list of {list(CASES)} (default all)")
    ap.add_argument("--prompt", type=int, default=None, help="short case prompt (1024)")
    ap.add_argument("--new", type=int, default=None, help="short case new tokens (256)")
    ap.add_argument("--long-prompt", type=int, default=None, help="long case prompt (32768)")
    ap.add_argument("--long-new", type=int, default=None, help="long case new tokens (64)")
    ap.add_argument("--ctx-prompts", default=None, help="ctx case prompts (4096,8192,16384)")
    ap.add_argument("--ctx-new", type=int, default=None, help="ctx case new tokens (8)")
    ap.add_argument("--batch-prompts", default=None, help="maxbatch prompts (1024,4096)")
    ap.add_argument("--batch-new", type=int, default=None, help="new tokens of the max-batch measurement (64)")
    ap.add_argument("--trial-new", type=int, default=None,
                    help="new tokens of a max-batch search trial (default --batch-new: the trial at the batch found "
                         "is then its measurement)")
    ap.add_argument("--budget-gb", type=float, default=80.0, help="GPU memory budget in GiB (80)")
    ap.add_argument("--batch-tol", type=float, default=0.04, help="relative precision of the max batch (0.04)")
    ap.add_argument("--max-batch-cap", type=int, default=None, help="largest batch tried (2048)")
    ap.add_argument("--no-predict", action="store_true", help="max-batch search: plain doubling from batch 1")
    ap.add_argument("--prefill-tokens", type=int, default=None,
                    help="max batch: chunked prefill (generate's prefill_chunk_size) with about this many tokens "
                         "per forward over the batch, for every cache alike (0: one forward; default 65536)")
    ap.add_argument("--no-expandable", action="store_true",
                    help="do not set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by default)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per configuration (2)")
    ap.add_argument("--allow-fallback", action="store_true",
                    help="time kivi rows on a GPU even where the Triton kernels do not load (torch reference)")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run (510)")
    ap.add_argument("--min-row-s", type=float, default=None,
                    help="a max-batch row is not started with less time left (25 s)")
    ap.add_argument("--resume", action="store_true",
                    help="keep finished rows of --out, run only the others; an unfinished max-batch search "
                         "continues from its recorded trials")
    ap.add_argument("--resume-from", action="append", default=[], metavar="JSON",
                    help="(repeatable, implies --resume) also take rows from this result file: per row the "
                         "finished one, else the longest max-batch search log; the output is --out")
    ap.add_argument("--maxbatch-at", action="append", default=[], metavar="[MODEL:]CACHE:PROMPT:BATCH",
                    help="(repeatable) maxbatch row of CACHE at PROMPT: no search, measure throughput at BATCH "
                         "(row marked batch_given; recorded trials of a resumed row are kept)")
    ap.add_argument("--no-prealloc", action="store_true", help="kivi pools grow on demand instead")
    ap.add_argument("--quanto-group", type=int, default=64, help="quanto q_group_size (transformers default 64)")
    ap.add_argument("--quanto-residual", type=int, default=128, help="quanto residual_length (128)")
    ap.add_argument("--quanto-ext", action="store_true", help="let quanto compile and use its unpack extension")
    ap.add_argument("--profile", action="store_true", help="profile kivi-int4 decode steps (top CUDA kernels)")
    ap.add_argument("--profile-only", action="store_true", help="with --profile: skip the benchmark")
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--profile-top", type=int, default=20)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 with --quick, where small ops are slower threaded)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    args = ap.parse_args(argv)
    q = args.quick
    if args.out is None:
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                "bench_generate_quick.json" if q else "bench_generate.json")
    d = dict(models="tiny" if q else "llama2-7b,llama3-8b",
             caches="fp16,kivi-int4,quanto-int4" if q else ",".join(CACHES), cases=",".join(CASES),
             prompt=48 if q else 1024, new=16 if q else 256, long_prompt=200 if q else 32768,
             long_new=4 if q else 64, ctx_prompts="96" if q else "4096,8192,16384", ctx_new=3 if q else 8,
             batch_prompts="48" if q else "1024,4096", batch_new=6 if q else 64, trial_new=None,
             max_batch_cap=4 if q else 2048, repeats=1 if q else 2, time_budget=120.0 if q else 510.0,
             min_row_s=0.0 if q else 25.0, threads=1 if q else 0, prefill_tokens=64 if q else 65536)
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.models = names(args.models, MODELS)
    args.caches = names(args.caches, ALL_CACHES)
    args.cases = names(args.cases, CASES)
    args.ctx_prompts = ints(args.ctx_prompts)
    args.batch_prompts = ints(args.batch_prompts)
    args.trial_new = max(1, min(args.trial_new or args.batch_new, args.batch_new))
    args.resume = args.resume or bool(args.resume_from)
    args.maxbatch_at = [parse_maxbatch_at(x, args) for x in args.maxbatch_at]
    return args


def require_kernels(script: str, cuda: bool | None = None) -> None:
    """Exit where a GPU run would time kivi_cache's torch reference instead of its Triton kernels (they do not load:
    a bare checkout on the device without the ``kivi_cache/kernels`` link, as in session 26's first call)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    err = kivi_cache.kernel_error() if cuda else None
    if err is not None and kivi_cache.get_backend() != "torch":
        raise SystemExit(f"{script}: kivi_cache's Triton kernels do not load on this GPU ({err}); the kivi rows would "
                         "time the torch reference. Install the project (pip install -e .) or source "
                         "eval/device_env.sh (it links kernels/ as kivi_cache/kernels), or pass --allow-fallback "
                         "where the script has it")


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dev = Dev(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float16 if dev.cuda else torch.float32
    quanto_info = setup_quanto(args.quanto_ext) if any(c.startswith("quanto") for c in args.caches) else {
        "available": False, "error": "not requested", "unpack": None}
    kernels = kivi_cache.kernel_error() if dev.cuda else None
    if any(c.startswith("kivi") for c in args.caches) and not args.allow_fallback:
        require_kernels("bench_generate", cuda=dev.cuda)
    out_path = os.path.abspath(args.out)
    runner = Runner(args, dev, quanto_info, out_path)

    budget_bytes, total = None, None
    gpu = None
    if dev.cuda:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        total = props.total_memory
        budget_bytes = int(min(args.budget_gb * GiB, total))
        torch.cuda.set_per_process_memory_fraction(budget_bytes / total, idx)
        gpu = dict(name=props.name, total_memory=total, capability=f"{props.major}.{props.minor}",
                   multiprocessors=props.multi_processor_count)
    try:
        import triton  # noqa: PLC0415

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    settings = {k: v for k, v in vars(args).items()}
    settings["prealloc_rule"] = PREALLOC_RULE
    runner.result = dict(
        meta=dict(gpu=gpu, device=str(device), dtype=str(dtype).replace("torch.", ""), torch=torch.__version__,
                  cuda=torch.version.cuda, transformers=transformers.__version__, triton=triton_version,
                  kivi_cache=kivi_cache.__version__, kivi_backend=kivi_cache.get_backend(), git=git_commit(),
                  kivi_kernels="cpu" if not dev.cuda else (kernels or "triton"),
                  python=platform.python_version(), platform=platform.platform(), argv=sys.argv,
                  quanto=quanto_info, budget_bytes=budget_bytes,
                  memory_fraction=None if not total else budget_bytes / total,
                  alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                  started=time.strftime("%Y-%m-%d %H:%M:%S")),
        settings=settings, models={}, rows=[], profile=[])
    sources = ([out_path] if args.resume and os.path.exists(out_path) else [])
    sources += [f for f in map(os.path.abspath, args.resume_from) if f not in sources]
    if sources:
        old = runner.load_resume(sources)
        runner.result["models"] = old.get("models", {})
        runner.result["profile"] = old.get("profile", [])
        runner.memory_lines = list(old.get("memory_arithmetic", []))
        runner.result["resumed_from"] = old.get("meta", {}).get("started")
        runner.result["resumed_files"] = sources
        for k in ("models", "caches", "cases", "batch_prompts", "ctx_prompts"):  # the table and plots cover the
            # kept rows too (new lists: args keeps this run's)
            prev = old.get("settings", {}).get(k) or []
            runner.result["settings"][k] = list(dict.fromkeys(list(prev) + list(getattr(args, k))))
        searches = sum(1 for r in runner.pending.values() if r.get("search"))
        log(f"resume: keeping {len(runner.kept)} finished rows of {', '.join(sources)}; {len(runner.pending)} "
            f"unfinished rows are run again if requested ({searches} max-batch searches to continue)")
    elif args.resume:
        log(f"resume: {out_path} does not exist, starting afresh")

    log(f"bench_generate: {gpu['name'] if gpu else device} | torch {torch.__version__} | transformers "
        f"{transformers.__version__} | triton {triton_version} | budget "
        f"{'-' if budget_bytes is None else f'{budget_bytes / GiB:.0f} GiB'} | time budget {args.time_budget:.0f} s")
    q = quanto_info
    log("quanto: " + (f"available {q.get('version')}, unpack {q.get('unpack')}" if q["available"] else q["error"]))

    n_b1 = (len([c for c in args.cases if c in ("short", "long")]) * len(args.caches) * (1 + args.repeats)
            + (len(args.ctx_prompts) * len(args.caches) if "ctx" in args.cases else 0))
    n_mb = len(args.batch_prompts) * len(args.caches) if "maxbatch" in args.cases else 0
    bar = tqdm_bar(total=len(args.models) * ((0 if args.profile_only else n_b1 + n_mb) + (1 if args.profile else 0)),
                   desc="bench_generate", unit="run")
    for i, mname in enumerate(args.models):
        now = time.perf_counter()
        runner.model_deadline = now + (runner.deadline - now) / (len(args.models) - i)
        bar.set_postfix_str(f"building {mname}")
        t0 = time.perf_counter()
        model, err = attempt(lambda m=mname: build_model(m, device, dtype))
        if err:
            log(f"{mname}: could not build: {err['error']}")
            for case in args.cases:
                for cache in args.caches:
                    runner.add_row(dict(model=mname, case=case, cache=cache, batch=None, prompt=None, new=None,
                                        status="error", **err))
            continue
        gc.collect()
        gc.freeze()  # later collections (one per generate, for the caches' reference cycles) skip these objects
        shapes = model_shapes(model)
        shapes["build_s"] = time.perf_counter() - t0
        runner.result["models"][mname] = shapes
        ctx = dict(model=model, dev=dev, args=args, shapes=shapes, quanto=quanto_info, budget_bytes=budget_bytes)
        log(f"{mname}: {shapes['params'] / 1e9:.2f} B params, weights {shapes['weight_bytes'] / GiB:.2f} GiB, "
            f"fp KV {shapes['kv_bytes_per_token_fp'] / 1024:.0f} KiB/token, built in {shapes['build_s']:.1f} s")
        # first generate of the process (slow, not timed for any row); its cold prefill rate is dropped
        # (at 1k tokens it made a given batch of 120 x 4k look like 700 s); a warm batch-8 prefill gives
        # the rate for time estimates
        attempt(lambda c=ctx: run_generate(c, "fp16", 1, args.prompt, 2))
        ctx.pop("prefill_rate", None)
        attempt(lambda c=ctx: run_generate(c, "fp16", 8, args.prompt, 2))
        if not args.profile_only:
            batch1_phase(runner, ctx, mname, bar)
            if "maxbatch" in args.cases:
                maxbatch_phase(runner, ctx, mname, bar)
        if args.profile:
            bar.set_postfix_str(f"{mname} profile")
            prof = profile_phase(runner, ctx, mname)
            runner.result["profile"] = [p for p in runner.result["profile"] if p.get("model") != mname] + [prof]
            runner.save()
            bar.update(1)
        model = ctx = None
        gc.unfreeze()
        dev.free()
    bar.close()
    runner.save()
    rows = runner.result["rows"]
    print_table(rows)
    if runner.memory_lines:
        log("")
        for line in runner.memory_lines:
            log(line)
    if not args.no_plot:
        runner.result["plots"] = plots(runner.result, out_path)
        for f in runner.result["plots"]:
            log(f"plot: {f}")
    runner.save()
    skipped = [r for r in rows if r.get("skip_reason") == "time budget"]
    log(f"\n{len(rows)} rows ({sum(r.get('status') == 'ok' for r in rows)} ok, "
        f"{sum(r.get('status') == 'error' for r in rows)} errors, {len(skipped)} skipped for time) -> {out_path} "
        f"[{time.perf_counter() - T_START:.0f} s]")
    if skipped:
        log("rows skipped for the time budget: run the same command again with --resume to fill them")
    return runner.result


if __name__ == "__main__":
    main()

"""kivi_cache under transformers' tensor parallelism: ``model.generate`` decode throughput, per-GPU memory and the KV
bytes each rank holds, with fp16 and quantized caches, on one GPU or several (one script, the world size from the
environment).

    python benchmarks/tp.py                                   # one GPU: the model whole
    torchrun --nproc-per-node 2 benchmarks/tp.py              # two GPUs: tp_plan "auto" (KV heads split over ranks)
    torchrun --nproc-per-node 2 benchmarks/tp.py --shapes 1x32768,32x32768 --repeats 1   # the long shapes alone
    python benchmarks/tp.py --quick                           # tiny Llama, fp32 on the CPU (times are no result)
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tp.py --quick   # 2 CPU ranks (gloo)

Model (``--model``, default ``llama3-8b``): a Llama-3-8B-shaped ``LlamaForCausalLM`` with random weights (fp16 on
CUDA; ``--quick``: ``tiny``, 2 layers, 4 heads, 2 KV heads, head_dim 64, fp32 on the CPU), built by
``generate_models.build_model`` (seed 0, normal init straight on the device: every rank builds the same weights).
With ``WORLD_SIZE`` > 1 it is split with transformers' own tensor-parallel code, on one of two paths (``--load``):

* ``build`` (default): every rank builds the whole model on its GPU, then
  ``LlamaForCausalLM.prepare_distribute_model(DistributedConfig(tp_plan="auto"))`` (process group and device mesh)
  and ``maybe_distribute_model(model, ...)`` (the call ``from_pretrained`` makes between building the model and
  loading its weights) shard the parameters in place with the model's ``base_model_tp_plan``
  (``distribute_tensor(..., src_data_rank=None)``: each rank keeps its slice of its own copy, no communication) and
  install the forward hooks (a slice still a view of its whole tensor would then be copied, so that the whole one is
  freed: ``compact_shards``; with torch 2.13 ``distribute_tensor`` already copies). No checkpoint is written: an 8B
  model would take ~16 GB of disk and minutes to write and read. (transformers 5.25:
  ``integrations/tensor_parallel.py`` is only a shim of ``transformers.distributed.tensor_parallel``, which has no
  ``distribute_model``/``tensor_parallel(model)`` for a built model; the two classmethods above, of
  ``DistributedMixin``, are the steps of ``from_pretrained``, public but not documented.)
* ``disk``: rank 0 builds it and writes it with ``save_pretrained`` (safetensors) to ``--model-dir`` (default a
  temporary directory, removed at the end), a barrier, then every rank loads it with
  ``from_pretrained(dir, distributed_config=DistributedConfig(tp_plan="auto"))`` (tests/test_tp.py's path).

Both give the same sharded model (the same tokens in ``--quick`` runs on 2 CPU ranks; benchmarks/tests checks
``build``). The peak-memory counters are reset before every ``generate``, so the whole model's transient copy of the
``build`` path does not count (``allocated_after_build_per_rank`` says what each rank holds after it).

Caches (``--caches``): ``fp16`` (``DynamicCache``), ``fp16-static`` (transformers ``StaticCache``), ``kivi-int4``
(``kivi_cache.Int4PagedCache``, its pools preallocated for batch x (prompt + new), as benchmarks/generate.py does;
``--no-prealloc``: grown on demand) and ``kivi-int4-static`` (``kivi_cache.StaticQuantizedPagedCache(model,
prompt + new)``). On CUDA ``generate`` compiles the decode step of the two static caches (``--no-compile``: eager);
on the CPU they run eagerly. Shapes (``--shapes``): batch x prompt, default ``1x1024,32x1024,1x32768,32x32768``;
``--new-tokens`` (64) greedy tokens each. Prompts over ``--prefill-tokens`` (65536) tokens per batch are prefilled
in chunks (generate's ``prefill_chunk_size``; the static caches through ``kivi_cache.prefill``, eager), for every
cache alike.

Timing. Per shape: one warm-up ``generate`` of the same shape per cache (compiles, plans, allocations), for the static
caches a second short one (a compiled step is traced again once the other static cache has bound the attention
modules), then ``--repeats`` measured ``generate`` calls per cache, the cache order reversed every other repeat.
The harness's ``StepClock`` (a logits processor recording CUDA events, no sync) marks every token's logits: decode
step times are the intervals between consecutive tokens, the first one left out (``new - 2`` steps); ms/step is their
median, tokens/s = batch x steps / their sum; medians over the repeats. Prefill = from just before ``generate`` to
the first token's logits. Peak memory: ``torch.cuda.max_memory_allocated`` of the measured runs (reset before each;
weights included) on every rank, gathered to rank 0 (``all_gather_object``): the max and the list. KV bytes per rank:
``memory_report().live`` (and ``.allocated``) for kivi_cache's caches, the key and value tensors' bytes for
transformers' caches (``generate_models.cache_stats``). ``first_tokens``: the first 8 generated ids of sequence 0,
the same on every rank (``ranks_agree``) and over the repeats (``tokens_stable``); ``tokens_by_seq``: those of the
first 4 sequences (random weights often repeat one id in a sequence). Compare them between a one-GPU file and a TP
file (see the note printed).

Time: a 32x32768 generate prefills a million tokens (tens of seconds on an H100 per call, one warm-up and
``--repeats`` calls per cache, two warm-ups for the static ones); run the long shapes apart (``--shapes``,
``--repeats 1``, ``--time-budget``) where a command's time is limited. The JSON is written after every shape.

Every rank runs the same ``generate`` calls in the same order (tensor parallelism needs it): every decision (an
error, a shape that cannot fit, the time budget) is taken on gathered values. A shape whose KV alone exceeds the
free memory is not run (a row with ``"error": "OOM"``, ``predicted``); a run that raises out of memory is a row with
``"error": "OOM"`` and the run goes on. (An out-of-memory error raised on one rank only, inside a forward, would
leave the other ranks waiting in a collective until ``--dist-timeout``; the ranks allocate the same shapes, so OOMs
come on all of them.)

Output: ``benchmarks/results/tp_<gpu>x<world>_<date>.json`` (``--out``; ``_quick`` with ``--quick``), written by rank
0 after every shape: provenance, settings, the world size, the model's shapes, weight bytes per rank and one row per
(shape, cache); a table at the end.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

if "--quick" in sys.argv:  # the CPU run: transformers' TP mesh follows the accelerator it sees, so hide any GPU
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
if "--no-expandable" not in sys.argv:  # before torch touches CUDA: less fragmentation for every cache alike
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # kivi_cache from the checkout, without installing

import generate_models as gm  # noqa: E402
import harness as H  # noqa: E402
from transformers import LogitsProcessorList  # noqa: E402

import kivi_cache  # noqa: E402

CACHES = ("fp16", "fp16-static", "kivi-int4", "kivi-int4-static")
GiB, MiB = float(1 << 30), float(1 << 20)
FIRST = 8  # generated ids of sequence 0 kept per row
SEQS = 4  # ... and of the first sequences (tokens_by_seq: random weights can repeat one id in a sequence)
COLS = [("shape", "shape", ""), ("cache", "cache", ""), ("world_size", "ranks", "d"),
        ("decode_tok_s", "tok/s", ".1f"), ("step_ms", "ms/step", ".2f"), ("prefill_s", "prefill s", ".3f"),
        ("peak_gib", "peak GiB (max rank)", ".2f"), ("kv_mib", "KV MiB/rank", ".2f"), ("compiled", "compiled", ""),
        ("first_tokens", "first tokens (seq 0)", ""), ("error", "error", "")]
TOKENS_NOTE = ("first_tokens: the first {n} greedy ids of sequence 0. Compare them between a one-GPU file and a TP "
               "file (same model, shape, cache): equal tokens say that the sharded model computes what the whole one "
               "does. On a GPU in fp16 they may part after a few tokens even so (random weights give nearly equal "
               "top logits; TP sums partial products in another order), on the CPU in fp32 they agree (the tests).")


# ----------------------------------------------------------------------------- ranks

class Ranks:
    """The processes of the run: ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` from torchrun (1 / 0 / 0 without)."""

    def __init__(self, use_cuda: bool, timeout_s: float):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        self.cuda = use_cuda
        self.device = torch.device("cuda", self.local if self.world > 1 else torch.cuda.current_device()) \
            if use_cuda else torch.device("cpu")
        self.started = False
        if self.world > 1:
            if use_cuda:
                torch.cuda.set_device(self.device)
            if not dist.is_initialized():
                kw = dict(device_id=self.device) if use_cuda else {}
                dist.init_process_group("nccl" if use_cuda else "gloo",
                                        timeout=datetime.timedelta(seconds=timeout_s), **kw)
                self.started = True

    @property
    def main(self) -> bool:
        return self.rank == 0

    def gather(self, obj) -> list:
        """``obj`` of every rank, in rank order (every rank calls it)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def from_main(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self):
        if self.world > 1:
            dist.barrier()

    def close(self):
        if self.world > 1 and self.started and dist.is_initialized():
            dist.destroy_process_group()


def log(ranks: Ranks, *a):
    if ranks.main:
        H.log(*a)


# ----------------------------------------------------------------------------- model

def local_bytes(model) -> int:
    """Bytes of the parameters and buffers this rank holds (its slices of the sharded ones)."""
    from torch.distributed.tensor import DTensor

    n = 0
    for t in list(model.parameters()) + list(model.buffers()):
        t = t.to_local() if isinstance(t, DTensor) else t
        n += t.numel() * t.element_size()
    return n


def compact_shards(model) -> int:
    """Replaces every sharded parameter whose local slice is a view of a larger tensor (``distribute_tensor`` with
    ``src_data_rank=None`` slices each rank's whole copy) by a copy of the slice, so that the whole tensor is freed.
    Returns the number replaced."""
    from torch.distributed.tensor import DTensor

    done = 0
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if not isinstance(p, DTensor):
                continue
            loc = p.to_local()
            if loc.untyped_storage().nbytes() <= loc.numel() * loc.element_size():
                continue
            new = DTensor.from_local(loc.clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                     stride=p.stride())
            module._parameters[name] = torch.nn.Parameter(new, requires_grad=False)
            done += 1
    return done


def finish(model):
    model.eval().requires_grad_(False)
    g = model.generation_config
    g.pad_token_id, g.bos_token_id, g.eos_token_id = 0, 1, 2
    return model


def build_tp(name: str, ranks: Ranks, dtype: torch.dtype):
    """Random weights on every rank, then transformers' tensor-parallel sharding of the built model."""
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    dcfg, _, mesh = LlamaForCausalLM.prepare_distribute_model(DistributedConfig(tp_plan="auto"))
    model = gm.build_model(name, ranks.device, dtype)
    model = LlamaForCausalLM.maybe_distribute_model(model, dcfg, mesh)
    replaced = compact_shards(model)
    return finish(model), replaced


def load_from_disk(name: str, ranks: Ranks, dtype: torch.dtype, model_dir: str | None):
    """Rank 0 builds and saves (safetensors), every rank loads with ``tp_plan="auto"`` (whole where world size 1)."""
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    made = model_dir is None
    path = ranks.from_main(tempfile.mkdtemp(prefix="kivi_tp_") if ranks.main and made else model_dir)
    if ranks.main:
        model = gm.build_model(name, ranks.device, dtype)
        model.save_pretrained(path)
        del model
        gm.Dev(ranks.device).free()
    ranks.barrier()
    kw = dict(distributed_config=DistributedConfig(tp_plan="auto")) if ranks.world > 1 else dict(
        device_map=ranks.device)
    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **kw)
    ranks.barrier()
    if made and ranks.main:
        shutil.rmtree(path, ignore_errors=True)
    return finish(model), path


# ----------------------------------------------------------------------------- one generate

def _mark(cuda: bool):
    if cuda:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


def run_generate(ctx: dict, cache_name: str, batch: int, prompt: int, new: int, cache_len: int,
                 stats: bool = False) -> dict:
    """One ``generate`` of ``batch`` x ``prompt`` random ids and ``new`` greedy tokens with a fresh cache (static
    caches: ``max_cache_len=cache_len``); its step times (StepClock), prefill time, peak memory, first tokens, and with
    ``stats`` the cache's bytes. Raises on failure."""
    model, dev, args = ctx["model"], ctx["dev"], ctx["args"]
    ids = gm.prompt_ids(batch, prompt, model.config.vocab_size, dev.device)
    static = cache_name.endswith("static")
    total = cache_len if static else prompt + new
    chunk = gm.prefill_chunk(args, batch, prompt)
    eager_prefill = chunk is not None and static  # see generate_models.run_generate
    extra = {} if chunk is None or eager_prefill else {"prefill_chunk_size": chunk}
    if args.no_compile:
        extra["disable_compile"] = True
    cache = gm.make_cache(cache_name, model, batch, total, args, None)
    clock = H.StepClock(dev.cuda)
    dev.free()
    dev.reset_peak()
    dev.sync()
    held = dev.allocated()
    mask = torch.ones_like(ids)
    start = _mark(dev.cuda)
    with torch.no_grad():
        if eager_prefill:
            kivi_cache.prefill(model, cache, ids, attention_mask=mask, chunk_size=chunk)
        out = model.generate(ids, attention_mask=mask, **kivi_cache.cache_kwargs(model, cache), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([clock]), **extra)
    steps = clock.steps_ms()  # synchronizes
    first = clock.marks[0] if clock.marks else None
    prefill_ms = None if first is None else (start.elapsed_time(first) if dev.cuda else (first - start) * 1e3)
    res = dict(steps_ms=steps if len(clock.marks) >= 4 else [], prefill_ms=prefill_ms, peak=dev.peak(),
               held_before=held,
               generated=int(out.shape[1] - prompt), first_tokens=out[0, prompt:prompt + FIRST].tolist(),
               tokens_by_seq=out[:SEQS, prompt:prompt + FIRST].tolist(),
               compiled=hasattr(model, "_compiled_call"), prefill_chunk=chunk,
               prefill="kivi_cache.prefill" if eager_prefill else "generate")
    del out
    if res["generated"] != new:
        raise RuntimeError(f"generate produced {res['generated']} tokens instead of {new}")
    if stats:
        st = gm.cache_stats(cache_name, cache, batch, ctx["shapes"])
        res.update(kv_bytes=st["kv_bytes"], kv_bytes_allocated=st["kv_bytes_allocated"],
                   cached_tokens_per_seq=st["cached_tokens_per_seq"])
        rep = st.get("kv_report") or {}
        if rep:
            res["quantized_tokens"] = rep.get("quantized_tokens")
    del cache, ids, mask
    return res


def attempt(fn) -> tuple[dict | None, dict | None]:
    res, err = gm.attempt(fn)
    if err is not None:
        err = dict(error="OOM" if err["oom"] else err["error"], oom=err["oom"], detail=err["error"])
    return res, err


def agree(ranks: Ranks, res: dict | None, err: dict | None) -> tuple[list, dict | None]:
    """Every rank's result; the first error of any rank (the same on every rank)."""
    got = ranks.gather((res, err))
    errs = [(r, e) for r, (_, e) in enumerate(got) if e is not None]
    if not errs:
        return [g[0] for g in got], None
    r, e = errs[0]
    oom = any(e["oom"] for _, e in errs)
    return [g[0] for g in got], dict(error="OOM" if oom else e["error"], oom=oom, detail=e["detail"], rank=r)


# ----------------------------------------------------------------------------- a shape

def kv_predicted(cache: str, shapes: dict, batch: int, total: int, world: int) -> float:
    """Bytes of KV per rank a cache holds for batch x total tokens (quantized: plus a 128-token fp window)."""
    theory = gm.kv_theory(cache, shapes, None)
    window = 0 if cache.startswith("fp16") else 128 * shapes["kv_bytes_per_token_fp"]
    return batch * (total * theory + window) / world


def shape_phase(ctx: dict, batch: int, prompt: int, rows: list, save) -> None:
    ranks, args, dev, shapes = ctx["ranks"], ctx["args"], ctx["dev"], ctx["shapes"]
    new, total = args.new_tokens, prompt + args.new_tokens
    base = dict(model=args.model, shape=f"{batch}x{prompt}", batch=batch, prompt=prompt, new=new,
                world_size=ranks.world)
    out: dict[str, dict] = {c: dict(base, cache=c) for c in args.caches}
    alive = []
    free = None
    if dev.cuda:
        dev.free()
        free = min(ranks.gather(torch.cuda.mem_get_info(dev.device)[0]))
    for c in args.caches:
        need = kv_predicted(c, shapes, batch, total, ranks.world)
        out[c]["kv_bytes_predicted"] = need
        if free is not None and need > free:
            out[c].update(status="error", error="OOM", oom=True, predicted=True,
                          detail=f"not run: KV alone {need / GiB:.1f} GiB per rank > {free / GiB:.1f} GiB free")
        else:
            alive.append(c)
    # warm-up: one generate of the same shape per cache (a few new tokens; the static caches' max_cache_len as measured)
    warm_new = max(2, min(new, 16))
    for c in list(alive):
        log(ranks, f"  {base['shape']} {c}: warm-up")
        t = time.perf_counter()
        res, err = attempt(lambda c=c: run_generate(ctx, c, batch, prompt, warm_new, total))
        got, err = agree(ranks, res, err)
        if err:
            out[c].update(status="error", phase="warm-up", **err)
            alive.remove(c)
            continue
        out[c]["warmup_s"] = time.perf_counter() - t
        out[c]["warmup_tokens"] = got[0]["first_tokens"]
    for c in [c for c in alive if c.endswith("static")] if dev.cuda and not args.no_compile else []:
        res, err = attempt(lambda c=c: run_generate(ctx, c, batch, prompt, 3, total))
        agree(ranks, res, err)
    meas = {c: [] for c in alive}
    errors = {c: [] for c in alive}
    for r in range(args.repeats):
        for c in alive if r % 2 == 0 else alive[::-1]:
            if errors[c] and not meas[c]:
                continue
            res, err = attempt(lambda c=c, r=r: run_generate(ctx, c, batch, prompt, new, total, stats=(r == 0)))
            got, err = agree(ranks, res, err)
            if err:
                errors[c].append(err)
                continue
            meas[c].append(got)
            g0 = got[0]
            ms = H.median(g0["steps_ms"])
            log(ranks, f"  {base['shape']} {c} repeat {r + 1}/{args.repeats}: "
                       f"{'-' if ms is None else f'{ms:.3f}'} ms/step, first tokens {g0['first_tokens']}")
    for c in alive:
        row = out[c]
        if not meas[c]:
            row.update(status="error", phase="measure", **errors[c][0])
            continue
        per_rep = []
        for got in meas[c]:
            s = got[0]["steps_ms"]
            per_rep.append(dict(step_ms=H.median(s), step_ms_mean=sum(s) / len(s) if s else None,
                                tok_s=batch * len(s) / (sum(s) / 1e3) if s and sum(s) > 0 else None,
                                prefill_s=None if got[0]["prefill_ms"] is None else got[0]["prefill_ms"] / 1e3))
        first = meas[c][0]
        peaks = [max((got[k]["peak"] or 0) for got in meas[c]) for k in range(ranks.world)] if dev.cuda else None
        row.update(status="ok", error=None, repeats=len(meas[c]), decode_steps=len(first[0]["steps_ms"]),
                   decode_tok_s=H.median(p["tok_s"] for p in per_rep),
                   step_ms=H.median(p["step_ms"] for p in per_rep),
                   step_ms_mean=H.median(p["step_ms_mean"] for p in per_rep),
                   prefill_s=H.median(p["prefill_s"] for p in per_rep), per_repeat=per_rep,
                   step_ms_per_rank=[H.median(g["steps_ms"]) for g in first],
                   peak_bytes=max(peaks) if peaks else None, peak_bytes_per_rank=peaks,
                   peak_gib=max(peaks) / GiB if peaks else None,
                   held_before_bytes_per_rank=[g["held_before"] for g in first] if dev.cuda else None,
                   kv_bytes=first[0]["kv_bytes"], kv_bytes_per_rank=[g["kv_bytes"] for g in first],
                   kv_bytes_allocated_per_rank=[g["kv_bytes_allocated"] for g in first],
                   kv_mib=first[0]["kv_bytes"] / MiB, cached_tokens_per_seq=first[0]["cached_tokens_per_seq"],
                   quantized_tokens=first[0].get("quantized_tokens"),
                   first_tokens=first[0]["first_tokens"], tokens_by_seq=first[0]["tokens_by_seq"],
                   ranks_agree=all(g["tokens_by_seq"] == first[0]["tokens_by_seq"] for g in first),
                   tokens_stable=all(got[0]["tokens_by_seq"] == first[0]["tokens_by_seq"] for got in meas[c]),
                   compiled=first[0]["compiled"] and c.endswith("static"), prefill=first[0]["prefill"],
                   prefill_chunk=first[0]["prefill_chunk"])
        if errors[c]:
            row["note"] = f"{len(errors[c])} repeat(s) failed: {errors[c][0]['detail']}"
    rows.extend(out[c] for c in args.caches)
    save()


# ----------------------------------------------------------------------------- options and main

def parse_shapes(s: str) -> list[tuple[int, int]]:
    out = []
    for part in (p.strip() for p in s.split(",") if p.strip()):
        try:
            b, p = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: {part!r} is not BATCHxPROMPT (e.g. 32x1024)") from None
        if b < 1 or p < 1:
            raise SystemExit(f"--shapes: {part!r}: batch and prompt must be positive")
        out.append((b, p))
    if not out:
        raise SystemExit("--shapes: no shape given")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = H.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--model", default=None, choices=sorted(gm.MODELS),
                    help="random-weight Llama shape (default llama3-8b; tiny with --quick)")
    ap.add_argument("--caches", default=",".join(CACHES), help=f"comma list of {list(CACHES)} (default all)")
    ap.add_argument("--shapes", default=None,
                    help="comma list of BATCHxPROMPT (default 1x1024,32x1024,1x32768,32x32768; --quick 1x64,2x160)")
    ap.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per sequence (64; --quick 8)")
    ap.add_argument("--repeats", type=int, default=2, help="measured generates per cache and shape (2)")
    ap.add_argument("--load", choices=("build", "disk"), default=None,
                    help="build: random weights on every rank, sharded in place (default where transformers has "
                         "prepare_distribute_model, >= 5.24); disk: rank 0 saves, every rank loads with tp_plan auto "
                         "(the default before)")
    ap.add_argument("--model-dir", default=None, help="--load disk: where the model is saved (default a temp dir)")
    ap.add_argument("--prefill-tokens", type=int, default=65536,
                    help="chunked prefill with about this many tokens per forward over the batch (0: one forward)")
    ap.add_argument("--no-prealloc", action="store_true", help="kivi-int4 pools grow on demand")
    ap.add_argument("--no-compile", action="store_true", help="static caches run eagerly on CUDA too")
    ap.add_argument("--no-expandable", action="store_true",
                    help="do not set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by default)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds: no shape starts after it (rank 0's clock)")
    ap.add_argument("--dist-timeout", type=float, default=1800.0, help="process-group timeout in seconds (1800)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 with --quick)")
    args = ap.parse_args(argv)
    q = args.quick
    args.model = args.model or ("tiny" if q else "llama3-8b")
    args.shapes = args.shapes or ("1x64,2x160" if q else "1x1024,32x1024,1x32768,32x32768")
    args.new_tokens = args.new_tokens or (8 if q else 64)
    if args.threads is None:
        args.threads = 1 if q else 0
    args.caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    bad = [c for c in args.caches if c not in CACHES]
    if bad or not args.caches:
        ap.error(f"--caches: unknown {bad} (caches: {', '.join(CACHES)})")
    args.shape_list = parse_shapes(args.shapes)
    if args.new_tokens < 4:
        ap.error("--new-tokens must be at least 4 (the first decode step is left out of the timing)")
    if args.repeats < 1:
        ap.error("--repeats must be positive")
    return args


def result_path(args, rec: dict, world: int) -> Path:
    if args.out:
        return Path(args.out)
    date = datetime.date.today().isoformat()
    return H.RESULTS / f"tp_{H.gpu_tag(rec['machine'])}x{world}_{date}{'_quick' if args.quick else ''}.json"


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    prev_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available() and not args.quick
    if not cuda and not args.quick:
        raise SystemExit("no CUDA device: use --quick for the CPU smoke run")
    ranks = Ranks(cuda, args.dist_timeout)
    try:
        return _run(args, ranks)
    finally:
        ranks.close()
        torch.set_num_threads(prev_threads)


def _run(args, ranks: Ranks) -> dict | None:
    t_start = time.perf_counter()
    dev = gm.Dev(ranks.device)
    dtype = torch.float16 if dev.cuda else torch.float32
    if dev.cuda and any(c.startswith("kivi") for c in args.caches):
        gm.require_kernels("tp", cuda=True)
    t = time.perf_counter()
    if args.load is None:
        from transformers import LlamaForCausalLM

        args.load = "build" if hasattr(LlamaForCausalLM, "prepare_distribute_model") else "disk"
    if args.load == "build" and ranks.world > 1:
        model, replaced = build_tp(args.model, ranks, dtype)
        how = ("build: random weights on every rank, LlamaForCausalLM.prepare_distribute_model + "
               "maybe_distribute_model (DistributedConfig(tp_plan='auto')), "
               f"{replaced} shards copied out of the whole tensors")
    elif args.load == "build":
        model, how = finish(gm.build_model(args.model, ranks.device, dtype)), "build: random weights, whole model"
    else:
        model, path = load_from_disk(args.model, ranks, dtype, args.model_dir)
        how = (f"disk: save_pretrained by rank 0 to {path}, from_pretrained"
               + (" with DistributedConfig(tp_plan='auto')" if ranks.world > 1 else ""))
    build_s = time.perf_counter() - t
    dev.free()
    c = model.config
    shapes = dict(gm.MODELS[args.model], layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads,
                  head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                  dtype=str(dtype).replace("torch.", ""),
                  params=sum(p.numel() for p in model.parameters()))
    shapes["kv_bytes_per_token_fp"] = 2 * shapes["layers"] * shapes["kv_heads"] * shapes["head_dim"] * (
        torch.finfo(dtype).bits // 8)
    weights = ranks.gather(local_bytes(model))
    allocated = ranks.gather(dev.allocated())
    tp_plan = dict(getattr(model, "tp_plan", None) or {}) if ranks.world > 1 else {}
    ctx = dict(model=model, dev=dev, args=args, shapes=shapes, ranks=ranks)

    rec, out = None, None
    if ranks.main:
        rec = H.record("tp", args, ranks.device, world_size=ranks.world, device=str(ranks.device),
                       dtype=shapes["dtype"], load=how, build_s=build_s, model_shapes=shapes,
                       weight_bytes_per_rank=weights, allocated_after_build_per_rank=allocated,
                       kv_heads_per_rank=shapes["kv_heads"] // ranks.world if tp_plan else shapes["kv_heads"],
                       tp_plan=tp_plan, kivi_cache=kivi_cache.__version__, kivi_backend=kivi_cache.get_backend(),
                       kivi_kernels=(kivi_cache.kernel_error() or "triton") if dev.cuda else "cpu",
                       alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                       timing=("StepClock CUDA events between consecutive tokens' logits, the first interval left out; "
                               "median per generate, medians over repeats, cache order reversed every other repeat"
                               if dev.cuda else "CPU wall clock: no speed result"),
                       tokens_note=TOKENS_NOTE.format(n=FIRST))
        rec["settings"]["shapes"] = [f"{b}x{p}" for b, p in args.shape_list]
        out = result_path(args, rec, ranks.world)
        m = rec["machine"]
        H.log(f"tp: {m.get('gpu') or 'CPU'} x {ranks.world} | {args.model} {shapes['dtype']} | torch {m['torch']} | "
              f"transformers {m['transformers']} | {how} | weights {weights[0] / GiB:.2f} GiB per rank | "
              f"built in {build_s:.1f} s -> {out}")
    rows: list[dict] = []

    def save():
        if ranks.main:
            rec["rows"] = rows
            rec["elapsed_s"] = time.perf_counter() - t_start
            H.save(out, rec)

    save()
    for batch, prompt in args.shape_list:
        late = args.time_budget is not None and time.perf_counter() - t_start > args.time_budget
        if ranks.from_main(late):
            for cch in args.caches:
                rows.append(dict(model=args.model, shape=f"{batch}x{prompt}", batch=batch, prompt=prompt,
                                 new=args.new_tokens, world_size=ranks.world, cache=cch, status="skipped",
                                 error="time budget"))
            save()
            continue
        log(ranks, f"shape {batch}x{prompt} + {args.new_tokens}")
        shape_phase(ctx, batch, prompt, rows, save)
    if not ranks.main:
        return None
    rec["complete"] = not any(r.get("status") == "skipped" for r in rows)
    save()
    print(H.table(rows, COLS))
    H.log("\n" + TOKENS_NOTE.format(n=FIRST))
    H.log(f"\n{len(rows)} rows ({sum(r.get('status') == 'ok' for r in rows)} ok) -> {out} "
          f"[{time.perf_counter() - t_start:.0f} s]")
    return rec


if __name__ == "__main__":
    main()

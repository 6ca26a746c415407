"""End-to-end ``model.generate`` benchmark: kivi_cache's quantized paged caches against transformers' fp16 and
quanto caches, on Llama models with random weights.

Per model, cache and case it measures decode tokens/s and step time, prefill time, peak GPU memory and the KV bytes
per token (measured and in theory), and the largest batch whose ``generate`` fits a memory budget.

    python benchmarks/generate.py --preset readme   # the README's rows: llama3-8b, fp16/int4/int2, short + max batch 4k
    python benchmarks/generate.py                   # every model x cache x case; again with --resume for the rest
    python benchmarks/generate.py --resume          # keeps the finished rows of --out, runs the others
    python benchmarks/generate.py --models llama3-8b --cases maxbatch --batch-prompts 4096 --caches kivi-int2 \\
        --maxbatch-at kivi-int2:4096:417            # throughput at batch 417, no search
    python benchmarks/generate.py --profile --profile-only --models llama3-8b   # the decode step's kernels
    python benchmarks/generate.py --quick           # tiny random model, CPU smoke run
    python benchmarks/generate.py --merge A.json B.json --out C.json   # one result from several (no GPU)

Several GPUs of one host: one command per GPU (``CUDA_VISIBLE_DEVICES=i``, its own ``--caches``/``--cases`` and
``--out``), then ``--merge``.

Output: ``benchmarks/results/generate_<gpu>_<date>.json`` (``--out``; ``_quick`` with ``--quick``), written after
every row and every max-batch trial: provenance (machine, versions, commit, command; ``--commit`` where the tree has
no ``.git``), settings, model shapes and one row per (model, case, cache, prompt). A table at the end, and
``<stem>_throughput.png`` / ``<stem>_memory.png`` beside the JSON (``plot()``; ``benchmarks/plots.py`` redraws them).

Models (``--models``): ``llama2-7b`` (32 layers, 32 KV heads, vocab 32000) and ``llama3-8b`` (32 layers, 8 KV
heads, vocab 128256, rope_theta 5e5), built from their configs with random fp16 weights on the GPU (no download).

Caches (``--caches``): ``fp16`` (transformers ``DynamicCache``); ``quanto-int4`` / ``quanto-int2``
(``QuantizedCache(backend="quanto")``, group ``--quanto-group``, residual ``--quanto-residual``; rows ``skipped``
with the ImportError text where optimum-quanto is missing; its unpack op runs in pure PyTorch unless
``--quanto-ext``); ``kivi-int4`` / ``kivi-int2`` (``Int4PagedCache`` / ``Int2PagedCache``, pools preallocated for
the known final length through ``max_batch_size``/``max_cache_len``; ``--no-prealloc``: grown on demand). Opt-in:
``fp16-static`` and ``kivi-int4-static`` (compiled decoding), ``kivi-kv2`` (2-bit keys and values), ``kivi-int4-r32``
and ``kivi-kv2-r32`` (32-token window), ``kivi-int4-g64`` (64-token groups); the Int2 preset with rotated keys and
values (``-rot``: ``QuantConfig.rotate``) or without its clipped key groups (``-noclip``: ``QuantConfig.clip``), eager
(``kivi-int2-rot``, ``kivi-int2-noclip``, ``kivi-kv2-rot``) or compiled (``kivi-int2-static`` and those names +
``-static``).

Cases (``--cases``): ``short`` (batch 1, ``--prompt`` + ``--new``), ``long`` (batch 1, ``--long-prompt`` +
``--long-new``), ``ctx`` (batch 1, one cold run per ``--ctx-prompts`` length: peak memory against context) and
``maxbatch`` (per ``--batch-prompts`` length, the largest batch within ``--budget-gb``, enforced with
``torch.cuda.set_per_process_memory_fraction``; see generate_search.py).

Timing. Batch 1: one warm-up generate per configuration, then ``--repeats`` measurements interleaved across
configurations, the order reversed every other repeat; decode step = (t_N - t_1) / (N - 1) of a generate of N and
one of 1 new token, prefill = t_1, medians. A per-step timer (a stopping criterion that synchronizes and stamps each
token) gives ``step_ms_timer`` and the time to the first token; it is the decode step of max-batch rows. Peak memory
is ``torch.cuda.max_memory_allocated`` of the t_N run. KV bytes per token: measured from the cache after the run
(kivi: ``memory_report()``) and in theory (codes plus scales and zero points, no window).

Time budget and resume. ``--time-budget`` seconds, counted from start-up and split evenly over the models; batch-1
rows come first, and work whose estimated cost does not fit is not started (``status: "skipped"``,
``skip_reason: "time budget"``; a max-batch search cut short keeps its largest fitting batch, a lower bound marked
``search_stopped_early``). The same command with ``--resume`` keeps the finished rows of ``--out`` and runs
the others; an unfinished max-batch search continues from its recorded trials (those recorded under other settings
are not reused: ``resume_note``). ``--resume-from FILE`` also takes rows from other result files. One failing
configuration (OOM, error) is recorded in its row and the run goes on.

``--profile``: torch.profiler over ``--profile-steps`` decode steps of kivi-int4 at batch 1; the top kernels are
printed and saved under ``profile`` (decode attention should run only kivi_cache's kernels, tag ``kivi``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
import time
from pathlib import Path

T_START = time.perf_counter()

if "--no-expandable" not in sys.argv:  # before torch touches CUDA: less fragmentation for every cache alike
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # kivi_cache from the checkout, without installing

import generate_cases  # noqa: E402
import generate_models as gm  # noqa: E402
import generate_report  # noqa: E402
import generate_search  # noqa: E402
import harness  # noqa: E402
from generate_models import GiB, log  # noqa: E402
from generate_report import row_rank  # noqa: E402

import kivi_cache  # noqa: E402

CASES = ("short", "long", "ctx", "maxbatch")
# settings under which a recorded max-batch trial is valid for a resumed search
REUSE_SETTINGS = ("prefill_tokens", "no_prealloc", "no_expandable", "quanto_group", "quanto_residual")
PRESETS = {
    # the README's end-to-end rows: batch 1 at 1k + 256 tokens and the max batch at 4k + 64 within 80 GiB
    "readme": dict(models="llama3-8b", caches="fp16,kivi-int4,kivi-int2", cases="short,maxbatch",
                   batch_prompts="4096", time_budget=300.0),
}


def quanto_installed() -> bool:
    try:
        return importlib.util.find_spec("optimum.quanto") is not None
    except ModuleNotFoundError:  # no optimum at all
        return False


def plot(rec: dict, stem: Path) -> list[Path]:
    """The throughput and memory plots of a result dict: ``<stem>_throughput.png``, ``<stem>_memory.png``."""
    return generate_report.plot(rec, stem)


class Runner:
    """The rows of a run, the rows kept from resumed files, the time budget and the JSON output."""

    def __init__(self, args, dev, quanto_info: dict, out_path: str | Path, rec: dict | None = None):
        self.args, self.dev, self.quanto = args, dev, quanto_info
        self.out_path = Path(out_path)
        self.rows: list[dict] = []
        self.kept: dict = {}  # finished rows of the resumed files: not run again
        self.pending: dict = {}  # their unfinished rows: in the JSON until run again (max batch: trials reused)
        self.pending_src: dict = {}
        self.in_progress: dict | None = None  # the max-batch row being searched, as far as it got
        self.result = rec if rec is not None else {}
        self.deadline = T_START + args.time_budget
        self.model_deadline = self.deadline
        self.memory_lines: list[str] = []

    def left(self) -> float:
        return self.model_deadline - time.perf_counter()

    def fits_in_time(self, est: float | None) -> bool:
        return est is None or time.perf_counter() + est <= self.model_deadline

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

    def save_partial(self, row: dict):
        """The unfinished row being worked on, saved now (replaced by ``add_row``)."""
        self.in_progress = row
        self.save()

    def load_resume(self, paths: list[Path]) -> dict | None:
        """Rows of earlier result files (``--resume``: ``--out``, then ``--resume-from`` files). Per key the
        best row is used (``row_rank``; ties: the earlier file). Returns the first file's content."""
        import json  # noqa: PLC0415

        keep_import = not self.quanto["available"]
        best, first = {}, None
        for path in paths:
            data = json.loads(Path(path).read_text())
            first = first or data
            src = dict(file=str(path), started=data.get("date"), commit=data.get("commit"), device=data.get("device"),
                       settings=data.get("settings", {}))
            for r in data.get("rows", []):
                k = self.rkey(r)
                if k not in best or row_rank(r, keep_import) > row_rank(best[k][0], keep_import):
                    best[k] = (r, src)
        for k, (r, src) in best.items():
            if row_rank(r, keep_import) >= 3:
                self.kept[k] = r
            else:
                self.pending[k], self.pending_src[k] = r, src
        return first

    def prior_search(self, key: str, budget) -> tuple[dict | None, str | None]:
        """The recorded search of an unfinished max-batch row, if its trials are valid here, else a note why not."""
        row = self.pending.get(key)
        if not row or not row.get("search"):
            return None, None
        src, args = self.pending_src[key], self.args
        diffs = [k for k in REUSE_SETTINGS if k in src["settings"] and src["settings"][k] != getattr(args, k)]
        if row.get("budget_bytes") != budget:
            diffs.append("budget_bytes")
        if src.get("device") and src["device"].split(":")[0] != self.dev.device.type:
            diffs.append("device")
        if diffs:
            return None, f"recorded trials of {src['file']} not reused: settings differ ({', '.join(diffs)})"
        prior = dict(search=row["search"], source=src["file"], started=src.get("started"), commit=src.get("commit"))
        return prior, None

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
        harness.save(self.out_path, self.result)


# ----------------------------------------------------------------------------- options

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
    harness.add_common_args(ap)  # --out (the PNGs go beside it), --commit, --quick (tiny random Llama, CPU-capable)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="readme: llama3-8b; fp16, kivi-int4, kivi-int2 (and quanto-int4/-int2 where optimum-quanto "
                         "is installed); cases short and maxbatch at 4096; --time-budget 300. Options given "
                         "explicitly win; with --quick the tiny model and shapes")
    ap.add_argument("--models", default=None, help=f"comma list of {list(gm.MODELS)} (default llama2-7b,llama3-8b)")
    ap.add_argument("--caches", default=None, help=f"comma list of {list(gm.ALL_CACHES)} (default {list(gm.CACHES)})")
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
    ap.add_argument("--profile-steps", type=int, default=8, help="decode steps profiled (8)")
    ap.add_argument("--profile-top", type=int, default=20, help="kernels listed (20)")
    ap.add_argument("--no-plot", action="store_true", help="no PNGs")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="merge these result files into --out (per row the finished one), print the table and draw "
                         "the plots; nothing is run")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: 1 with --quick, where small ops are slower threaded)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    args = ap.parse_args(argv)
    q = args.quick
    d = dict(models="tiny" if q else "llama2-7b,llama3-8b",
             caches="fp16,kivi-int4,quanto-int4" if q else ",".join(gm.CACHES), cases=",".join(CASES),
             prompt=48 if q else 1024, new=16 if q else 256, long_prompt=200 if q else 32768,
             long_new=4 if q else 64, ctx_prompts="96" if q else "4096,8192,16384", ctx_new=3 if q else 8,
             batch_prompts="48" if q else "1024,4096", batch_new=6 if q else 64, trial_new=None,
             max_batch_cap=4 if q else 2048, repeats=1 if q else 2, time_budget=120.0 if q else 510.0,
             min_row_s=0.0 if q else 25.0, threads=1 if q else 0, prefill_tokens=64 if q else 65536)
    if args.preset:
        preset = dict(PRESETS[args.preset])
        if args.preset == "readme" and quanto_installed():
            preset["caches"] += ",quanto-int4,quanto-int2"
        if q:  # the preset's caches and cases on the tiny model and shapes
            preset = {k: v for k, v in preset.items() if k in ("caches", "cases")}
        d.update(preset)
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.models = names(args.models, gm.MODELS)
    args.caches = names(args.caches, gm.ALL_CACHES)
    args.cases = names(args.cases, CASES)
    args.ctx_prompts = ints(args.ctx_prompts)
    args.batch_prompts = ints(args.batch_prompts)
    args.trial_new = max(1, min(args.trial_new or args.batch_new, args.batch_new))
    args.resume = args.resume or bool(args.resume_from)
    args.maxbatch_at = [parse_maxbatch_at(x, args) for x in args.maxbatch_at]
    return args


# ----------------------------------------------------------------------------- the run

def merge_files(args) -> dict:
    """``--merge``: one result file from several, its table and plots."""
    paths = [Path(p).resolve() for p in args.merge]
    rec = generate_report.merge(paths, harness.record("generate", args)["command"])
    out_path = Path(args.out) if args.out else harness.result_name("generate", rec["machine"], rec.get("quick"))
    harness.save(out_path, rec)
    generate_report.print_table(rec["rows"], rec["settings"].get("caches"))
    if not args.no_plot:
        rec["plots"] = [str(f) for f in plot(rec, out_path.with_suffix(""))]
        harness.save(out_path, rec)
    log(f"\n{len(rec['rows'])} rows of {len(paths)} files -> {out_path}; plots: {rec.get('plots', [])}")
    return rec


def main(argv=None):
    args = parse_args(argv)
    if args.merge:
        return merge_files(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dev = gm.Dev(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float16 if dev.cuda else torch.float32
    quanto_info = gm.setup_quanto(args.quanto_ext) if any(c.startswith("quanto") for c in args.caches) else {
        "available": False, "error": "not requested", "unpack": None}
    if any(c.startswith("kivi") for c in args.caches) and not args.allow_fallback:
        gm.require_kernels("generate", cuda=dev.cuda)
    kernels = kivi_cache.kernel_error() if dev.cuda else None

    budget_bytes, total = None, None
    if dev.cuda:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(idx).total_memory
        budget_bytes = int(min(args.budget_gb * GiB, total))
        torch.cuda.set_per_process_memory_fraction(budget_bytes / total, idx)
    rec = harness.record(
        "generate", args, device, device=str(device), dtype=str(dtype).replace("torch.", ""),
        kivi_cache=kivi_cache.__version__, kivi_backend=kivi_cache.get_backend(),
        kivi_kernels="cpu" if not dev.cuda else (kernels or "triton"), quanto=quanto_info, budget_bytes=budget_bytes,
        memory_fraction=None if not total else budget_bytes / total,
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), models={}, profile=[])
    out_path = harness.out_path("generate", args, rec).resolve()
    runner = Runner(args, dev, quanto_info, out_path, rec)

    sources = [out_path] if args.resume and out_path.exists() else []
    sources += [p for p in (Path(f).resolve() for f in args.resume_from) if p not in sources]
    if sources:
        old = runner.load_resume(sources)
        rec["models"] = old.get("models", {})
        rec["profile"] = old.get("profile", [])
        runner.memory_lines = list(old.get("memory_arithmetic", []))
        rec["resumed_files"] = [str(s) for s in sources]
        for k in ("models", "caches", "cases", "batch_prompts", "ctx_prompts"):  # the plots cover the kept rows too
            prev = old.get("settings", {}).get(k) or []
            rec["settings"][k] = list(dict.fromkeys(list(prev) + list(getattr(args, k))))
        searches = sum(1 for r in runner.pending.values() if r.get("search"))
        log(f"resume: keeping {len(runner.kept)} finished rows of {', '.join(map(str, sources))}; "
            f"{len(runner.pending)} unfinished rows are run again if requested ({searches} max-batch searches to "
            "continue)")
    elif args.resume:
        log(f"resume: {out_path} does not exist, starting afresh")

    m = rec["machine"]
    log(f"generate: {m.get('gpu') or device} | torch {m['torch']} | transformers {m['transformers']} | triton "
        f"{m['triton']} | budget {'-' if budget_bytes is None else f'{budget_bytes / GiB:.0f} GiB'} | time budget "
        f"{args.time_budget:.0f} s | commit {rec['commit']}")
    q = quanto_info
    log("quanto: " + (f"available {q.get('version')}, unpack {q.get('unpack')}" if q["available"] else q["error"]))

    n_b1 = (len([c for c in args.cases if c in ("short", "long")]) * len(args.caches) * (1 + args.repeats)
            + (len(args.ctx_prompts) * len(args.caches) if "ctx" in args.cases else 0))
    n_mb = len(args.batch_prompts) * len(args.caches) if "maxbatch" in args.cases else 0
    bar = harness.progress(total=len(args.models) * ((0 if args.profile_only else n_b1 + n_mb) + int(args.profile)),
                           desc="generate", unit="run")
    for i, mname in enumerate(args.models):
        now = time.perf_counter()
        runner.model_deadline = now + (runner.deadline - now) / (len(args.models) - i)
        bar.set_postfix_str(f"building {mname}", refresh=False)
        t0 = time.perf_counter()
        model, err = gm.attempt(lambda m=mname: gm.build_model(m, device, dtype))
        if err:
            log(f"{mname}: could not build: {err['error']}")
            for case in args.cases:
                for cache in args.caches:
                    runner.add_row(dict(model=mname, case=case, cache=cache, batch=None, prompt=None, new=None,
                                        status="error", **err))
            continue
        gc.collect()
        gc.freeze()  # later collections (one per generate, for the caches' reference cycles) skip these objects
        shapes = gm.model_shapes(model)
        shapes["build_s"] = time.perf_counter() - t0
        rec["models"][mname] = shapes
        ctx = dict(model=model, dev=dev, args=args, shapes=shapes, quanto=quanto_info, budget_bytes=budget_bytes)
        log(f"{mname}: {shapes['params'] / 1e9:.2f} B params, weights {shapes['weight_bytes'] / GiB:.2f} GiB, "
            f"fp KV {shapes['kv_bytes_per_token_fp'] / 1024:.0f} KiB/token, built in {shapes['build_s']:.1f} s")
        # the process's first generate (slow, not timed for any row): its cold prefill rate would inflate the time
        # estimates, so a warm batch-8 prefill gives the rate instead
        gm.attempt(lambda c=ctx: gm.run_generate(c, "fp16", 1, args.prompt, 2))
        ctx.pop("prefill_rate", None)
        gm.attempt(lambda c=ctx: gm.run_generate(c, "fp16", 8, args.prompt, 2))
        if not args.profile_only:
            generate_cases.batch1_phase(runner, ctx, mname, bar)
            if "maxbatch" in args.cases:
                generate_search.maxbatch_phase(runner, ctx, mname, bar)
        if args.profile:
            bar.set_postfix_str(f"{mname} profile", refresh=False)
            prof = generate_cases.profile_phase(runner, ctx, mname)
            rec["profile"] = [p for p in rec["profile"] if p.get("model") != mname] + [prof]
            runner.save()
            bar.update(1)
        model = ctx = None
        gc.unfreeze()
        dev.free()
    bar.close()
    runner.save()
    rows = rec["rows"]
    generate_report.print_table(rows, rec["settings"].get("caches"))
    if runner.memory_lines:
        log("")
        for line in runner.memory_lines:
            log(line)
    if not args.no_plot:
        try:
            rec["plots"] = [str(f) for f in plot(rec, out_path.with_suffix(""))]
        except ImportError as exc:
            log(f"no plots: {gm.err_text(exc)}")
        for f in rec.get("plots", []):
            log(f"plot: {f}")
    runner.save()
    skipped = [r for r in rows if r.get("skip_reason") == "time budget" or r.get("search_stopped_early")]
    log(f"\n{len(rows)} rows ({sum(r.get('status') == 'ok' for r in rows)} ok, "
        f"{sum(r.get('status') == 'error' for r in rows)} errors, {len(skipped)} cut short by the time budget) -> "
        f"{out_path} [{time.perf_counter() - T_START:.0f} s]")
    if skipped:
        log("rows cut short by the time budget: run the same command again with --resume to complete them")
    return rec


if __name__ == "__main__":
    main()

"""The benchmarks' shared harness: timing, alternation, provenance, JSON and table output, progress.

Every benchmark script in this folder builds its rows with these helpers, so that every result file holds the same
provenance (``record()``: machine, versions, commit, command, date) and every timing is taken the same way:

* ``time_alternating(fns, device, reps)``: the functions measured in turns, the order reversed every other
  repetition, so that drift (clocks, temperature, other tenants) falls on all of them alike. On a GPU each function
  is captured ``calls`` times into one CUDA graph after an eager warm-up call, and a replay is timed with CUDA events
  (GPU time, no launch overhead); on the CPU plain wall-clock calls.
* ``StepClock``: a logits processor that marks each generated token (CUDA events, no sync), for ``generate`` step
  times.
* ``save(path, rec)`` writes the JSON (after every row, so a cut-short run keeps its rows); ``table(rows, cols)``
  prints the rows.

Result files are named ``<benchmark>_<gpu>_<date>.json`` (``result_name``), e.g.
``benchmarks/results/decode_h100_2026-12-06.json``. The device machines run a copy of the working tree without
``.git``: pass ``--commit`` there (``add_common_args``), or the record says ``"commit": "unknown"``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def log(*a) -> None:
    print(*a, flush=True)


def add_common_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--out`` (JSON path; default ``benchmarks/results/<benchmark>_<gpu>_<date>.json``), ``--commit`` (the commit
    the tree is at, where there is no ``.git``), ``--quick`` (tiny shapes: a CPU smoke run, no speed result)."""
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/<benchmark>_<gpu>_<date>.json)")
    p.add_argument("--commit", default=None, help="the commit of this tree, recorded in the JSON (default: git)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, CPU smoke run (times are no speed result)")
    return p


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def git_commit() -> str:
    """``git describe --always --dirty`` of the repository, or ``"unknown"`` (no git, no ``.git``)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                             text=True, timeout=10, cwd=ROOT).stdout.strip()
        return out or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def machine_info(dev: torch.device | None = None) -> dict:
    """Python, torch, triton, transformers versions; GPU name, SMs, memory, CUDA and driver (or the CPU)."""
    import transformers
    import triton

    dev = dev or device()
    info = dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, host=platform.node())
    if dev.type != "cuda":
        return dict(info, gpu=None, cpu=platform.processor() or platform.machine(), cpu_threads=torch.get_num_threads(),
                    triton_interpret=os.environ.get("TRITON_INTERPRET"))
    p = torch.cuda.get_device_properties(dev)
    info.update(gpu=p.name, sms=p.multi_processor_count, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                cuda=torch.version.cuda)
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.split()[0]
    except Exception as exc:  # noqa: BLE001
        info["driver"] = f"unknown ({type(exc).__name__})"
    return info


def gpu_tag(info: dict) -> str:
    """``h100``, ``h200``, ... from the GPU name; ``cpu`` without one."""
    name = (info.get("gpu") or "").lower()
    for tag in ("h200", "h100", "a100", "l40s", "l4", "a10g", "b200"):
        if tag in name:
            return tag
    return "cpu" if not name else name.split()[-1].replace("/", "-")


def result_name(benchmark: str, info: dict, quick: bool = False) -> Path:
    """``benchmarks/results/<benchmark>_<gpu>_<date>.json`` (``_quick`` before ``.json`` for a smoke run)."""
    date = datetime.date.today().isoformat()
    return RESULTS / f"{benchmark}_{gpu_tag(info)}_{date}{'_quick' if quick else ''}.json"


def record(benchmark: str, args: argparse.Namespace | None = None, dev: torch.device | None = None, **extra) -> dict:
    """The provenance every result file starts with: benchmark, date, command, commit, machine, settings."""
    rec = dict(benchmark=benchmark, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=" ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
               commit=(getattr(args, "commit", None) or git_commit()), machine=machine_info(dev),
               quick=bool(getattr(args, "quick", False)))
    if args is not None:
        rec["settings"] = {k: v for k, v in vars(args).items() if k not in ("out", "commit")}
    rec.update(extra)
    rec.setdefault("rows", [])
    return rec


def out_path(benchmark: str, args: argparse.Namespace, rec: dict) -> Path:
    return Path(args.out) if getattr(args, "out", None) else result_name(benchmark, rec["machine"], args.quick)


def save(path: str | os.PathLike, rec: dict) -> None:
    """Writes ``rec`` as indented JSON (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    tmp.replace(path)


def finish(path: str | os.PathLike, rec: dict, cols: list[tuple[str, str, str]]) -> dict:
    """The end of a run: ``rec`` saved, its rows printed as a table, the path logged; returns ``rec``."""
    save(path, rec)
    print(table(rec["rows"], cols))
    log(f"saved {path}")
    return rec


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """Rows as a fixed-width table: ``cols`` = [(key, header, format spec)], e.g. ``("ms", "ms", ".4f")``; a missing
    or None value prints ``-``."""
    def cell(row, key, spec):
        v = row.get(key)
        if v is None:
            return "-"
        try:
            return format(v, spec)
        except (TypeError, ValueError):
            return str(v)

    body = [[cell(r, k, s) for k, _, s in cols] for r in rows]
    heads = [h for _, h, _ in cols]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def progress(iterable=None, **kw):
    """A tqdm bar on stderr (``total=``, ``desc=``); one line per update when stderr is not a terminal."""
    from tqdm.auto import tqdm

    kw.setdefault("mininterval", 0 if not sys.stderr.isatty() else 0.1)
    kw.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kw)


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _cuda_ms(fn) -> float:
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1)


def time_alternating(fns: dict, dev: torch.device, reps: int = 20, target_ms: float = 4.0,
                     graphs: bool = True) -> dict:
    """``{name: [ms per call, one per repetition]}`` of the functions in ``fns`` (no arguments), measured in turns.

    GPU with ``graphs``: each function called once (warm-up: compiles, plans, first allocations), then captured
    ``calls`` times into one CUDA graph (``calls`` chosen so that a replay takes about ``target_ms``); the graphs
    replayed alternately, the order reversed every other repetition; the replay's GPU time (CUDA events) / ``calls``.
    GPU without ``graphs``: eager calls timed with CUDA events (launch overhead included). CPU: wall-clock calls after
    one warm-up call."""
    names, out, calls = list(fns), {n: [] for n in fns}, 1
    for fn in fns.values():
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        clock = _cuda_ms
        if graphs:
            calls = max(3, min(400, int(target_ms / max(min(_cuda_ms(f) for f in fns.values()), 1e-3))))
            captured = {}
            for n in names:
                g = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fns[n]()
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                with torch.cuda.graph(g):
                    for _ in range(calls):
                        fns[n]()
                g.replay()
                captured[n] = g.replay
            torch.cuda.synchronize()
            fns = captured
    else:
        def clock(fn):
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    for r in range(reps):
        for n in names if r % 2 == 0 else names[::-1]:
            out[n].append(clock(fns[n]) / calls)
    return out


def add_bandwidth(row: dict, bw: float) -> dict:
    """``row["TBps"]`` and ``row["pct_copy_bw"]`` from its ``bytes`` and ``ms``, against ``bw`` (bytes/s, the copy
    bandwidth of the same run)."""
    rate = row["bytes"] / (row["ms"] * 1e-3)
    row["TBps"] = rate / 1e12
    row["pct_copy_bw"] = 100 * rate / bw
    return row


def timing_note(dev: torch.device, graphs: bool, reps: int, extra: str = "") -> str:
    """How ``time_alternating`` timed a run, for the record's ``timing`` field."""
    if dev.type != "cuda":
        return "CPU wall clock (Triton interpreter): no speed result"
    how = "CUDA graph replays" if graphs else "eager launches"
    return f"{how} timed with CUDA events, alternating, median of {reps} repetitions{extra}"


def copy_bandwidth(dev: torch.device, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), the byte ceiling a memory-bound kernel is held to."""
    x = torch.empty(nbytes // 2, dtype=torch.float16, device=dev).uniform_()
    y = torch.empty_like(x)
    ms = median(time_alternating({"copy": lambda: y.copy_(x)}, dev, reps=10, graphs=False)["copy"])
    return 2 * nbytes / (ms * 1e-3)


class StepClock:
    """A logits processor noting when each generated token's logits are ready (CUDA events on a GPU: no sync).
    Pass it in ``logits_processor=LogitsProcessorList([clock])``; ``steps_ms()`` after ``generate``."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def __call__(self, input_ids, scores):
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())
        return scores

    def steps_ms(self) -> list[float]:
        """The intervals between consecutive tokens' logits (one decode step each), the first one left out."""
        if self.cuda:
            torch.cuda.synchronize()
        pairs = list(zip(self.marks[:-1], self.marks[1:], strict=True))
        d = [a.elapsed_time(b) if self.cuda else (b - a) * 1e3 for a, b in pairs]
        return d[1:] if len(d) > 2 else d


def kernels(quick: bool):
    """``kivi_cache.kernels.api``: the Triton kernels' ops, called directly (no backend choice; the signatures of
    ``kivi_cache.reference``), the repository put on ``sys.path``. Without a GPU a ``--quick`` run turns Triton's
    interpreter on first (``TRITON_INTERPRET=1`` must be set before Triton is imported: call this before importing
    ``kivi_cache`` or ``transformers``); any other run without a GPU stops with a message saying so."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if not torch.cuda.is_available():
        if not quick:
            raise SystemExit("no CUDA device: use --quick for the CPU smoke run (Triton's interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kivi_cache.kernels import api

    if not torch.cuda.is_available() and not api.interpreting():
        raise SystemExit("no CUDA device and the kernels were loaded without Triton's interpreter: run with "
                         "TRITON_INTERPRET=1 set")
    return api

"""Draws every plot of the benchmarks from their result files.

A result file names its benchmark (``rec["benchmark"]``, e.g. ``decode``); the script of that name in this folder
(``benchmarks/decode.py``) draws it where it defines ``plot(rec, stem) -> list[Path]`` (matplotlib; ``stem``: the
result's path without ``.json``, the plots written beside it as ``<stem>*.png``). Without arguments it draws from the
newest result of every benchmark that has a plot, per GPU, in ``benchmarks/results/`` (smoke runs, ``*_quick.json``,
left out); with files, from those.

Usage::

    python benchmarks/plots.py                                   # the newest result of each benchmark and GPU
    python benchmarks/plots.py benchmarks/results/decode_h100_2026-12-06.json [...]

Output: the PNG files beside their result files (their paths are printed).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
from pathlib import Path

import harness as H

BENCH = Path(__file__).resolve().parent


@functools.cache
def plotter(benchmark: str):
    """``plot`` of ``benchmarks/<benchmark>.py``, or None where that script does not exist or draws nothing."""
    if not benchmark.replace("_", "").isalnum():
        return None
    path = BENCH / f"{benchmark}.py"
    if not path.is_file():
        return None
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"{benchmark}_plots", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, "plot", None)


def load(path: Path) -> dict | None:
    """The result file's record, or None where it is not a benchmark result (no ``benchmark`` or ``rows``)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and "benchmark" in rec and "rows" in rec else None


def newest(results: Path) -> list[Path]:
    """The newest result (by its record's date) of each benchmark and GPU in ``results``, smoke runs left out."""
    best: dict[tuple, tuple[str, Path]] = {}
    for path in sorted(results.glob("*.json")):
        if path.stem.endswith("_quick"):
            continue
        rec = load(path)
        if rec is None or rec.get("quick"):
            continue
        key = (rec["benchmark"], H.gpu_tag(rec.get("machine") or {}))
        if key not in best or str(rec.get("date", "")) >= best[key][0]:
            best[key] = (str(rec.get("date", "")), path)
    return [p for _, p in sorted(best.values(), key=lambda v: str(v[1]))]


def draw(path: Path, strict: bool) -> list[Path]:
    """The plots of one result file; ``strict``: a file that is no result, or whose benchmark draws nothing, is an
    error (else skipped)."""
    rec = load(path)
    if rec is None:
        if strict:
            raise SystemExit(f"{path}: not a benchmark result (a JSON with 'benchmark' and 'rows')")
        return []
    fn = plotter(rec["benchmark"])
    if fn is None:
        if strict:
            raise SystemExit(f"{path}: benchmark {rec['benchmark']!r} has no plot (no plot() in "
                             f"benchmarks/{rec['benchmark']}.py)")
        return []
    return fn(rec, path.with_suffix(""))


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="result files (default: the newest of each benchmark and GPU "
                    "in --results)")
    ap.add_argument("--results", type=Path, default=H.RESULTS, help="folder of result files (default "
                    "benchmarks/results)")
    args = ap.parse_args(argv)
    for f in args.files:
        if not f.is_file():
            ap.error(f"no such file: {f}")
    files = args.files or [p for p in newest(args.results) if plotter(load(p)["benchmark"]) is not None]
    if not files:
        H.log(f"no result with a plot in {args.results}")
    written = []
    for path in files:
        got = draw(path, strict=bool(args.files))
        for png in got:
            H.log(f"{path.name} -> {png}")
        written += got
    return written


if __name__ == "__main__":
    main()

"""The table, the plots and the merging of result files of benchmarks/generate.py (none of them needs a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

from harness import log, table

GiB = float(1 << 30)

COLUMNS = [("model", "model", ""), ("case", "case", ""), ("cache", "cache", ""), ("batch", "batch", "d"),
           ("tokens", "prompt+new", ""), ("decode_tok_s", "tok/s", ".1f"), ("decode_step_ms", "step ms", ".2f"),
           ("step_ms_timer", "timer ms", ".2f"), ("prefill_s", "prefill s", ".3f"), ("peak_gib", "peak GiB", ".2f"),
           ("kv_bytes_per_token", "KV B/tok", ".0f"), ("kv_bytes_per_token_theory", "theory", ".0f"),
           ("status", "status", "")]


def row_rank(row: dict, keep_import: bool = False) -> float:
    """Which of several rows of one (model, case, cache, prompt) to keep: finished > a search log (the longer the
    better) > other. A max-batch row whose search stopped for the time budget counts as unfinished (``--resume``
    continues it). ``keep_import``: a row skipped for a missing import counts as finished."""
    finished = row.get("status") in ("ok", "error") and not row.get("search_stopped_early")
    if finished or (keep_import and row.get("skip_reason") == "import"):
        return 3.0
    if row.get("search"):
        return 2.0 + min(len(row["search"]), 999) / 1000
    return 1.0


def merge(paths: list[Path], command: str) -> dict:
    """One result from several files (e.g. runs of different caches on different GPUs): per (model, case, cache,
    prompt) the best row (``row_rank``; ties: the later file), the settings' lists joined, the files' provenance
    under ``sources``; the record's own provenance is the first file's, its command ``command``."""
    recs = [json.loads(Path(p).read_text()) for p in paths]
    out = dict(recs[0], command=command, rows=[], models={}, profile=[], memory_arithmetic=[], sources=[])
    out["settings"] = dict(recs[0].get("settings") or {})
    out.pop("plots", None)
    rows: dict = {}
    for path, rec in zip(paths, recs, strict=True):
        out["sources"].append({k: rec.get(k) for k in ("command", "commit", "date", "machine")} | {"file": str(path)})
        out["models"].update(rec.get("models") or {})
        out["profile"] += rec.get("profile") or []
        out["memory_arithmetic"] += [m for m in rec.get("memory_arithmetic") or [] if m not in out["memory_arithmetic"]]
        for k in ("models", "caches", "cases", "batch_prompts", "ctx_prompts"):
            have = list(out["settings"].get(k) or [])
            out["settings"][k] = have + [x for x in (rec.get("settings") or {}).get(k) or [] if x not in have]
        for r in rec.get("rows", []):
            key = (r.get("model"), r.get("case"), r.get("cache"), r.get("prompt"))
            if key not in rows or row_rank(r) >= row_rank(rows[key]):
                rows[key] = r
    out["rows"] = list(rows.values())
    return out


def print_table(rows: list[dict], caches: list[str] | None = None) -> None:
    """The rows as a table (by model, case, prompt, then cache in the order of ``caches``), then one line per row
    with an error, a note or allocator retries while decoding."""
    rows = sorted(rows, key=_order(rows, caches or []))
    shown = [dict(r, tokens=f"{r.get('prompt')}+{r.get('new')}",
                  peak_gib=None if r.get("peak_bytes") is None else r["peak_bytes"] / GiB) for r in rows]
    log("\n" + table(shown, COLUMNS))
    for r in rows:
        what = f"{r.get('model')} {r.get('case')} {r.get('cache')} {r.get('prompt')}+{r.get('new')}"
        if r.get("error"):
            log(f"  {what}: {r.get('status')}: {r['error'][:200]}")
        elif r.get("search_stopped_early"):
            log(f"  {what}: search stopped by the time budget, batch {r.get('batch')} is a lower bound (--resume)")
        elif r.get("note") and r.get("case") != "ctx":
            log(f"  {what}: {r['note'][:200]}")
        retries = (r.get("decode_alloc") or {}).get("alloc_retries")
        if retries:  # the allocator hit the budget while decoding: freed its cache and retried (slow steps)
            log(f"  {what}: {retries} allocator retries while decoding")


def _order(rows: list[dict], caches: list[str]):
    """Sort key of the table: model, case, prompt, cache (in the order of ``caches``, then as they appear)."""
    first: dict = {("cache", c): i for i, c in enumerate(caches)}
    for r in rows:
        for k in ("model", "cache"):
            first.setdefault((k, r.get(k)), len(first))
    cases = ("short", "long", "ctx", "maxbatch")
    return lambda r: (first[("model", r.get("model"))], cases.index(r["case"]) if r.get("case") in cases else 9,
                      r.get("prompt") or 0, first[("cache", r.get("cache"))])


def _pyplot():
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _count(x, _pos=None) -> str:
    """Tick label of a rate: 30, 300, 2k, 10k."""
    if x >= 1000:
        return f"{x / 1000:g}k"
    return f"{x:g}"


def _tokens(x, _pos=None) -> str:
    """Tick label of a batch size or token count: 1, 16, 512, 1024; 4k, 32k for whole multiples of 1024 past it."""
    x = int(round(x))
    return f"{x // 1024}k" if x > 1024 and x % 1024 == 0 else str(x)


def _log2_axis(ax, lo: float, hi: float, axis: str = "x") -> None:
    """A base-2 log axis with a plain label at each power of two (every other one past eight ticks)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: PLC0415

    lo_e, hi_e = int(max(lo, 1)).bit_length() - 1, int(max(hi, 1) - 1).bit_length()
    ticks = [2 ** e for e in range(lo_e, hi_e + 1)]
    if len(ticks) > 8:
        ticks = ticks[:: (len(ticks) + 7) // 8]
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log", base=2)
    target.set_major_locator(FixedLocator(ticks))
    target.set_major_formatter(FuncFormatter(_tokens))
    target.set_minor_locator(NullLocator())
    (ax.set_xlim if axis == "x" else ax.set_ylim)(max(lo, 1) / 1.4, max(hi, 1) * 1.4)


def _caches(rec: dict, rows: list[dict]) -> list[str]:
    listed = list((rec.get("settings") or {}).get("caches") or [])
    return listed + sorted({r["cache"] for r in rows} - set(listed))


def _models(rec: dict, rows: list[dict]) -> list[str]:
    listed = list((rec.get("settings") or {}).get("models") or [])
    return [m for m in listed + sorted({r["model"] for r in rows} - set(listed)) if any(r["model"] == m for r in rows)]


def throughput_points(rec: dict, model: str, cache: str, prompt: int) -> list[tuple[int, float]]:
    """(batch, decode tokens/s) of one cache at one prompt length, one point per batch: the rows' values (the
    batch-1 short row first) and, at other batches, the max-batch search's fitting trials (per-step timer), also of
    a max-batch row whose final measurement was skipped."""
    pts: dict[int, float] = {}
    mine = [r for r in rec["rows"] if r.get("model") == model and r.get("cache") == cache and r.get("prompt") == prompt]
    for r in sorted(mine, key=lambda r: r.get("case") != "short"):
        if r.get("status") == "ok" and r.get("case") in ("short", "maxbatch") and r.get("decode_tok_s"):
            pts.setdefault(r["batch"], r["decode_tok_s"])
    for r in mine:
        if r.get("case") == "maxbatch":
            for t in r.get("search") or []:
                if t.get("ok") and t.get("step_timer"):
                    pts.setdefault(t["batch"], t["batch"] / t["step_timer"])
    return sorted(pts.items())


def _log_y(ax, lo: float, hi: float) -> None:
    """A log y axis labelled at 1-2-5 steps over less than two decades, at 1-3 steps or decades over more."""
    import math  # noqa: PLC0415

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: PLC0415

    decades = math.log10(max(hi, 1e-9) / max(lo, 1e-9))
    subs = (1.0, 2.0, 5.0) if decades < 2 else (1.0, 3.0) if decades < 3.5 else (1.0,)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(_count))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(lo / 1.5, hi * 1.5)


def plot(rec: dict, stem: str | Path) -> list[Path]:
    """``<stem>_throughput.png`` (decode tokens/s against batch size, per model) and ``<stem>_memory.png`` (peak
    memory against context length at batch 1, where the result has two lengths or more; the max batch within the
    budget per cache, where it has max-batch rows). Returns the files written."""
    plt = _pyplot()
    stem = Path(stem)
    rows = [r for r in rec.get("rows", []) if r.get("model")]
    models, caches = _models(rec, rows), _caches(rec, rows)
    if not models:
        return []
    colors = {c: f"C{i}" for i, c in enumerate(caches)}
    styles = ("-o", "--s", ":^", "-.v")
    files = []
    budget = next((r["budget_bytes"] for r in rows if r.get("budget_bytes")), None)

    fig, axes = plt.subplots(1, len(models), figsize=(7.5 * len(models), 4.8), squeeze=False)
    drawn = False
    for ax, m in zip(axes[0], models, strict=True):
        prompts = sorted({r["prompt"] for r in rows if r["model"] == m and r.get("case") in ("short", "maxbatch")
                          and r.get("prompt")})
        xs, ys = [], []
        for cache in caches:
            for p, style in zip(prompts, styles * 4, strict=False):
                pts = throughput_points(rec, m, cache, p)
                if pts:
                    xs += [x for x, _ in pts]
                    ys += [y for _, y in pts]
                    ax.plot([x for x, _ in pts], [y for _, y in pts], style, color=colors[cache], ms=5,
                            label=f"{cache}, prompt {_tokens(p)}")
        if not xs:
            ax.set_visible(False)
            continue
        drawn = True
        _log2_axis(ax, min(xs), max(xs))
        _log_y(ax, min(ys), max(ys))
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode tokens / s")
        ax.set_title(m)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    if drawn:
        note = f"; largest batch of a line: the most that fits {budget / GiB:.0f} GiB" if budget else ""
        fig.suptitle(f"decode throughput against batch size{note}", fontsize=11)
        fig.tight_layout()
        files.append(stem.with_name(stem.name + "_throughput.png"))
        fig.savefig(files[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    ok = [r for r in rows if r.get("status") == "ok"]
    panels = {}  # model: kinds, one row of panels per model
    for m in models:
        b1 = [r for r in ok if r["model"] == m and r.get("batch") == 1 and r.get("peak_bytes")]
        kinds = ["context"] if len({r["prompt"] + r["new"] for r in b1}) >= 2 else []
        if any(r["model"] == m and r.get("case") == "maxbatch" and r.get("batch") for r in ok):
            kinds.append("maxbatch")
        if kinds:
            panels[m] = kinds
    if panels:
        ncols = max(len(k) for k in panels.values())
        fig, axes = plt.subplots(len(panels), ncols, figsize=(7.5 * ncols, 4.6 * len(panels)), squeeze=False)
        for row, (m, kinds) in zip(axes, panels.items(), strict=True):
            for ax in row[len(kinds):]:
                ax.set_visible(False)
            for ax, kind in zip(row, kinds, strict=False):
                if kind == "context":
                    _memory_vs_context(ax, rec, ok, m, caches, colors)
                else:
                    _max_batch_bars(ax, ok, m, caches, colors, budget)
        fig.tight_layout()
        files.append(stem.with_name(stem.name + "_memory.png"))
        fig.savefig(files[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return files


def _memory_vs_context(ax, rec, ok, m, caches, colors) -> None:
    xs = []
    for cache in caches:
        pts = sorted((r["prompt"] + r["new"], r["peak_bytes"] / GiB) for r in ok
                     if r["model"] == m and r["cache"] == cache and r.get("batch") == 1 and r.get("peak_bytes"))
        if pts:
            xs += [x for x, _ in pts]
            ax.plot([x for x, _ in pts], [y for _, y in pts], "-o", color=colors[cache], ms=5, label=cache)
    w = (rec.get("models") or {}).get(m, {}).get("weight_bytes")
    if w:
        ax.axhline(w / GiB, color="gray", ls=":", label="weights")
    _log2_axis(ax, min(xs), max(xs))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context length (prompt + new tokens), batch 1")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title(f"{m}: peak memory against context")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _max_batch_bars(ax, ok, m, caches, colors, budget) -> None:
    prompts = sorted({r["prompt"] for r in ok if r["model"] == m and r.get("case") == "maxbatch"})
    shown = [c for c in caches if any(r["model"] == m and r.get("case") == "maxbatch" and r["cache"] == c
                                      for r in ok)]
    width = 0.8 / max(1, len(shown))
    for i, cache in enumerate(shown):
        got = {r["prompt"]: r for r in ok if r["model"] == m and r.get("case") == "maxbatch" and r["cache"] == cache}
        have = [p for p in prompts if p in got]
        xs = [prompts.index(p) + (i - (len(shown) - 1) / 2) * width for p in have]
        bars = ax.bar(xs, [got[p]["batch"] for p in have], width * 0.92, color=colors[cache], label=cache)
        # a search stopped by the time budget gives a lower bound
        labels = [("\u2265" if got[p].get("search_stopped_early") else "") + str(got[p]["batch"]) for p in have]
        ax.bar_label(bars, labels=labels, fontsize=8, padding=2)
    ax.set_xticks(range(len(prompts)), [f"prompt {_tokens(p)}" for p in prompts])
    ax.margins(y=0.15)
    ax.set_ylabel("largest batch that fits")
    ax.set_title(f"{m}: max batch" + (f" within {budget / GiB:.0f} GiB" if budget else ""))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)

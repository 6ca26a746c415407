"""Merge bench_generate result files into one, print the table and draw the plots (no GPU needed).

    python eval/report_generate.py eval/results/a.json eval/results/b.json ... --out eval/results/merged.json

Rows are keyed by (model, case, cache, prompt); a later file's row replaces an earlier one, unless the earlier
is finished (ok/error) and the later is not, or the earlier has the longer max-batch search log of two
unfinished rows (``bench_generate.row_rank``: a resumed file's finished row beats the stale partial one). Max-batch rows
recorded before the per-step timer became their decode step get their rates recomputed from the values
recorded in them (``maxbatch_rates``) and the theoretical KV bytes per token are recomputed (arithmetic):
nothing is re-measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_generate as bg  # noqa: E402


def merge(paths: list[str]) -> dict:
    rows, result = {}, None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if result is None:
            result = dict(data, sources=[], rows=[])
        result["sources"].append(dict(file=os.path.basename(path), meta=data.get("meta"),
                                      argv=data.get("meta", {}).get("argv")))
        result["models"].update(data.get("models", {}))
        for k in ("caches", "models"):
            have = result["settings"][k]
            result["settings"][k] = have + [x for x in data["settings"][k] if x not in have]
        result["memory_arithmetic"] = list(dict.fromkeys(result.get("memory_arithmetic", []) +
                                                         data.get("memory_arithmetic", [])))
        for r in data["rows"]:
            if r.get("case") == "maxbatch" and r.get("status") == "ok" and "step_timer_s" not in r:
                r["step_timer_s"] = r["step_ms_timer"] / 1e3 if r.get("step_ms_timer") else None
                r.pop("decode_tok_s_timer", None)
                bg.maxbatch_rates(r, r["new"], r.get("trial_new", 16))
            if r.get("case") == "maxbatch" and r.get("status") == "ok" and r.get("search"):
                r.update(bg.best_fit_rate(r["search"], r["new"]))  # from the recorded trials (64-token ones only)
            shapes = data.get("models", {}).get(r["model"])
            if shapes and r.get("kv_bytes_per_token_theory") is not None:  # arithmetic, recomputed (a fixed
                # label: runs before session 3 priced Int2PagedCache as 2/2 bits g32 instead of its 4/2 bits g64)
                r["kv_bytes_per_token_theory"] = bg.kv_theory(r["cache"], shapes, types.SimpleNamespace(
                    quanto_group=data["settings"].get("quanto_group", 64)))
            key = (r["model"], r["case"], r["cache"], r["prompt"])
            if key not in rows or bg.row_rank(r, False) >= bg.row_rank(rows[key], False):
                rows[key] = r
    result["rows"] = list(rows.values())
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = merge(args.files)
    result["plots"] = bg.plots(result, args.out)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    bg.print_table(result["rows"])
    print("\n".join(result["memory_arithmetic"]))
    print(f"{len(result['rows'])} rows -> {args.out}; plots: {result['plots']}")


if __name__ == "__main__":
    main()

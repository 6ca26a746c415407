"""Print the README's decode-kernel table from a bench_kernels JSON (no GPU needed).

    python eval/report_kernels.py eval/results/bench_kernels_s20.json [--compare eval/results/bench_kernels_s15.json]

Every figure comes from the JSON: times are the benchmark's medians, TB/s and % of copy bandwidth are its own
(bytes read / time, against the copy bandwidth measured in that run). Bold marks issue 3's target shapes
(batch >= 8, context >= 32k). ``--compare`` adds a column with another run's int4 eager (graph) speed-up.
"""

from __future__ import annotations

import argparse
import json

IMPLS = ("int4", "int2", "int2_k4v2g64", "int4_g64")


def target_shape(r: dict) -> bool:
    return r["batch"] >= 8 and r["context"] >= 32768


def fmt_x(x: float | None, bold: bool = False) -> str:
    if x is None:
        return "-"
    s = f"{x:.2f}x"
    return f"**{s}**" if bold else s


def table(data: dict, compare: dict | None = None) -> str:
    bw = data["copy_bandwidth_TBps"]
    old = {}
    if compare is not None:
        old = {(r["batch"], r["kv_heads"], r["context"]): r for r in compare["rows"]}
    head = ["batch", "KV heads", "context", "fp16 SDPA ms (TB/s)", "int4 ms (TB/s, % copy BW, x fp16)",
            "int2 2/2 ms (TB/s, %, x)", "k4v2 g64 ms (x)", "int4 g64 ms (TB/s, x)",
            "quantize+write ms (of an int4 step)",
            "as CUDA graphs: fp16 / int4 ms; x fp16 int4 / 2/2 / k4v2 / int4 g64; quantize+write (of an int4 step)"]
    if compare is not None:
        head.append("int4 x fp16 eager (graphs), compared run")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["rows"]:
        bold = target_shape(r)
        g = {k: r.get(f"{k}_graph_speedup") for k in IMPLS}
        qg = r.get("quantize_and_write_graph_ms")
        cells = [
            str(r["batch"]), str(r["kv_heads"]), str(r["context"]),
            f"{r['fp16_sdpa_ms']:.3f} ({r['fp16_sdpa_TBps']:.2f})",
            f"{r['int4_ms']:.3f} ({r['int4_TBps']:.2f}, {100 * r['int4_TBps'] / bw:.0f}%, "
            f"{fmt_x(r['int4_speedup'], bold)})",
            f"{r['int2_ms']:.3f} ({r['int2_TBps']:.2f}, {100 * r['int2_TBps'] / bw:.0f}%, "
            f"{fmt_x(r['int2_speedup'])})",
            f"{r['int2_k4v2g64_ms']:.3f} ({fmt_x(r['int2_k4v2g64_speedup'])})",
            f"{r['int4_g64_ms']:.3f} ({r['int4_g64_TBps']:.2f}, {fmt_x(r['int4_g64_speedup'])})",
            f"{r['quantize_and_write_ms']:.4f} ({100 * r['quantize_frac_of_int4_decode']:.1f}%)",
        ]
        if r.get("int4_graph_ms") is not None:
            cells.append(f"{r['fp16_sdpa_graph_ms']:.3f} / {r['int4_graph_ms']:.3f}; "
                         + " / ".join(fmt_x(g[k]) for k in IMPLS)
                         + (f"; {qg:.4f} ({100 * qg / r['int4_graph_ms']:.1f}%)" if qg is not None else ""))
        else:
            cells.append("-")
        if compare is not None:
            o = old.get((r["batch"], r["kv_heads"], r["context"]))
            cells.append("-" if o is None else
                         f"{fmt_x(o.get('int4_speedup'))} ({fmt_x(o.get('int4_graph_speedup'))})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result")
    ap.add_argument("--compare", default=None)
    args = ap.parse_args(argv)
    with open(args.result) as f:
        data = json.load(f)
    compare = None
    if args.compare:
        with open(args.compare) as f:
            compare = json.load(f)
    print(f"{data['machine']}, torch {data['torch']}, triton {data['triton']}; copy bandwidth "
          f"{data['copy_bandwidth_TBps']:.2f} TB/s; max relative error {data['max_rel_err']:.1e}\n")
    print(table(data, compare))


if __name__ == "__main__":
    main()

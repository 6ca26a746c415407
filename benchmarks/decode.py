"""Decode attention: the paged int4/int2 kernel (``paged_decode_attention``) against fp16 SDPA over the same context.

For every shape (batch x KV heads x context; ``--q-per-kv`` query heads per KV head, ``--head-dim``) it builds an fp16
KV cache (``[B, KV, context, D]``) and, per bits setting (key bits / value bits / group size), a page pool of the same
context (``kivi_cache.testing.random_pool``: ``context - window`` quantized tokens on scattered pages, the rest,
about ``--residual`` tokens, in the fp16 window). Before timing, the kernel's output is checked against the torch
reference (``kivi_cache.reference``) on a slice (the first two sequences' first ``--check-tokens`` tokens): the
relative error is in the row. Then fp16 ``scaled_dot_product_attention`` (one query token, ``enable_gqa``) and the
kernel of every setting are timed in turns (``harness.time_alternating``: each captured into a CUDA graph and
replayed, GPU time from CUDA events, the order reversed every other repetition; ``--no-graphs``: eager launches,
launch overhead included). A row reports the median time, the bytes the call reads (codes, fp16 scales and zero
points, the fp16 window, the queries and outputs, the block table; fp16: keys, values, queries and outputs), the
effective TB/s, its fraction of the device-to-device copy bandwidth measured in the same run, and the speed-up over
fp16 SDPA. Graph replays keep a small problem in L2 across calls: ``--cold-l2`` zeroes a 256 MiB buffer before every
call and subtracts the time of the zeroing alone.

Usage::

    python benchmarks/decode.py [--shapes 1x8x4096,8x8x32768] [--bits 4/4/32,2/2/32] [--no-graphs] [--cold-l2]
                                [--out F.json] [--commit SHA]
    python benchmarks/decode.py --quick        # CPU smoke run under Triton's interpreter (times are no result)

Output: ``benchmarks/results/decode_<gpu>_<date>.json`` (``--out`` to change it), written after every shape; the table
is printed at the end. ``python benchmarks/plots.py`` draws the speed-up and TB/s plot (:func:`plot`) beside it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import harness as H
import torch

if str(H.ROOT) not in sys.path:
    sys.path.insert(0, str(H.ROOT))

SHAPES = "1x8x4096,1x8x32768,1x8x131072,8x8x32768,32x8x32768,8x32x32768"
QUICK_SHAPES = "1x2x192,2x2x256"
BITS = "4/4/32,2/2/32,4/2/64"
FP16 = "fp16 sdpa"
COLS = [("batch", "B", "d"), ("kv_heads", "KV", "d"), ("q_heads", "Hq", "d"), ("context", "context", "d"),
        ("impl", "impl", ""), ("ms", "ms", ".4f"), ("TBps", "TB/s", ".2f"), ("pct_copy_bw", "% copy", ".0f"),
        ("speedup", "x fp16", ".2f"), ("rel_err", "rel err", ".1e"), ("error", "error", "")]


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"BxKVxCTX,..."`` -> [(batch, kv_heads, context)]."""
    out = []
    for item in text.split(","):
        parts = item.strip().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: {item!r} is not BATCHxKV_HEADSxCONTEXT of positive integers (e.g. 8x8x32768)")
        out.append(tuple(map(int, parts)))
    return out


def parse_bits(text: str) -> list[tuple[int, int, int]]:
    """``"K/V/G,..."`` -> [(key_bits, value_bits, group_size)]."""
    out = []
    for item in text.split(","):
        parts = item.strip().split("/")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--bits: {item!r} is not KEY_BITS/VALUE_BITS/GROUP_SIZE (e.g. 4/4/32)")
        out.append(tuple(map(int, parts)))
    return out


def label(kb: int, vb: int, g: int) -> str:
    return f"k{kb}v{vb}g{g}"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    H.add_common_args(ap)
    ap.add_argument("--shapes", default=None, help=f"BATCHxKV_HEADSxCONTEXT list (default {SHAPES}; quick "
                    f"{QUICK_SHAPES})")
    ap.add_argument("--bits", default=BITS, help=f"KEY_BITS/VALUE_BITS/GROUP_SIZE list (default {BITS})")
    ap.add_argument("--head-dim", type=int, default=None, help="default 128 (quick 64)")
    ap.add_argument("--q-per-kv", type=int, default=4, help="query heads per KV head (default 4)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--residual", type=int, default=None, help="fp16 window tokens (default 128, quick 32)")
    ap.add_argument("--reps", type=int, default=None, help="alternating repetitions per shape (default 15, quick 1)")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="time CUDA-graph replays (default) or eager launches (--no-graphs)")
    ap.add_argument("--cold-l2", action="store_true", help="zero a 256 MiB buffer before every call (its time "
                    "subtracted): no data left in L2 between calls")
    ap.add_argument("--check-tokens", type=int, default=None,
                    help="tokens of the slice checked against the reference (default 4096, quick 256)")
    ap.add_argument("--max-err", type=float, default=1e-2, help="largest relative error of a kernel's check that "
                    "passes (default 1e-2)")
    args = ap.parse_args(argv)
    q = args.quick
    args.shapes = args.shapes or (QUICK_SHAPES if q else SHAPES)
    args.head_dim = args.head_dim or (64 if q else 128)
    args.residual = args.residual if args.residual is not None else (32 if q else 128)
    args.reps = args.reps or (1 if q else 15)
    args.check_tokens = args.check_tokens or (256 if q else 4096)
    try:
        shapes, bits = parse_shapes(args.shapes), parse_bits(args.bits)
    except ValueError as exc:
        ap.error(str(exc))
    H.kernels(q)  # the interpreter on (a CPU quick run) before kivi_cache imports Triton
    from kivi_cache.kernels.checks import kernel_limits

    interpreted = q and not torch.cuda.is_available()
    for kb, vb, g in bits:
        why = kernel_limits("paged_decode_attention", args.head_dim, kb, vb, g, args.page_size, interpreted)
        if why:
            ap.error(f"--bits {kb}/{vb}/{g}: {why}")
    for b, hkv, ctx in shapes:
        if ctx <= args.residual + max(g for _, _, g in bits):
            ap.error(f"--shapes {b}x{hkv}x{ctx}: the context must exceed the window (--residual {args.residual}) "
                     f"plus a group")
    if args.q_per_kv < 1 or args.reps < 1 or args.residual < 1:
        ap.error("--q-per-kv, --reps and --residual must be positive")
    args.shape_list, args.bits_list = shapes, bits
    return args


def pool_bytes(b: int, hkv: int, t_quant: int, d: int, g: int, kb: int, vb: int, window: int, hq: int,
               block_table_numel: int) -> int:
    """Bytes a decode call reads and writes: codes, fp16 scales and zero points (keys per group of tokens and
    channel, values per token and group of channels), the fp16 window's keys and values, queries and outputs, the
    block table."""
    codes = b * hkv * t_quant * d * (kb + vb) // 8
    scales = b * hkv * (t_quant // g) * d * 2 * 2 + b * hkv * t_quant * (d // g) * 2 * 2
    resid = 2 * b * hkv * window * d * 2
    qo = b * hq * d * 2 * 2
    return codes + scales + resid + qo + block_table_numel * 4


def check(kk, ref, decode_args, pool: dict, q, rk, rv, rl, kb, vb, g, sm, tokens: int) -> float:
    """The kernel against the torch reference on the first (up to two) sequences' first ``tokens`` quantized tokens
    and their windows: ``|out - ref| / |ref|`` (Frobenius norms, fp32)."""
    nb = min(2, q.shape[0])
    p = pool["k_codes"].shape[2]
    t_s = min(int(pool["lengths"][0]), tokens) // g * g
    sub = dict(pool)
    sub["block_table"] = pool["block_table"][:nb, :-(-t_s // p)].contiguous()
    sub["lengths"] = torch.full((nb,), t_s, dtype=torch.int32, device=q.device)
    a = decode_args(sub, q[:nb], rk[:nb], rv[:nb], rl[:nb], kb, vb, g, sm)
    out = kk.paged_decode_attention(*a).float()
    want = ref.paged_decode_attention(*a).float()
    return ((out - want).norm() / want.norm()).item()


def shape_rows(args, kk, dev, shape, gen, bw: float, flush) -> list[dict]:
    """The rows of one shape: fp16 SDPA and every bits setting, checked, then timed in turns."""
    from kivi_cache import reference
    from kivi_cache.testing import decode_args, random_pool

    b, hkv, ctx = shape
    hq, d, p, res = hkv * args.q_per_kv, args.head_dim, args.page_size, args.residual
    sm = 1.0 / math.sqrt(d)
    base = dict(batch=b, kv_heads=hkv, q_heads=hq, context=ctx, head_dim=d, page_size=p)
    q = torch.randn(b, hq, d, dtype=torch.float16, device=dev, generator=gen)
    kf = torch.randn(b, hkv, ctx, d, dtype=torch.float16, device=dev, generator=gen)
    vf = torch.randn_like(kf)
    q4 = q[:, :, None, :]
    fns = {FP16: lambda: torch.nn.functional.scaled_dot_product_attention(q4, kf, vf, enable_gqa=hq != hkv)}
    rows = {FP16: dict(base, impl=FP16, bytes=2 * b * hkv * ctx * d * 2 + b * hq * d * 2 * 2)}
    for kb, vb, g in args.bits_list:
        name = label(kb, vb, g)
        tq = (ctx - res) // g * g
        pool = random_pool(b, hkv, tq, d, p, g, kb, vb, dev, gen)
        window = ctx - tq
        rl = torch.full((b,), window, dtype=torch.int32, device=dev)
        rk = torch.randn(b, hkv, res + g - 1, d, dtype=torch.float16, device=dev, generator=gen)
        rv = torch.randn_like(rk)
        a = decode_args(pool, q, rk, rv, rl, kb, vb, g, sm)
        fns[name] = lambda a=a: kk.paged_decode_attention(*a)
        err = check(kk, reference, decode_args, pool, q, rk, rv, rl, kb, vb, g, sm, args.check_tokens)
        rows[name] = dict(base, impl=name, key_bits=kb, value_bits=vb, group_size=g, quantized_tokens=tq,
                          window=window, rel_err=err, check="ok" if err <= args.max_err else "FAIL",
                          bytes=pool_bytes(b, hkv, tq, d, g, kb, vb, window, hq, pool["block_table"].numel()))
        if err > args.max_err:
            H.log(f"WARNING {b}x{hkv}x{ctx} {name}: relative error {err:.2e} against the reference > {args.max_err}")
    if flush is not None:
        timed = {n: (lambda fn=fn: (flush.zero_(), fn())) for n, fn in fns.items()}
        timed["l2 flush"] = flush.zero_
    else:
        timed = fns
    times = H.time_alternating(timed, dev, reps=args.reps, graphs=args.graphs)
    flush_ms = H.median(times.pop("l2 flush")) if flush is not None else 0.0
    for name, row in rows.items():
        row["ms_reps"] = [round(t - flush_ms, 6) for t in times[name]]
        row["ms"] = max(H.median(times[name]) - flush_ms, 1e-6)
        H.add_bandwidth(row, bw)
    for row in rows.values():
        row["speedup"] = rows[FP16]["ms"] / row["ms"]
    return list(rows.values())


def main(argv=None) -> dict:
    args = parse_args(argv)
    kk = H.kernels(args.quick)
    dev = H.device()
    rec = H.record("decode", args, dev)
    out = H.out_path("decode", args, rec)
    bw = H.copy_bandwidth(dev, nbytes=(1 << 22) if args.quick else (4 << 30))
    rec.update(copy_bandwidth_TBps=bw / 1e12, interpreter=kk.interpreting(),
               timing=H.timing_note(dev, args.graphs, args.reps,
                                    ", L2 flushed before every call (subtracted)" if args.cold_l2 else ""),
               bytes_note="int: codes + fp16 scales/zeros + fp16 window K/V + q/out + block table; fp16: K + V + "
                          "q/out")
    H.log(f"decode on {rec['machine'].get('gpu') or 'CPU'}: copy bandwidth {bw / 1e12:.3f} TB/s; -> {out}")
    flush = (torch.empty(256 << 20, dtype=torch.int8, device=dev) if args.cold_l2 and dev.type == "cuda" else None)
    gen = torch.Generator(device=dev).manual_seed(0)
    for shape in H.progress(args.shape_list, desc="decode shapes"):
        try:
            rows = shape_rows(args, kk, dev, shape, gen, bw, flush)
        except Exception as exc:  # noqa: BLE001  (an error row; the run goes on)
            b, hkv, ctx = shape
            rows = [dict(batch=b, kv_heads=hkv, q_heads=hkv * args.q_per_kv, context=ctx, impl="-",
                         error=f"{type(exc).__name__}: {str(exc)[:300]}")]
            H.log(f"{b}x{hkv}x{ctx}: ERROR {rows[0]['error']}")
        rec["rows"] += rows
        H.save(out, rec)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    errs = [r["rel_err"] for r in rec["rows"] if r.get("rel_err") is not None]
    rec["max_rel_err"] = max(errs) if errs else None
    rec["complete"] = True
    H.save(out, rec)
    print(H.table(rec["rows"], COLS))
    H.log(f"copy bandwidth {bw / 1e12:.3f} TB/s; max relative error against the reference "
          f"{rec['max_rel_err'] if rec['max_rel_err'] is None else format(rec['max_rel_err'], '.1e')}; saved {out}")
    return rec


def plot(rec: dict, stem: Path) -> list[Path]:
    """``<stem>.png``: the speed-up of every bits setting over fp16 SDPA (top) and the effective TB/s of every
    implementation against the copy bandwidth (bottom), one group of bars per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rec["rows"] if r.get("ms") is not None]
    shapes = sorted({(r["batch"], r["kv_heads"], r["context"]) for r in rows})
    impls = list(dict.fromkeys([FP16] + [r["impl"] for r in rows if r["impl"] != FP16]))  # the run's order
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
    get = {(r["batch"], r["kv_heads"], r["context"], r["impl"]): r for r in rows}

    def ctx_text(c: int) -> str:
        return f"{c // 1024}k" if c % 1024 == 0 else str(c)

    names = [f"B{b} KV{h}\n{ctx_text(c)}" for b, h, c in shapes]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(7.0, 1.3 * len(shapes) + 2), 7.5), sharex=True)
    xs = range(len(shapes))
    for ax, keys, key in ((ax1, impls[1:], "speedup"), (ax2, impls, "TBps")):
        width = 0.8 / max(1, len(keys))
        for i, impl in enumerate(keys):
            vals = [get.get((*s, impl), {}).get(key) or 0.0 for s in shapes]
            pos = [x - 0.4 + width * (i + 0.5) for x in xs]
            bars = ax.bar(pos, vals, width, label=impl, color=colors[impl])
            if key == "speedup":
                ax.bar_label(bars, labels=[f"{v:.1f}" if v else "" for v in vals], fontsize=7, padding=1)
    top = max([r.get("speedup") or 0 for r in rows if r["impl"] != FP16] + [1.0])
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_ylabel("speed-up over fp16 SDPA")
    ax1.set_ylim(0, top * 1.35)
    ax1.legend(title="key bits, value bits, group", fontsize=8, title_fontsize=8, loc="upper left",
               ncol=len(impls) - 1)
    bw = rec.get("copy_bandwidth_TBps")
    if bw:
        ax2.axhline(bw, color="k", ls="--", lw=0.8, label=f"copy bandwidth ({bw:.2f} TB/s)")
    ax2.set_ylim(0, max([r.get("TBps") or 0 for r in rows] + [bw or 0]) * 1.35)
    ax2.set_ylabel("effective TB/s (bytes read / time)")
    ax2.legend(fontsize=8, loc="upper left", ncol=3)
    ax2.set_xticks(list(xs), names, fontsize=8)
    ax2.set_xlabel("batch, KV heads, context (tokens)")
    m = rec.get("machine", {})
    fig.suptitle(f"Decode attention, paged int kernels vs fp16 SDPA ({m.get('gpu') or 'CPU'}, "
                 f"commit {rec.get('commit', '?')})", fontsize=10)
    fig.tight_layout()
    path = Path(f"{stem}.png")
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return [path]


def failed(rec: dict) -> list[dict]:
    """The rows with an error or a failed check against the reference."""
    return [r for r in rec["rows"] if r.get("error") or r.get("check") == "FAIL"]


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)

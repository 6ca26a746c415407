"""Quantizing into the pages: ``quantize_and_write`` (a group flush and a prefill's write) and ``append_and_flush``
(the compiled decode step's window write and flush).

For every batch and bits setting (key bits / value bits / group size; ``--kv-heads``, ``--head-dim``, fp16 keys and
values, a ``kivi_cache.testing.random_pool`` of ``--page-size``-token pages; ``--clip``: the groups' range search of
``QuantConfig.clip``: ``none`` (default), ``keys``, ``values``, ``both``) three operations:

* ``flush``: ``quantize_and_write`` of one group per sequence (what a decode step writes when a window is full);
* ``prefill``: ``quantize_and_write`` of ``--prefill`` tokens per sequence (``prefill / group`` groups each);
* ``append_and_flush``: one token per sequence written into a full window (``--residual`` tokens plus ``--sinks``
  sink tokens and a group), its oldest group quantized into the pages and the rest moved down, for every sequence.

Each is first run by the kernels and by the torch reference (``kivi_cache.reference``) on copies of the same pool and
windows: the rows report the largest scale/zero difference, the largest code difference (in quantization steps: one
at rounding ties) and the fraction of equal codes, and ``check`` = ``ok`` or ``FAIL`` (with clipping a group
whose candidate ranges reconstruct it almost equally well may take another range than the reference's, fp32 sums
being ordered differently: there only 99.9% equal codes are required). Then the three are timed in
turns (``harness.time_alternating``: CUDA-graph replays timed with CUDA events, the order reversed every other
repetition; ``--no-graphs``: eager launches). A row reports the median time, the bytes moved (fp16 keys and values
read; codes, fp16 scales and zero points written; for ``append_and_flush`` also the token's write and the window's
move), the effective TB/s and its fraction of the copy bandwidth measured in the same run.

Usage::

    python benchmarks/quantize.py [--batches 1,8,32] [--bits 4/4/32,2/2/32] [--clip none,both] [--prefill 1024]
                                  [--no-graphs] [--out F.json] [--commit SHA]
    python benchmarks/quantize.py --quick      # CPU smoke run under Triton's interpreter (times are no result)

Output: ``benchmarks/results/quantize_<gpu>_<date>.json`` (``--out`` to change it), written after every batch and
bits setting; the table is printed at the end.
"""

from __future__ import annotations

import argparse
import sys

import harness as H
import torch

if str(H.ROOT) not in sys.path:
    sys.path.insert(0, str(H.ROOT))

from decode import parse_bits  # noqa: E402  (benchmarks/decode.py)

BITS = "4/4/32,2/2/32,4/2/64"
QUICK_BITS = "4/4/32,4/2/64"
OPS = ("flush", "prefill", "append_and_flush")
COLS = [("batch", "B", "d"), ("kv_heads", "KV", "d"), ("bits", "bits", ""), ("clip", "clip", ""), ("op", "op", ""),
        ("tokens", "tokens/seq", "d"), ("ms", "ms", ".4f"), ("TBps", "TB/s", ".3f"), ("pct_copy_bw", "% copy", ".0f"),
        ("max_code_step", "code diff", "d"), ("code_match", "codes equal", ".5f"), ("check", "check", ""),
        ("error", "error", "")]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    H.add_common_args(ap)
    ap.add_argument("--batches", default=None, help="sequences (default 1,8,32; quick 1)")
    ap.add_argument("--bits", default=None, help=f"KEY_BITS/VALUE_BITS/GROUP_SIZE list (default {BITS}; quick "
                    f"{QUICK_BITS})")
    ap.add_argument("--clip", default="none", help="comma list of none/keys/values/both: the groups the range search "
                    "of QuantConfig.clip runs for (default none)")
    ap.add_argument("--kv-heads", type=int, default=None, help="default 8 (quick 1)")
    ap.add_argument("--head-dim", type=int, default=None, help="default 128 (quick 64)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=None, help="tokens per sequence of the prefill write (default "
                    "1024, quick 64)")
    ap.add_argument("--residual", type=int, default=None, help="window tokens of append_and_flush (default 128, "
                    "quick 32)")
    ap.add_argument("--sinks", type=int, default=4, help="sink tokens of append_and_flush (default 4)")
    ap.add_argument("--reps", type=int, default=None, help="alternating repetitions (default 15, quick 1)")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="time CUDA-graph replays (default) or eager launches (--no-graphs)")
    args = ap.parse_args(argv)
    q = args.quick
    args.batches = args.batches or ("1" if q else "1,8,32")
    args.bits = args.bits or (QUICK_BITS if q else BITS)
    args.kv_heads = args.kv_heads or (1 if q else 8)
    args.head_dim = args.head_dim or (64 if q else 128)
    args.prefill = args.prefill or (64 if q else 1024)
    args.residual = args.residual if args.residual is not None else (32 if q else 128)
    args.reps = args.reps or (1 if q else 15)
    try:
        args.bits_list = parse_bits(args.bits)
        args.batch_list = [int(x) for x in args.batches.split(",")]
    except ValueError as exc:
        ap.error(str(exc) if str(exc).startswith("--") else f"--batches: {args.batches!r} is not a list of integers")
    args.clip_list = args.clip.split(",")
    if not set(args.clip_list) <= {"none", "keys", "values", "both"}:
        ap.error(f"--clip: a comma list of none, keys, values and both, got {args.clip!r}")
    if min(args.batch_list) < 1 or args.kv_heads < 1 or args.reps < 1 or args.residual < 0 or args.sinks < 0:
        ap.error("--batches, --kv-heads and --reps must be positive, --residual and --sinks not negative")
    H.kernels(q)  # the interpreter on (a CPU quick run) before kivi_cache imports Triton
    from kivi_cache.kernels.checks import kernel_limits

    for kb, vb, g in args.bits_list:
        why = kernel_limits("quantize_and_write", args.head_dim, kb, vb, g, args.page_size,
                            q and not torch.cuda.is_available())
        if why:
            ap.error(f"--bits {kb}/{vb}/{g}: {why}")
        if args.prefill % g:
            ap.error(f"--prefill {args.prefill}: not a whole number of groups of {g}")
    return args


def write_bytes(n: int, h: int, g: int, d: int, kb: int, vb: int) -> int:
    """Bytes ``quantize_and_write`` moves for ``n`` groups: fp16 keys and values read, codes written, fp16 scales and
    zero points written (keys: per channel of a group; values: per token and group of channels), pages and slots."""
    return (2 * n * h * g * d * 2 + n * h * g * d * (kb + vb) // 8 + n * h * d * 2 * 2 + n * h * g * (d // g) * 2 * 2
            + n * 16)


def compare(got: list, want: list, bits: tuple, clip: bool = False) -> dict:
    """The kernels' pool (and windows) against the reference's: the largest scale/zero difference, the largest code
    difference in steps and the fraction of equal codes, the largest window difference (``clip``: near-tied groups
    may take other ranges, module docstring)."""
    from kivi_cache.quant import unpack

    kb, vb, _ = bits
    def diff(a, b) -> float:
        return (a.float() - b.float()).nan_to_num().abs().max().item() if a.numel() else 0.0

    scale = max(diff(got[i], want[i]) for i in (1, 2, 4, 5))
    steps, equal, total = 0, 0, 0
    for i, nbits in ((0, kb), (3, vb)):
        d = (unpack(got[i], nbits).int() - unpack(want[i], nbits).int()).abs()
        steps = max(steps, int(d.max().item()) if d.numel() else 0)
        equal += int((d == 0).sum().item())
        total += d.numel()
    window = max([diff(a, b) for a, b in zip(got[6:], want[6:], strict=True)] + [0.0])
    ref_scale = max(want[i].float().nan_to_num().abs().max().item() for i in (1, 4))
    ok = equal >= 0.999 * total and window == 0.0
    if not clip:
        ok = ok and steps <= 1 and scale <= 1e-3 * max(ref_scale, 1e-6)
    return dict(max_scale_diff=scale, max_code_step=steps, code_match=equal / max(total, 1), max_window_diff=window,
                check="ok" if ok else "FAIL")


def case_rows(args, kk, dev, b: int, bits: tuple, clip: str, gen, bw: float) -> list[dict]:
    """The three operations of one batch and bits setting: checked against the reference, then timed in turns."""
    from kivi_cache import reference
    from kivi_cache.testing import random_pool

    kb, vb, g = bits
    h, d, p, r, s, n_pre = args.kv_heads, args.head_dim, args.page_size, args.residual, args.sinks, args.prefill
    pd = random_pool(b, h, (n_pre // p + 1) * p, d, p, g, kb, vb, dev, gen)
    bt = pd["block_table"]
    pool = [pd[k] for k in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")]
    base = dict(batch=b, kv_heads=h, head_dim=d, page_size=p, bits=f"{kb}/{vb}/{g}", key_bits=kb, value_bits=vb,
                group_size=g, clip=clip)
    flags = dict(clip_keys=clip in ("keys", "both"), clip_values=clip in ("values", "both"))
    fns, rows = {}, {}

    def writes(n_tok: int):
        k = torch.randn(b * n_tok // g, h, g, d, device=dev, dtype=torch.float16, generator=gen)
        v = torch.randn_like(k)
        grp = torch.arange(n_tok // g, device=dev)
        pages = bt[:, grp * g // p].reshape(-1).contiguous()
        slots = ((grp * g) % p).repeat(b).to(torch.int32)
        return lambda mod, t: mod.quantize_and_write(k, v, pages, slots, *t, kb, vb, g, **flags), k.shape[0]

    for op, n_tok in (("flush", g), ("prefill", n_pre)):
        call, groups = writes(n_tok)
        got, want = [t.clone() for t in pool], [t.clone() for t in pool]
        call(kk, got)
        call(reference, want)
        fns[op] = lambda call=call: call(kk, pool)
        rows[op] = dict(base, op=f"{op} (quantize_and_write)", tokens=n_tok, groups=groups,
                        bytes=write_bytes(groups, h, g, d, kb, vb), **compare(got, want, bits, clip != "none"))

    cap = s + r + g
    wk = torch.randn(b, h, cap, d, device=dev, dtype=torch.float16, generator=gen)
    wv = torch.randn_like(wk)
    nk = torch.randn(b, h, d, device=dev, dtype=torch.float16, generator=gen)
    nv = torch.randn_like(nk)
    lens = [torch.full((b,), x, device=dev, dtype=torch.int32) for x in (cap - 1, s, n_pre)]  # every window full

    def step(mod, t, k_win, v_win):
        mod.append_and_flush(nk, nv, k_win, v_win, *lens, bt, *t, kb, vb, g, r, s, **flags)

    got, want = [t.clone() for t in pool] + [wk.clone(), wv.clone()], [t.clone() for t in pool] + [wk.clone(),
                                                                                                   wv.clone()]
    step(kk, got[:6], *got[6:])
    step(reference, want[:6], *want[6:])
    fns["append_and_flush"] = lambda: step(kk, pool, wk, wv)
    moved = 2 * b * h * d * 2 * 2 + 2 * b * h * r * d * 2 * 2  # the token written; the window's R tokens moved
    rows["append_and_flush"] = dict(base, op="append_and_flush", tokens=1, groups=b, residual=r, sinks=s,
                                    bytes=write_bytes(b, h, g, d, kb, vb) + moved,
                                    **compare(got, want, bits, clip != "none"))
    for op, row in rows.items():
        if row["check"] == "FAIL":
            H.log(f"WARNING b={b} {row['bits']} {op}: the kernels differ from the reference: {row}")
    times = H.time_alternating(fns, dev, reps=args.reps, graphs=args.graphs)
    for op, row in rows.items():
        row["ms_reps"] = [round(t, 6) for t in times[op]]
        row["ms"] = H.median(times[op])
        H.add_bandwidth(row, bw)
    return list(rows.values())


def main(argv=None) -> dict:
    args = parse_args(argv)
    kk = H.kernels(args.quick)
    dev = H.device()
    rec = H.record("quantize", args, dev)
    out = H.out_path("quantize", args, rec)
    bw = H.copy_bandwidth(dev, nbytes=(1 << 22) if args.quick else (4 << 30))
    rec.update(copy_bandwidth_TBps=bw / 1e12, interpreter=kk.interpreting(),
               timing=H.timing_note(dev, args.graphs, args.reps),
               bytes_note="fp16 K/V read + codes and fp16 scales/zeros written (+ append_and_flush: the token's "
                          "write and the window's move)")
    H.log(f"quantize on {rec['machine'].get('gpu') or 'CPU'}: copy bandwidth {bw / 1e12:.3f} TB/s; -> {out}")
    gen = torch.Generator(device=dev).manual_seed(0)
    cases = [(b, bits, clip) for b in args.batch_list for bits in args.bits_list for clip in args.clip_list]
    for b, bits, clip in H.progress(cases, desc="quantize cases"):
        try:
            rows = case_rows(args, kk, dev, b, bits, clip, gen, bw)
        except Exception as exc:  # noqa: BLE001  (an error row; the run goes on)
            rows = [dict(batch=b, kv_heads=args.kv_heads, bits="/".join(map(str, bits)), clip=clip, op="-",
                         error=f"{type(exc).__name__}: {str(exc)[:300]}")]
            H.log(f"b={b} {rows[0]['bits']}: ERROR {rows[0]['error']}")
        rec["rows"] += rows
        H.save(out, rec)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    rec["complete"] = True
    H.save(out, rec)
    print(H.table(rec["rows"], COLS))
    H.log(f"copy bandwidth {bw / 1e12:.3f} TB/s; saved {out}")
    return rec


def failed(rec: dict) -> list[dict]:
    """The rows with an error or a failed check against the reference."""
    return [r for r in rec["rows"] if r.get("error") or r.get("check") == "FAIL"]


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)

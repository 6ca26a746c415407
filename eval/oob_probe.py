"""Does the decode kernel read block-table entries past a sequence's pages (and follow them)? (GPU)

Session 10's A/B died with an illegal memory access at b32 x kv8 x 32k, int4 g64, with the default settings,
after the same shape had run in session 9. Hypothesis: the pipelined paged loop loads the block-table entry of
a step past the end of its split (prefetch) and a code load uses it; harmless while the word after a row is a
valid page id, fatal when it is garbage. This probe poisons every block-table word past each sequence's pages
with ``--poison`` (a page id far outside the pool) and runs ``paged_decode_attention`` (default settings, then
forced split counts), one case per subprocess (an illegal access kills the CUDA context). Layouts:
``tail`` (the table is a view whose storage ends right after the last row, poison after it), ``rowpad`` (every
row has poisoned slack after its pages), ``ragged`` (random lengths per sequence, poisoned past each; outputs
also compared with the torch reference, which gathers every entry: it gets the table with the poison replaced by
page 0). Session 10 (`eval/results/oob_probe_s10.json`, before that fix: the ragged rows' failures were the
reference's out-of-range gather) found no read of a poisoned entry. Usage:
    python eval/oob_probe.py [--out oob.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES_BITS = ["4/4/32", "4/4/64", "2/2/32", "4/2/64"]
LAYOUTS = ["tail", "rowpad", "ragged"]
SHAPES = os.environ.get("OOB_SHAPES", "32x8x32768,8x8x8192,1x8x32768").split(",")


def child(bits: str, layout: str, poison: int, splits: list[int]) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_kernels import make_pool

    from kivi_cache import reference as REF
    from kivi_cache.kernels import api as KK

    kb, vb, g = map(int, bits.split("/"))
    dev, hq, d, page, res = torch.device("cuda" if torch.cuda.is_available() else "cpu"), 32, 128, 64, 128
    for shape in SHAPES:
        b, hkv, ctx = map(int, shape.split("x"))
        gen = torch.Generator(device=dev).manual_seed(0)
        t_q = ctx - res
        pool = make_pool(b, hkv, t_q, d, page, g, kb, vb, dev, gen)
        bt = pool["block_table"]
        pps = bt.shape[1]
        if layout == "tail":
            store = torch.full((b * pps + 4096,), poison, dtype=torch.int32, device=dev)
            store[: b * pps] = bt.reshape(-1)
            pool["block_table"] = store[: b * pps].view(b, pps)
        else:
            wide = torch.full((b, pps + 8), poison, dtype=torch.int32, device=dev)
            lengths = pool["lengths"]
            if layout == "ragged":
                lengths = torch.randint(1, t_q // g + 1, (b,), device=dev, generator=gen, dtype=torch.int32) * g
                lengths[0] = t_q
                pool["lengths"] = lengths
            for i in range(b):
                n = -(-int(lengths[i]) // page)
                wide[i, :n] = bt[i, :n]
            pool["block_table"] = wide
        q = torch.randn(b, hq, d, device=dev, dtype=torch.float16, generator=gen)
        rk = torch.randn(b, hkv, res + g, d, device=dev, dtype=torch.float16, generator=gen)
        rv = torch.randn(b, hkv, res + g, d, device=dev, dtype=torch.float16, generator=gen)
        rl = torch.full((b,), res, device=dev, dtype=torch.int32)
        args = (q, pool["block_table"], pool["lengths"], pool["k_codes"], pool["k_scale"], pool["k_zero"],
                pool["v_codes"], pool["v_scale"], pool["v_zero"], rk, rv, rl, kb, vb, g, 0.088)
        for ns in [None, *splits]:
            out = KK.paged_decode_attention(*args, num_splits=ns)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            line = dict(bits=bits, layout=layout, shape=shape, splits=ns, ok=True)
            if layout == "ragged" and ns is None and b <= 8:
                ok_bt = torch.where(pool["block_table"] == poison, 0, pool["block_table"])  # ref gathers all
                ref = REF.paged_decode_attention(args[0], ok_bt, *args[2:]).float()
                line["rel_err"] = float((out.float() - ref).norm() / ref.norm())
            print("ROW " + json.dumps(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=2, metavar=("BITS", "LAYOUT"))
    ap.add_argument("--poison", type=int, default=(1 << 30) - 1)
    ap.add_argument("--splits", default="1,3,7,9,11,13,16,31")
    ap.add_argument("--bits", default=",".join(CASES_BITS))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    splits = [int(x) for x in args.splits.split(",") if x]
    if args.child:
        child(*args.child, args.poison, splits)
        return
    results = []
    for bits in args.bits.split(","):
        for layout in args.layouts.split(","):
            cmd = [sys.executable, __file__, "--child", bits, layout, "--poison", str(args.poison),
                   "--splits", args.splits]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            rows = [json.loads(x[4:]) for x in p.stdout.splitlines() if x.startswith("ROW ")]
            err = "" if p.returncode == 0 else (p.stderr.strip().splitlines() or ["?"])[-1][:300]
            results.append(dict(bits=bits, layout=layout, rc=p.returncode, rows=rows, error=err))
            last = rows[-1] if rows else None
            print(f"{bits:>7} {layout:>7}: rc={p.returncode} {len(rows)} calls ok"
                  + (f"; failed after {last['shape']} splits={last['splits']}" if err and last else "")
                  + (f"; {err}" if err else "")
                  + "".join(f"; {r['shape']} rel_err {r['rel_err']:.1e}" for r in rows if "rel_err" in r),
                  flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(dict(poison=args.poison, results=results), f, indent=1)


if __name__ == "__main__":
    main()

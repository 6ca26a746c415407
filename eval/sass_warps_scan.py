"""Warps per decode program at head_dim 256 (session 32): sm_90 builds of the decode kernel (eval/sass_decode.py, on
the CPU) with 1 warp (the default, ``DecodeTuning.warps``) and 2 or 4 warps per program, 64- and 32-token steps,
under the installed Triton and each Triton given with --triton DIR (a ``pip install --target DIR triton==X``).

A one-warp program at head_dim 256 holds a [16, 256] fp32 accumulator (128 registers per lane) and spills in the
paged loop under Triton 3.6 (eval/results/sass_ksz_d256_s31.json); with 2 warps each holds half. Per build: SASS
per step of the paged loop per lane and summed over the program's warps (what the SM issues per step), spills,
registers, and the warps an H200 SM keeps resident (registers and shared memory: decode_plan.resident_programs).

    python eval/sass_warps_scan.py --triton /tmp/t36 --out eval/results/sass_warps_d256_s32.json
"""

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sass_ksz_scan import builds  # noqa: E402

from kivi_cache.kernels.decode_plan import resident_programs  # noqa: E402

WIDTHS = (("KBITS=4", "VBITS=4", "G=32"), ("KBITS=2", "VBITS=2", "G=32"), ("KBITS=4", "VBITS=2", "G=64"))
CONFIGS = [(d, w, blk, c) for d in (256, 128) for c in WIDTHS for blk in (64, 32) for w in (1, 2, 4)
           if not (d == 128 and (blk == 32 or w == 4)) and not (blk == 32 and "G=64" in c)]  # g64: 64-token steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--triton", action="append", default=[""], help="a folder holding another Triton (repeatable)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for tdir in args.triton:
        version, res = builds(tdir, [(f"D={d}", f"BLOCK={blk}", *c) for d, w, blk, c in CONFIGS],
                              env_per=[{"W": str(w)} for _, w, _, _ in CONFIGS])
        for (d, w, blk, c), r in zip(CONFIGS, res, strict=True):
            if "instructions" not in r:
                print(version, d, w, blk, c, "error", str(r)[-300:])
                continue
            resident = resident_programs(r["reg"], r["shared"], w) * w
            row = dict(triton=version, d=d, warps=w, step=blk, consts=list(c), summary=r, resident_warps=resident,
                       sass_per_step_all_warps=r["instructions"] * w)
            rows.append(row)
            print(f"{version} d{d} {' '.join(c):24s} step {blk:2d} W{w}: {r['instructions']:5d} SASS/lane "
                  f"({r['instructions'] * w:5d} all warps), {r['spills']:2d} spills, {r['reg']} regs, "
                  f"{r['shared']} B shared, {resident:2d} warps/SM")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(machine=platform.node(), target="sm_90 (CPU build, eval/sass_decode.py)", note=__doc__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

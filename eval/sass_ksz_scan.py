"""The KSZ scan of session 30: sm_90 builds of the decode kernel (eval/sass_decode.py, on the CPU) at head_dim 64 and
128, four key/value widths, groups 32 and 64, with KSZ=0 (per-plane key scale loads) and KSZ=1 (one load), under
the installed Triton and under each Triton given with --triton DIR (a `pip install --target DIR triton==X`).

    python eval/sass_ksz_scan.py --triton /tmp/t36 --out eval/results/sass_ksz_s30.json
    python eval/sass_ksz_scan.py --triton /tmp/t36 --bf16 --out eval/results/sass_ksz_bf16_s31.json  (bf16 builds)

Prints one line per build (instructions per 64-token step of the paged loop, BSSY in it, registers, spills) and
saves the summaries as JSON with each Triton's version.
"""

import argparse
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = [(f"D={d}", f"KBITS={kb}", f"VBITS={vb}", f"G={g}", f"KSZ={ksz}")
           for d in (64, 128) for kb, vb in ((4, 4), (2, 2), (4, 2), (2, 4)) for g in (32, 64) for ksz in (0, 1)]


def builds(pythonpath: str, configs: list, env_per: list | None = None) -> tuple[str, list]:
    """(Triton version, [summary or error per ``configs`` entry]) with ``pythonpath`` first on the path; ``env_per``:
    extra sass_decode settings per entry (e.g. ``{"W": "2"}``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p)
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
    spec = [dict(script="decode", args=list(c), env={"R": "0", **(e or {})})
            for c, e in zip(configs, env_per or [None] * len(configs), strict=True)]
    out = subprocess.run([sys.executable, os.path.join(HERE, "sass_batch.py")], input=json.dumps(spec), env=env,
                         capture_output=True, text=True, check=True).stdout
    return version, [r.get("result", r) for r in json.loads(out.strip().splitlines()[-1])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--triton", action="append", default=[""], help="a folder holding another Triton (repeatable)")
    ap.add_argument("--bf16", action="store_true", help="bf16 builds (BF16=1) instead of fp16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    configs = [c + ("BF16=1",) for c in CONFIGS] if a.bf16 else CONFIGS
    rows = []
    for path in a.triton:
        version, res = builds(path, configs)
        for c, r in zip(configs, res, strict=True):
            row = dict(triton=version, consts=list(c), **({"summary": r} if "instructions" in r else {"error": r}))
            rows.append(row)
            s = row.get("summary")
            print(version, " ".join(c), *(["ERROR"] if s is None else
                  [s["instructions"], "bssy", s["bssy"], "reg", s["reg"], "spills", s["spills"]]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(machine=platform.platform(), python=platform.python_version(), target="sm_90 (CPU build)",
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

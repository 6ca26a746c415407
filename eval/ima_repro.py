"""Bisect the illegal memory access of session 10 (GPU): run sequences of decode calls, each sequence in a fresh
process (an illegal access kills the CUDA context), and report which step of which sequence fails.

A step is ``SHAPE:BITS[:MODE][:KEY=VAL+KEY=VAL]`` (SHAPE ``BxHKVxCTX``, BITS ``kb/vb/g``, MODE ``e`` eager call
(default), ``g`` eager call, sync, then CUDA-graph timing, ``r`` (race) the pool built on memory just freed from
poisoned tensors, then CUDA-graph timing at once (``do_bench_cudagraph`` warms up on a new stream that does not
wait for the default stream), ``rs`` the same with a sync first); pools as ab_decode builds them (same seeds).
Usage:
    python eval/ima_repro.py "1x8x131072:4/4/64,32x8x32768:4/4/64" "32x8x32768:4/4/64" [--out F]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def child(seq: str) -> None:
    import torch
    import triton

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_kernels import decode_args, make_pool

    from kivi_cache import kernels as KK

    dev, hq, d, page, res = "cuda", 32, 128, 64, 128
    for i, step in enumerate(seq.split(",")):
        parts = step.split(":")
        b, hkv, ctx = map(int, parts[0].split("x"))
        kb, vb, g = map(int, parts[1].split("/"))
        mode = parts[2] if len(parts) > 2 and parts[2] else "e"
        env = dict(x.split("=", 1) for x in parts[3].split("+")) if len(parts) > 3 else {}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        q = torch.randn(b, hq, 1, d, device=dev, dtype=torch.float16)
        gen = torch.Generator(device=dev).manual_seed(0)
        if mode in ("r", "rs"):  # stale memory under the new pool: page ids far outside it
            junk = [torch.full((n,), 0x3FFFFFFF, dtype=torch.int32, device=dev)
                    for n in [1 << 12] * 64 + [1 << 16] * 64 + [1 << 28] * 4]
            torch.cuda.synchronize()
            del junk
        pool = make_pool(b, hkv, ctx - res, d, page, g, kb, vb, torch.device(dev), gen)
        rk = torch.randn(b, hkv, res + g, d, device=dev, dtype=torch.float16, generator=gen)
        rv = torch.randn(b, hkv, res + g, d, device=dev, dtype=torch.float16, generator=gen)
        rl = torch.full((b,), res, device=dev, dtype=torch.int32)
        a = decode_args(pool, q[:, :, 0], rk, rv, rl, kb, vb, g, 0.088)
        ms = None
        if mode in ("r", "rs"):
            if mode == "rs":
                torch.cuda.synchronize()
            ms = triton.testing.do_bench_cudagraph(lambda a=a: KK.paged_decode_attention(*a), rep=20)
        out = KK.paged_decode_attention(*a)
        torch.cuda.synchronize()
        if mode == "g":
            ms = triton.testing.do_bench_cudagraph(lambda a=a: KK.paged_decode_attention(*a), rep=20)
            torch.cuda.synchronize()
        print("STEP " + json.dumps(dict(i=i, step=step, ok=True, finite=bool(out.isfinite().all()), ms=ms)),
              flush=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        del pool, rk, rv, q, out


def main() -> None:
    if sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    args = sys.argv[1:]
    out = None
    if "--out" in args:
        j = args.index("--out")
        out = args[j + 1]
        del args[j:j + 2]
    results = []
    for seq in args:
        p = subprocess.run([sys.executable, __file__, "--child", seq], capture_output=True, text=True, timeout=240)
        steps = [json.loads(x[5:]) for x in p.stdout.splitlines() if x.startswith("STEP ")]
        err = "" if p.returncode == 0 else "\n".join(x for x in p.stderr.splitlines()
                                                     if "Error" in x or "error" in x or "File" in x)[-1500:]
        results.append(dict(seq=seq, rc=p.returncode, steps=steps, error=err))
        n = len(seq.split(","))
        print(f"rc={p.returncode} {len(steps)}/{n} steps ok  {seq}" + (f"\n{err}" if err else ""), flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

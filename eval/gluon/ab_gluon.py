"""One-call GPU A/B: the Gluon transposed decode kernel (eval/gluon/gluon_decode.py, ``gluon_decode_t_kernel``)
against the existing ``kivi_cache.kernels.paged_decode_attention``, with fp16 SDPA as the baseline.

    . eval/device_env.sh && python3 eval/gluon/ab_gluon.py --out $OUT/ab_gluon.json           # H200, < 4 min
    python3 eval/gluon/ab_gluon.py --variants pf0,pf1,pf1r168,pf2 --out ...                # more Gluon variants
    python eval/gluon/ab_gluon.py --dry-run          # CPU: tiny pools, reference, torch partials + merge, and
                                                     # each variant's sm_90 build (child process)
    python eval/gluon/ab_gluon.py --sim              # CPU: the GPU path on tiny shapes, torch partials in place
                                                     # of the Gluon launch, wall-clock calls in place of graphs

Per shape (batch x KV heads x context; 32 query heads, head_dim 128, page 64) and bit setting:
* the pool of ``eval/bench_kernels.make_pool`` (all ``context`` tokens in pages) and an EMPTY residual window
  (res_lengths = 0, capacity one group) for BOTH kernels: the Gluon kernel cannot read a window;
* the existing op's own automatic split count (read from its plan, ``_DecodePlan.ints[1]``) is given to the Gluon
  kernel too (``NS`` in the output); a variant with ``RES=n`` instead takes ``split_count`` for n programs per SM;
* the Gluon partials go to a workspace in the existing layout (``[B * Hq, NS(, D)]`` fp32 max / sum / output) and are
  merged by the existing ``kivi_cache.kernels.decode_merge.decode_reduce``, so both sides time split kernel + merge
  kernel (under CUDA-graph capture the existing op never fuses its merge); the existing op also launches its
  (empty) window program per (sequence, KV head), the Gluon kernel has none;
* correctness first: on a slice (first 2 sequences, first ``--slice-tokens`` tokens) both kernels against
  ``kivi_cache.reference`` (and the Gluon partials merged by torch against decode_reduce), then the full outputs
  against each other; relative max error (max |a - b| / max |b|) printed, a FAIL line above 1e-2 (exit code 1 at
  the end; the timings still run);
* timing: CUDA-graph replays (``bench_kernels.graph_bench``), in ``--rounds`` alternating rounds (SDPA, existing,
  each Gluon variant), medians; TB/s from ``bench_kernels.pool_bytes`` (residual 0) and the speed-up over SDPA.

Gluon variants: ``gluon_decode.py`` reads its flags (GD_PF, GD_VFOLD, ...) at import, so each variant is a separate
copy of the module loaded under its own name with its env set (Triton's cache key includes those constexpr globals);
``R`` (maxnreg) and ``RES`` (split count for that residency) are launch-side settings of this script.
The JSON is rewritten after every shape and bit setting; none is started after ``--max-s`` seconds (420).
"""

import argparse
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))

VARIANTS = {  # name -> settings: GD_* (module flags), R (maxnreg), RES (programs per SM for the split count)
    "pf0": {"GD_PF": "0"},
    "pf1": {"GD_PF": "1"},
    "pf1r168": {"GD_PF": "1", "R": "168"},
    "pf2": {"GD_PF": "2"},
    "vfold": {"GD_PF": "1", "GD_VFOLD": "1"},
    # its own split count for 12 programs per SM, held there by maxnreg 168 (GROUP 1 builds 172 registers without)
    "pf1r168res12": {"GD_PF": "1", "R": "168", "RES": "12"},
}
LOG2E = 1.4426950408889634
D, PAGE, HQ = 128, 64, 32

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--shapes", default="32x8x32768,8x32x32768,8x8x32768,1x8x131072", help="BxHkvxCTX,...")
ap.add_argument("--bits", default="4/4/32,2/2/32", help="kbits/vbits/group,... (the Gluon kernel: 4 or 2 bits, "
                "group 32: 4/4/32, 2/2/32, 4/2/32, 2/4/32)")
ap.add_argument("--variants", default="pf1,pf1r168res12",
                help=f"Gluon variants, comma-separated: names of {sorted(VARIANTS)} or name:KEY=VAL;KEY=VAL")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--rep", type=int, default=100, help="graph_bench rep (ms of replays per measurement)")
ap.add_argument("--slice-tokens", type=int, default=2048)
ap.add_argument("--tol", type=float, default=1e-2)
ap.add_argument("--max-s", type=float, default=420, help="no new shape / bit setting is started after this many "
                "seconds (the device command's limit is 600 s; what was measured is saved)")
ap.add_argument("--out", default=None)
ap.add_argument("--dry-run", action="store_true", help="CPU: tiny pools; reference, torch partials and the "
                "existing merge (under the Triton interpreter); each variant's module and its sm_90 compile; no "
                "Gluon launch, no timing")
ap.add_argument("--build-check", action="store_true", help="CPU: only each variant's module and sm_90 build "
                "(part of --dry-run, in a child process)")
ap.add_argument("--sim", action="store_true", help="CPU test of this script: the GPU path on tiny shapes with the "
                "Gluon launch replaced by torch partials and graph replays by wall-clock calls (interpreter)")
args = ap.parse_args()


def parse_variants(spec):
    out = []
    for v in spec.split(","):
        v = v.strip()
        if not v:
            continue
        if ":" in v:
            n, kv = v.split(":", 1)
            out.append((n, dict(x.split("=", 1) for x in kv.split(";") if x)))
        elif v in VARIANTS:
            out.append((v, dict(VARIANTS[v])))
        else:
            sys.exit(f"ab_gluon: unknown variant {v!r} (known: {sorted(VARIANTS)}, or name:KEY=VAL;KEY=VAL)")
    return out


variants = parse_variants(args.variants)
bit_settings = [tuple(map(int, b.split("/"))) for b in args.bits.split(",")]
shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]

import torch  # noqa: E402

if args.sim:
    args.dry_run = False
    if args.shapes == ap.get_default("shapes"):
        args.shapes = "2x2x256,1x4x320"
        shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    args.slice_tokens = min(args.slice_tokens, 128)
if not args.dry_run and not args.sim and not args.build_check and not torch.cuda.is_available():
    sys.exit("ab_gluon: no CUDA device (torch.cuda.is_available() is False). This script times the Gluon kernel on "
             "a GPU; on a CPU use --dry-run (tiny pools, reference and merge only).")
if (args.dry_run or args.sim) and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton.jit function is defined: decode_reduce on the CPU

sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "eval"))

import triton  # noqa: E402
from bench_kernels import graph_bench, make_pool, pool_bytes  # noqa: E402

from kivi_cache import reference  # noqa: E402
from kivi_cache.kernels import decode as KD  # noqa: E402
from kivi_cache.kernels import decode_merge as KM  # noqa: E402
from kivi_cache.kernels import decode_plan as KP  # noqa: E402
from kivi_cache.kernels import paged_decode_attention  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SIM = args.sim and DEV.type == "cpu"


def bench(fn):
    """graph_bench (GPU), or one wall-clock call in ms (--sim on the CPU)."""
    if SIM:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return graph_bench(fn, rep=args.rep)


def num_sms():
    return 132 if SIM else torch.cuda.get_device_properties(DEV).multi_processor_count


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------- Gluon module
def load_gluon(name, env):
    """A copy of gluon_decode.py imported with ``env``'s GD_* flags (read at import) as module ``gd_<name>``."""
    flags = {k: v for k, v in env.items() if k.startswith("GD_")}
    spec = importlib.util.spec_from_file_location(f"gd_{name}", os.path.join(HERE, "gluon_decode.py"))
    mod = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ, flags):
        for k in [k for k in os.environ if k.startswith("GD_") and k not in flags]:
            os.environ.pop(k)  # a GD_* of the caller's shell does not leak into a variant
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


def gluon_runner(mod, env, pool, q, kb, vb, g, sm_scale, ns):
    """(split launch, workspace (m, l, o)) of the transposed Gluon kernel; ws in decode_reduce's layout."""
    bsz, hq, d = q.shape
    kw = pool["k_codes"].view(torch.int32)
    vw = pool["v_codes"].view(torch.int32)
    ks, kz, vs, vz = pool["k_scale"], pool["k_zero"], pool["v_scale"], pool["v_zero"]
    hkv = kw.shape[1]
    fn = mod.gluon_decode_t_kernel
    bits = {}
    if "KBITS" in fn.arg_names:
        bits = dict(KBITS=kb, VBITS=vb)
    elif (kb, vb) != (4, 4):
        raise NotImplementedError(f"this gluon_decode.py has no KBITS/VBITS: 4/4 only, not {kb}/{vb}")
    if vb == 2 and (int(mod.VFOLD) or int(mod.VEARLY)):
        raise NotImplementedError("GD_VFOLD / GD_VEARLY: 4-bit values only")
    if g != 32 or d != D or pool["k_codes"].shape[2] != PAGE:
        raise NotImplementedError("the Gluon kernel: group 32, head_dim 128, page 64 only")
    if hq // hkv > 8:
        raise NotImplementedError("the Gluon kernel: at most 8 query heads per KV head")
    rows = bsz * hq
    ws_o = torch.empty(rows, ns, d, device=q.device, dtype=torch.float32)
    ws_m = torch.empty(rows, ns, device=q.device, dtype=torch.float32)
    ws_l = torch.empty(rows, ns, device=q.device, dtype=torch.float32)
    extra = {"maxnreg": int(env["R"])} if env.get("R") else {}
    bt, lengths = pool["block_table"], pool["lengths"]

    if SIM:  # the CPU test of this script: what the kernel should write, from torch
        def launch():
            m, l_, o = torch_partials(pool, q, kb, vb, g, sm_scale, ns)
            ws_m.copy_(m)
            ws_l.copy_(l_)
            ws_o.copy_(o)

        return launch, (ws_m, ws_l, ws_o)

    def launch():
        return fn[(bsz * hkv, ns)](q, bt, lengths, kw, ks, kz, vw, vs, vz, ws_m, ws_l, ws_o, sm_scale * LOG2E, hkv, ns,
                            q.stride(0), q.stride(1), bt.stride(0), kw.stride(0), kw.stride(1), ks.stride(0),
                            ks.stride(1), vw.stride(0), vw.stride(1), vs.stride(0), vs.stride(1),
                            GROUP=hq // hkv, VALUES=1, num_warps=1, **bits, **extra)

    return launch, (ws_m, ws_l, ws_o)


def torch_merge(ws_m, ws_l, ws_o, bsz, hq):
    top = ws_m.max(1, keepdim=True).values
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    wgt = torch.exp2(ws_m - top)
    den = (wgt * ws_l).sum(1)
    return ((wgt[:, :, None] * ws_o).sum(1) / torch.where(den > 0, den, 1.0)[:, None]).reshape(bsz, hq, -1)


def torch_partials(pool, q, kb, vb, g, sm_scale, ns):
    """What a split kernel writes (the kernels' split rule, log2-domain maxima), from the reference's dequantized
    pages: (m, l, o) [B * Hq, ns(, D)] fp32. For the CPU dry run (the merge and the workspace layout)."""
    bsz, hq, d = q.shape
    k, v = reference.dequantize_pages(pool["block_table"], pool["lengths"], pool["k_codes"], pool["k_scale"],
                                      pool["k_zero"], pool["v_codes"], pool["v_scale"], pool["v_zero"], kb, vb, g)
    hkv = k.shape[1]
    k = k.float().repeat_interleave(hq // hkv, 1)
    v = v.float().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("bhd,bhtd->bht", q.float(), k) * (sm_scale * LOG2E)
    m = torch.full((bsz, hq, ns), -math.inf)
    l_ = torch.zeros(bsz, hq, ns)
    o = torch.zeros(bsz, hq, ns, d)
    for b in range(bsz):
        n = int(pool["lengths"][b])
        pps = triton.cdiv(triton.cdiv(n, PAGE), ns)
        for sp in range(ns):
            t0, t1 = sp * pps * PAGE, min((sp + 1) * pps * PAGE, n)
            if t1 <= t0:
                continue
            sb = s[b, :, t0:t1]
            m[b, :, sp] = sb.max(-1).values
            p = torch.exp2(sb - m[b, :, sp, None])
            l_[b, :, sp] = p.sum(-1)
            o[b, :, sp] = torch.einsum("ht,htd->hd", p, v[b, :, t0:t1])
    return m.reshape(bsz * hq, ns), l_.reshape(bsz * hq, ns), o.reshape(bsz * hq, ns, d)


# ------------------------------------------------------------------------------------------------ existing op
def op_args(pool, q, rk, rv, rl, kb, vb, g, sm):
    return (q, pool["block_table"], pool["lengths"], pool["k_codes"], pool["k_scale"], pool["k_zero"],
            pool["v_codes"], pool["v_scale"], pool["v_zero"], rk, rv, rl, kb, vb, g, sm)


def op_splits(a):
    """(paged splits, partial columns) of the existing op's automatic plan for these arguments (its workspace's
    plan, after a first call has fixed the kernel's residency)."""
    seen = []
    real = KD._workspace

    def spy(plan, d, device, shared=False):
        seen.append(plan)
        return real(plan, d, device, shared)

    paged_decode_attention(*a)
    with mock.patch.object(KD, "_workspace", spy):
        paged_decode_attention(*a)
    plan = seen[-1]
    return int(plan.ints[1]), int(plan.nsp1)


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def sub_pool(pool, nb, tokens):
    sub = dict(pool)
    sub["block_table"] = pool["block_table"][:nb, :-(-tokens // PAGE)].contiguous()
    sub["lengths"] = torch.full((nb,), tokens, dtype=torch.int32, device=pool["lengths"].device)
    return sub


def ref_out(pool, q, rk, rv, rl, kb, vb, g, sm):
    a = op_args(pool, q, rk, rv, rl, kb, vb, g, sm)
    f32 = [x.float() if torch.is_tensor(x) and x.is_floating_point() else x for x in a]
    return reference.paged_decode_attention(*f32).float()


# ------------------------------------------------------------------------------------------------------ main
rows, failures = [], []
meta = dict(torch=torch.__version__, triton=triton.__version__,
            gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            timing="cuda graph replay (bench_kernels.graph_bench), medians of alternating rounds",
            window="residual window EMPTY for both kernels (res_lengths 0): the Gluon kernel cannot read one",
            merge="Gluon partials merged by kivi_cache.kernels.decode_merge.decode_reduce (timed, as the existing "
                  "op's merge kernel); the existing op also runs its empty window program per pair",
            splits="Gluon NS = the existing op's automatic paged split count, unless a variant sets RES",
            head_dim=D, q_heads=HQ, page=PAGE,
            mode=("SIM: CPU test of the script, torch partials in place of the Gluon kernel, wall-clock times"
                  if SIM else "dry run (CPU)" if args.dry_run else "gpu"), argv=sys.argv[1:])


def save():
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta, rows=rows, failures=failures), f, indent=1)


def check(label, err):
    ok = err <= args.tol
    log(f"  {label}: rel max err {err:.2e} {'ok' if ok else f'FAIL (> {args.tol:.0e})'}")
    if not ok:
        failures.append(dict(check=label, err=err))
    return err


def build_check():
    """Each variant's module copy (its flags, its argument list) and its sm_90 build per bit setting (no GPU)."""
    for n, env in variants:  # the module copies import on the CPU (no launch): flags and the argument list
        mod = load_gluon(n, env)
        fn = mod.gluon_decode_t_kernel
        nargs = 28 + sum(x in fn.arg_names for x in ("KBITS", "VBITS"))  # what gluon_runner passes
        ok = len(fn.arg_names) == nargs
        log(f"variant {n}: {env} -> gd_{n}: PF={int(mod.PF)} VFOLD={int(mod.VFOLD)}, {len(fn.arg_names)} kernel "
            f"arguments ({'ok' if ok else f'MISMATCH, launcher passes {nargs}'}), 2-bit: {'KBITS' in fn.arg_names}")
        if not ok:
            failures.append(dict(check=f"variant {n} arguments", err=len(fn.arg_names)))
        for kb, vb, _g in bit_settings:  # the sm_90 build (no GPU needed): registers and spills per bit setting
            if vb == 2 and (int(mod.VFOLD) or int(mod.VEARLY)):
                continue
            try:
                import sass_gluon
                t0 = time.time()
                k = sass_gluon.compile_kernel(fn, dict(GROUP=4, VALUES=1, KBITS=kb, VBITS=vb),
                                              int(env["R"]) if env.get("R") else None)
                res, sass = sass_gluon.disassemble(k)
                loop = next((c for c in sass_gluon.loops(sass) if any(x.startswith("HMMA") for x in c[1])), (0,))
                usage = " ".join(re.findall(r"(?:REG|LOCAL|SHARED):\d+", res))
                log(f"  {n} k{kb}v{vb}: sm_90 build {time.time() - t0:.1f} s (Triton {triton.__version__}): "
                    f"{usage}, paged loop {loop[0]} instructions")
            except Exception as e:  # noqa: BLE001
                log(f"  {n} k{kb}v{vb}: sm_90 build FAILED: {type(e).__name__}: {str(e)[:1500]}")
                failures.append(dict(check=f"variant {n} k{kb}v{vb} build", err=str(e)[:300]))


def dry_run():
    log("dry run (CPU, Triton interpreter for the existing kernels): tiny pools, reference, torch partials merged "
        "by decode_reduce and by torch; no Gluon launch, no timing")
    # the variants' modules and sm_90 builds in a child process without the interpreter (with TRITON_INTERPRET=1,
    # triton.language's combine functions are interpreted functions and a Gluon build fails)
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--build-check", "--variants", args.variants,
                        "--bits", args.bits], env=env)
    if r.returncode:
        failures.append(dict(check="variants' sm_90 builds (--build-check)", err=f"rc {r.returncode}"))
    gen = torch.Generator(device=DEV).manual_seed(0)
    sm = D ** -0.5
    for b, hkv, ctx in ((2, 2, 256), (1, 4, 320)):
        for kb, vb, g in bit_settings:
            pool = make_pool(b, hkv, ctx, D, PAGE, g, kb, vb, DEV, gen)
            q = torch.randn(b, HQ // 4 if hkv == 2 else HQ // 2, D, device=DEV, dtype=torch.float16, generator=gen)
            hq = q.shape[1]
            rk = torch.zeros(b, hkv, g, D, device=DEV, dtype=torch.float16)
            rv = torch.zeros_like(rk)
            rl = torch.zeros(b, dtype=torch.int32, device=DEV)
            a = op_args(pool, q, rk, rv, rl, kb, vb, g, sm)
            ns, nsp1 = op_splits(a)
            log(f"{b}x{hkv}x{ctx} k{kb}v{vb}g{g} Hq {hq}: existing op's plan: {ns} paged splits, {nsp1} partial "
                f"columns; bytes {pool_bytes(pool, b, hkv, ctx, D, PAGE, g, kb, vb, 0, hq)}")
            ref = ref_out(pool, q, rk, rv, rl, kb, vb, g, sm)
            for nsx in sorted({ns, 3}):
                m, l_, o = torch_partials(pool, q, kb, vb, g, sm, nsx)
                out = torch.empty(b, hq, D, dtype=torch.float16, device=DEV)
                KM.decode_reduce(m, l_, o, out, hq)
                check(f"NS={nsx} torch partials + decode_reduce vs reference", rel_err(out, ref))
                check(f"NS={nsx} torch partials + torch merge vs reference", rel_err(torch_merge(m, l_, o, b, hq), ref))
            sub = sub_pool(pool, min(2, b), min(ctx, 128))
            ref_s = ref_out(sub, q[:2], rk[:2], rv[:2], rl[:2], kb, vb, g, sm)
            cur_s = paged_decode_attention(*op_args(sub, q[:2], rk[:2], rv[:2], rl[:2], kb, vb, g, sm))
            check("slice: existing op (interpreter) vs reference", rel_err(cur_s, ref_s))


def gpu_run():
    t_start = time.time()
    sm = D ** -0.5
    mods = {}
    for n, env in variants:
        mods[n] = load_gluon(n, env)
        log(f"variant {n}: {env} -> module gd_{n} (PF={int(mods[n].PF)}, VFOLD={int(mods[n].VFOLD)})")
    def out_of_time(what):
        """Past --max-s: ``what`` is logged and recorded as not run."""
        if time.time() - t_start <= args.max_s:
            return False
        log(f"{what}: skipped, {time.time() - t_start:.0f} s > --max-s {args.max_s:.0f}")
        failures.append(dict(check=f"{what} not run (--max-s)", err="time"))
        return True

    for b, hkv, ctx in shapes:
        shape = f"{b}x{hkv}x{ctx}"
        if out_of_time(shape):
            continue
        q4 = torch.randn(b, HQ, 1, D, device=DEV, dtype=torch.float16)
        q = q4[:, :, 0].contiguous()
        kf = torch.randn(b, hkv, ctx, D, device=DEV, dtype=torch.float16)
        vf = torch.randn(b, hkv, ctx, D, device=DEV, dtype=torch.float16)
        def sdpa(q4=q4, kf=kf, vf=vf):
            return torch.nn.functional.scaled_dot_product_attention(q4, kf, vf, enable_gqa=True)

        t_sdpa = statistics.median(bench(sdpa) for _ in range(args.rounds))
        del kf, vf, sdpa
        for kb, vb, g in bit_settings:
            tag = f"{shape} k{kb}v{vb}g{g}"
            if out_of_time(tag):
                continue
            gen = torch.Generator(device=DEV).manual_seed(0)
            pool = make_pool(b, hkv, ctx, D, PAGE, g, kb, vb, DEV, gen)
            rk = torch.zeros(b, hkv, g, D, device=DEV, dtype=torch.float16)
            rv = torch.zeros_like(rk)
            rl = torch.zeros(b, dtype=torch.int32, device=DEV)
            nbytes = pool_bytes(pool, b, hkv, ctx, D, PAGE, g, kb, vb, 0, HQ)
            a = op_args(pool, q, rk, rv, rl, kb, vb, g, sm)
            ns, nsp1 = op_splits(a)
            log(f"{tag}: existing op: {ns} paged splits ({nsp1} partial columns incl. the window's); "
                f"{nbytes / 1e6:.1f} MB; sdpa {t_sdpa:.4f} ms")
            # correctness: a slice against the reference, then the full outputs against each other
            nb, ts = min(2, b), min(ctx, args.slice_tokens)
            sub = sub_pool(pool, nb, ts)
            sargs = (q[:nb], rk[:nb], rv[:nb], rl[:nb])
            ref_s = ref_out(sub, *sargs, kb, vb, g, sm)
            errs = {"cur": check(f"{tag} slice {nb}x{ts}: existing vs reference",
                                 rel_err(paged_decode_attention(*op_args(sub, *sargs, kb, vb, g, sm)), ref_s))}
            cur_full = paged_decode_attention(*a).float()
            # the unfused path (split + merge kernel), as a graph capture takes it, compiled here, not while capturing
            paged_decode_attention(*a, merge=False)
            fns, nss, builds = {"cur": lambda a=a: paged_decode_attention(*a)}, {"cur": ns}, {}
            for n, env in variants:
                try:
                    nsv = ns
                    if env.get("RES"):
                        nsv = KP.split_count(b, hkv, ctx, num_sms(), int(env["RES"]), 0)  # no window programs
                    sl, (m_, l_, o_) = gluon_runner(mods[n], env, sub, q[:nb], kb, vb, g, sm, ns)
                    kern = sl()  # the compiled kernel (GPU): its registers and spills go to the rows
                    if kern is not None and hasattr(kern, "n_regs"):
                        builds[n] = dict(regs=int(kern.n_regs), spills=int(kern.n_spills))
                        log(f"  {tag} gluon {n}: {builds[n]['regs']} registers, {builds[n]['spills']} spills")
                    out_s = torch.empty(nb, HQ, D, device=DEV, dtype=torch.float16)
                    KM.decode_reduce(m_, l_, o_, out_s, HQ)
                    errs[n] = check(f"{tag} slice: gluon {n} (NS {ns}) vs reference", rel_err(out_s, ref_s))
                    check(f"{tag} slice: gluon {n} torch merge vs decode_reduce",
                          rel_err(torch_merge(m_, l_, o_, nb, HQ), out_s))
                    launch, (m_, l_, o_) = gluon_runner(mods[n], env, pool, q, kb, vb, g, sm, nsv)
                    out = torch.empty(b, HQ, D, device=DEV, dtype=torch.float16)

                    def run(launch=launch, m_=m_, l_=l_, o_=o_, out=out):
                        launch()
                        KM.decode_reduce(m_, l_, o_, out, HQ)
                        return out

                    run()
                    check(f"{tag} full: gluon {n} (NS {nsv}) vs existing", rel_err(run(), cur_full))
                    fns[n], nss[n] = run, nsv
                except NotImplementedError as e:  # a setting this variant does not cover: skipped, not failed
                    log(f"  {tag} gluon {n}: skipped ({e})")
                except Exception as e:  # noqa: BLE001  (a compile error of one variant: the others still run)
                    log(f"  {tag} gluon {n}: {type(e).__name__}: {str(e)[:400]}")
                    failures.append(dict(check=f"{tag} gluon {n}", err=f"{type(e).__name__}: {str(e)[:400]}"))
            times = {n: [] for n in fns}
            for _ in range(args.rounds):
                for n, f in fns.items():
                    times[n].append(bench(f))
            base = statistics.median(times["cur"])
            for n in fns:
                t = statistics.median(times[n])
                r = dict(impl=n, env=dict(variants).get(n, {}), batch=b, kv_heads=hkv, q_heads=HQ, head_dim=D,
                         context=ctx, key_bits=kb, value_bits=vb, group=g, num_splits=nss[n], ms=t,
                         ms_rounds=times[n], sdpa_ms=t_sdpa, tbps=nbytes / t / 1e9, speedup=t_sdpa / t,
                         vs_existing=base / t, slice_rel_err=errs.get(n), bytes=nbytes, **builds.get(n, {}))
                rows.append(r)
                log(f"{tag} {n:>9} NS {nss[n]:4d}: {t:.4f} ms {r['tbps']:.2f} TB/s  x{r['speedup']:.2f} vs sdpa  "
                    f"x{r['vs_existing']:.3f} vs existing  rounds {[round(x, 4) for x in times[n]]}")
            del pool
            save()
        log(f"-- {shape} done at {time.time() - t_start:.0f} s")


if args.build_check:
    build_check()
elif args.dry_run:
    dry_run()
else:
    gpu_run()
save()
if failures:
    log(f"FAILED checks: {len(failures)}")
    for f in failures:
        log(f"  FAIL {f}")
    sys.exit(1)
log("all checks ok")

"""Count the SASS instructions of the decode kernel's main loop, on a machine without a GPU.

Triton's wheel ships ptxas and nvdisasm, so the kernel can be compiled for sm_90 here and its
inner loop inspected: instructions per step by opcode, registers, spills. The decode kernel is instruction-bound,
so this count follows its speed; tests/test_sass.py holds the kernel to a budget with it.

    python tests/sass/sass_decode.py [KEY=VALUE ...]   e.g. KBITS=2 VBITS=2 GP=4 G=32 D=128
    The constexprs PSTAGES, RSTAGES, VHINT and KSZ default to what the launch sets with the default tuning
    (kernels.tuning.DecodeTuning: 5 and 1 stages, the _vhint and _ksz policies); PSTAGES=3 builds 3 stages.
    env (of this script): W (warps, default 1), S (num_stages; default PSTAGES, the paged loop's depth, as the
         launch sets it), R (maxnreg, default 0 = none; the kernel caps 32-token steps at 128, which this script
         does not: pass R=128 there), DUMP=prefix (write prefix.sass/.ptx/.ttgir)
    The last line printed is a JSON summary (used by tests/test_sass.py): spills = STL/LDL in the paged loop,
    spills_total = in the whole kernel, warps_per_sm = resident warps the registers allow (steps of 4 on sm_90:
    8 at 169-256 registers, 12 at 129-168, 16 at <= 128).
"""

import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kivi_cache.kernels import _util, decode_plan, decode_split  # noqa: E402
from kivi_cache.kernels.tuning import DecodeTuning  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTRS = {"q_ptr": "*fp16", "bt_ptr": "*i32", "len_ptr": "*i32", "kw_ptr": "*i32", "ks_ptr": "*fp16",
        "kz_ptr": "*fp16", "vw_ptr": "*i32", "vs_ptr": "*fp16", "vz_ptr": "*fp16", "rk_ptr": "*fp16",
        "rv_ptr": "*fp16", "rlen_ptr": "*i32", "m_ws": "*fp32", "l_ws": "*fp32", "o_ws": "*fp32", "nk_ptr": "*fp16",
        "nv_ptr": "*fp16", "out_ptr": "*fp16", "cnt_ptr": "*i32"}


def signature(fn, const, ptrs):
    """A decode kernel's compile signature as its launch gives it: ``ptrs`` (name -> pointer type) 16-byte aligned,
    ``const`` constexprs, ``qk_scale`` fp32, every other argument i32 (strides ``s_*`` multiples of 16)."""
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in ptrs:
            sig[n] = ptrs[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in const:
            sig[n] = "constexpr"
        elif n == "qk_scale":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n.startswith("s_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_kernel(const, warps, stages, maxnreg):
    fn = decode_split._decode_split_kernel
    # constexpr parameters with defaults (NEWKV, MERGE, ...) keep them unless given
    const = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty},
             **const}
    sig, attrs = signature(fn, const, PTRS)
    if const.get("BF16"):
        for n in ("q_ptr", "ks_ptr", "kz_ptr", "vs_ptr", "vz_ptr", "rk_ptr", "rv_ptr", "nk_ptr", "nv_ptr", "out_ptr"):
            sig[n] = "*bf16"
    opts = dict(num_warps=warps, num_stages=stages, **_util.FP_FUSION)  # as the launch sets them
    if maxnreg:
        opts["maxnreg"] = maxnreg
    src = ASTSource(fn, sig, constexprs={k: v for k, v in const.items() if k in fn.arg_names}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def disassemble(kernel):
    """A compiled kernel's cubin -> (cuobjdump resource usage, nvdisasm SASS text), with Triton's own tools."""
    with tempfile.TemporaryDirectory() as tmp:
        cub = os.path.join(tmp, "k.cubin")
        open(cub, "wb").write(kernel.asm["cubin"])
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", cub], capture_output=True,
                             text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", cub], capture_output=True, text=True).stdout
    return res, sass


def loops(sass):
    ins, labels = [], {}
    for line in sass.splitlines():
        m = re.match(r"\s*\.L_x_(\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(2).strip())
    for i, t in enumerate(ins):
        lab = re.search(r"BRA\s+`\(\.L_x_(\d+)\)", t)
        if lab and labels.get(lab.group(1), 1 << 30) < i:
            body = ins[labels[lab.group(1)]:i + 1]
            yield len(body), collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for x in body), body


def spill_count(ops: collections.Counter) -> int:
    """Spill instructions (local-memory stores and loads) in one loop's opcode counts."""
    return sum(v for k, v in ops.items() if k.startswith(("STL", "LDL")))


def summary(argv):
    """Build the kernel for the KEY=VALUE strings ``argv`` (env as in the module docstring), print the report and
    return the summary dict (main prints it as the JSON line; sass_batch.py collects it)."""
    const = dict(GROUP=4, GP=4, D=128, P=64, G=32, BLOCK=64, BLOCK_R=32, KBITS=4, VBITS=4, DOT_F32=False, KASM=True,
                 VASM=True, BF16=False, VW32=True)
    const.update({k: int(v) for k, v in (a.split("=") for a in argv)})
    st = decode_plan._stages(False, DecodeTuning())  # the launch's pipelining defaults
    const.setdefault("PSTAGES", st["PSTAGES"])
    const.setdefault("RSTAGES", st["RSTAGES"])
    # VHINT and KSZ as the launch sets them (their policies)
    const.setdefault("VHINT", decode_plan._vhint(const["D"], const["BLOCK"], const["KBITS"], const["VBITS"],
                                                 DecodeTuning())["VHINT"])
    const.setdefault("KSZ", decode_plan._ksz(const["D"], const["KBITS"], bool(const["BF16"]), DecodeTuning())["KSZ"])
    warps = int(os.environ.get("W", 1))
    k = compile_kernel(const, warps, int(os.environ.get("S", const["PSTAGES"])), int(os.environ.get("R", 0)))
    res, sass = disassemble(k)
    if os.environ.get("DUMP"):  # env DUMP=prefix: write prefix.sass, prefix.ptx, prefix.ttgir
        for ext, key in (("sass", None), ("ptx", "ptx"), ("ttgir", "ttgir")):
            with open(f"{os.environ['DUMP']}.{ext}", "w") as f:
                f.write(sass if key is None else k.asm[key])
    print(const)
    smem = k.metadata.shared  # bytes of shared memory per program (Triton's pipeline buffers and layout scratch)
    print(" ".join(re.findall(r"(?:REG|LOCAL|SHARED):\d+", res)))
    reg = int(re.search(r"REG:(\d+)", res).group(1))
    print(f"shared memory {smem} B per program; programs per SM (registers and shared memory, as the split "
          f"rule counts them): {decode_plan.resident_programs(reg, smem, warps)}")
    codes = const["BLOCK"] * const["D"] * 2 // 32  # codes per lane per step (1 warp)
    found = list(loops(sass))
    for n, c, _ in found:
        print(f"loop: {n} instructions per step; spills in loop {spill_count(c)}; top: "
              + ", ".join(f"{k} {v}" for k, v in c.most_common(12)))
    print(f"(a step of the paged loop covers {const['BLOCK']} tokens = {codes} codes per lane with 1 warp)")
    n, c, body = found[0]  # the paged loop comes first
    # cp.async.wait_group count at the top of the paged loop: 0 = each step waits for every copy in flight,
    # including the next step's (no overlap of load latency with math); > 0 = the next step's copies stay in flight
    waits = [int(w, 16) for w in re.findall(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", "\n".join(body))]
    spills = spill_count(c)
    total = len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\s", sass))  # spill instructions anywhere in the kernel
    # resident warps per SM (cuda_occupancy.h, sm_90): registers are allocated per warp in units of 256
    warps_sm = decode_plan.warps_by_registers(reg)
    return dict(instructions=n, codes_per_lane=codes, per_code=n / codes, spills=spills,
                shared=smem, loop_waits=waits, spills_total=total,
                loop_spills=[spill_count(c_) for _, c_, _ in found], reg=reg, warps_per_sm=warps_sm,
                hmma=sum(v for k, v in c.items() if k.startswith("HMMA")),
                bssy=c.get("BSSY", 0),  # branch-wrapped sections in the paged loop (3.6's guarded copies: _ksz)
                atom_acq_rel_gpu=len(re.findall(r"atom\.global\.gpu\.acq_rel\.", k.asm["ptx"])),
                ld_cg=len(re.findall(r"ld\.global\.cg", k.asm["ptx"])),
                cp_async_16=len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*, 0x10", k.asm["ptx"])))


def main():
    print(json.dumps(summary(sys.argv[1:])))


if __name__ == "__main__":
    main()

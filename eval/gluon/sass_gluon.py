"""Compile the Gluon decode spike for sm_90 on a CPU and count the SASS of its paged loop.

    PYTHONPATH=/tmp/t36site python eval/gluon/sass_gluon.py [VALUES=1] [DUMP=prefix]
(Triton 3.6 from /tmp/t36site; nvdisasm/cuobjdump from Triton's wheel; disassembly and loop finding from
eval/sass_decode.py)
"""
import json
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gluon_decode  # noqa: E402
from sass_decode import disassemble, loops, signature, spill_count  # noqa: E402  (the Triton kernel's SASS tools)

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTRS = {"q_ptr": "*fp16", "bt_ptr": "*i32", "len_ptr": "*i32", "kw_ptr": "*i32", "ks_ptr": "*fp16",
        "kz_ptr": "*fp16", "vw_ptr": "*i32", "vs_ptr": "*fp16", "vz_ptr": "*fp16", "m_ws": "*fp32", "l_ws": "*fp32",
        "o_ws": "*fp32"}


def compile_kernel(fn, const, maxnreg=None):
    sig, attrs = signature(fn, const, PTRS)
    opts = dict(num_warps=1)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    src = GluonASTSource(fn, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def main(argv):
    const = dict(GROUP=4, VALUES=1)
    fn = gluon_decode.gluon_decode_t_kernel if os.environ.get("GD_T", "0") == "1" else gluon_decode.gluon_decode_kernel
    if "KBITS" in fn.arg_names:  # the transposed kernel: KBITS=2 VBITS=2 for 2-bit codes
        const.update(KBITS=4, VBITS=4)
    const.update({k: int(v) for k, v in (a.split("=") for a in argv)
                  if k in ("GROUP", "VALUES", "KBITS", "VBITS")})
    k = compile_kernel(fn, const, int(os.environ.get("R", 0)) or None)
    res, sass = disassemble(k)
    if os.environ.get("DUMP"):
        for ext, key in (("sass", None), ("ptx", "ptx"), ("ttgir", "ttgir"), ("llir", "llir")):
            with open(f"{os.environ['DUMP']}.{ext}", "w") as f:
                f.write(sass if key is None else k.asm[key])
    reg = int(re.search(r"REG:(\d+)", res).group(1))
    print(const, " ".join(re.findall(r"(?:REG|LOCAL|SHARED):\d+", res)), "shared(meta)", k.metadata.shared)
    codes = 64 * 128 * (2 if const["VALUES"] else 1) // 32
    found = list(loops(sass))
    for n, c, _ in found:
        spills = spill_count(c)
        print(f"loop: {n} instructions, {spills} spill instructions; top: "
              + ", ".join(f"{a} {b}" for a, b in c.most_common(16)))
    # the paged loop = the first loop with MMAs (the transposed kernel's masked last step follows it as a second,
    # one-trip loop; the FA2 kernel has none)
    n, c, body = next(f for f in found if any(k.startswith("HMMA") for k in f[1]))
    mem = {o: sum(v for kk, v in c.items() if kk.startswith(o)) for o in ("LDG", "STS", "LDS", "LDSM", "STL", "LDL",
                                                                          "HMMA", "SHFL", "LOP3", "SHF", "HFMA2",
                                                                          "PRMT", "MUFU", "BAR")}
    total_spills = len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\s", sass))
    out = dict(instructions=n, spills_total=total_spills, codes_per_lane=codes, per_code=round(n / codes, 3), reg=reg,
               shared=k.metadata.shared,
               **mem)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])

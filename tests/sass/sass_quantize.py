"""Build the quantize_and_write kernel for sm_90 on a machine without a GPU (Triton's wheel ships ptxas).

    python tests/sass/sass_quantize.py [KEY=VALUE ...]   e.g. KBITS=2 VBITS=4 G=32 D=128 SPLIT=1 SDT=bf16 DT=fp16
                                                         CLIP_K=1 (the clipping search for the key groups)
Prints a JSON line: registers, spill instructions, SASS instruction count. The interpreter never compiles, so
this is where compile-only problems of the kernel show up on the CPU (tests/test_sass.py runs it).
"""

import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kivi_cache.kernels import _util, quantize  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_decode import disassemble  # noqa: E402


def summary(argv):
    """Build the kernel for the KEY=VALUE strings ``argv``; the summary dict (main prints it as the JSON line)."""
    const = dict(G=32, D=128, KBITS=4, VBITS=4, SPLIT=1, RECIP=True, CLIP_K=0, CLIP_V=0, PTX=1)
    types = dict(DT="fp16", SDT="fp16")
    for a in argv:
        k, v = a.split("=")
        if k in types:
            types[k] = v
        else:
            const[k] = int(v)
    const["BUMP_K"] = const["BUMP_V"] = types["SDT"] != "fp32"
    fn = quantize._quantize_write_kernel
    missing = [fn.arg_names[i] for i in fn.constexprs if fn.arg_names[i] not in const]
    if missing:  # it would build as a runtime argument, both sides of its branches compiled
        raise SystemExit(f"sass_quantize.py: no value for the kernel's constexprs {missing}")
    ptrs = {"k_ptr": types["DT"], "v_ptr": types["DT"], "pages_ptr": "i64", "slots_ptr": "i64", "kc_ptr": "u8",
            "vc_ptr": "u8", "ks_ptr": types["SDT"], "kz_ptr": types["SDT"], "vs_ptr": types["SDT"],
            "vz_ptr": types["SDT"]}
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in ptrs:
            sig[n] = "*" + ptrs[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in const:
            sig[n] = "constexpr"
        else:
            sig[n] = "i32"
    src = ASTSource(fn, sig, constexprs={k: v for k, v in const.items() if k in fn.arg_names}, attrs=attrs)
    opts = dict(num_warps=4, **_util.FP_FUSION)  # as the launch sets them
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    res, sass = disassemble(k)
    ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)
    return {"registers": int(re.search(r"REG:(\d+)", res).group(1)),
            "spills": sum(1 for x in ins if re.search(r"\b(STL|LDL)", x)), "instructions": len(ins)}


def main():
    print(json.dumps(summary(sys.argv[1:])))


if __name__ == "__main__":
    main()

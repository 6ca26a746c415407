"""The inline PTX of kernels/unpack.py, run by a tiny PTX interpreter on the CPU.

The CPU tests run a plain-Triton emulation of the GPU path; this checks the PTX strings themselves
(byte/bit placement, magic constants, shifts, folded fma operands) against the codes' definition:
value = c * s + z with the one extra rounding of z - 2**bits s. fp16 only (numpy rounds fp16 exactly;
the bf16 strings differ only in constants and are checked for their field placement).
"""

import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels"))
import unpack  # noqa: E402

M32 = 0xFFFFFFFF


def _h2(x):
    return np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16)


def _from_h2(h):
    v = np.asarray(h, dtype=np.float16).view(np.uint16)
    return int(v[0]) | int(v[1]) << 16


def run_ptx(src: str, ops: dict) -> dict:
    """Executes the subset of PTX the unpack strings use; ``ops`` maps "$i" / register names to uint32."""
    regs = dict(ops)

    def val(t):
        t = t.strip()
        if t.startswith("0x"):
            return int(t, 16)
        if re.fullmatch(r"-?\d+", t):
            return int(t) & M32
        return regs[t]

    for line in src.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [x.strip() for x in args.split(",")]
        d = a[0]
        if op == "prmt.b32":
            src8 = val(a[1]).to_bytes(4, "little") + val(a[2]).to_bytes(4, "little")
            sel = val(a[3])
            regs[d] = int.from_bytes(bytes(src8[(sel >> (4 * i)) & 7] for i in range(4)), "little")
        elif op == "shl.b32":
            regs[d] = (val(a[1]) << val(a[2])) & M32
        elif op == "shr.u32":
            regs[d] = val(a[1]) >> val(a[2])
        elif op == "mov.b32":
            regs[d] = val(a[1])
        elif op == "lop3.b32":
            x, y, z, lut = val(a[1]), val(a[2]), val(a[3]), val(a[4])
            r = 0
            for bit in range(32):
                i = ((x >> bit) & 1) << 2 | ((y >> bit) & 1) << 1 | ((z >> bit) & 1)
                r |= ((lut >> i) & 1) << bit
            regs[d] = r
        elif op in ("fma.rn.f16x2", "mul.rn.f16x2"):
            x, y = _h2(val(a[1])).astype(np.float64), _h2(val(a[2])).astype(np.float64)
            z = _h2(val(a[3])).astype(np.float64) if op.startswith("fma") else 0.0
            regs[d] = _from_h2((x * y + z).astype(np.float16))  # exact in float64, one rounding
        else:
            raise NotImplementedError(op)
    return regs


def _pair(lo, hi):
    return _from_h2(np.array([lo, hi], dtype=np.float16))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("odd", [False, True])
@pytest.mark.parametrize("srcmin", unpack.SRCMINS)
def test_pairs_ptx(bits, odd, srcmin):
    rng = np.random.default_rng(bits + 2 * odd + srcmin)
    n = 8 // bits
    src = unpack._asm(bits, False, odd, srcmin)
    for _ in range(50):
        word = int(rng.integers(0, 1 << 32))
        byts = word.to_bytes(4, "little")
        ops = {f"${2 * n}": word}
        ref = {}
        for k in range(n):
            for p in range(2):
                e = unpack.fold_exp(bits, False, odd, k, p, srcmin)
                s = rng.uniform(0.01, 0.5, 2).astype(np.float16)
                z = rng.uniform(-2, 2, 2).astype(np.float16)
                zf = (z.astype(np.float64) - s.astype(np.float64) * (1 << e)).astype(np.float16)
                ops[f"${2 * n + 1 + 4 * k + 2 * p}"] = _pair(*s)
                ops[f"${2 * n + 2 + 4 * k + 2 * p}"] = _pair(*zf)
                bi = (p, p + 2) if odd else (2 * p, 2 * p + 1)  # bytes in the low, high half
                c = [(byts[b] >> (k * bits)) & ((1 << bits) - 1) for b in bi]
                ref[f"${2 * k + p}"] = [(c[h] + (1 << e)) * float(s[h]) + float(zf[h]) for h in range(2)]
                # the folded form is c * s + z up to the fold's one rounding, which field() bounds by s * 2**-(1+pos)
                pos = unpack.field(bits, False, odd, k, p, srcmin)[0]
                exact = [c[h] * float(s[h]) + float(z[h]) for h in range(2)]
                bound = [float(s[h]) * 2.0 ** (-1 - pos) + 2 ** -10 * (abs(exact[h]) + 1) for h in range(2)]
                assert all(abs(ref[f"${2 * k + p}"][h] - exact[h]) <= bound[h] for h in range(2))
        out = run_ptx(src, ops)
        for key, r in ref.items():
            got = _h2(out[key]).astype(np.float64)
            np.testing.assert_array_equal(got, np.array(r).astype(np.float16).astype(np.float64))


def test_exact_fields_are_the_top_of_the_mantissa():
    """The default reads a code in place only where it already sits in the top bits (the old shifts' target)."""
    for bits in (2, 4):
        for bf16 in (False, True):
            for odd in (False, True):
                for k in range(8 // bits):
                    for p in (0, 1):
                        assert unpack.fold_exp(bits, bf16, odd, k, p) == bits
    # and the in-place reads remove shifts: 2-bit keys (plane 0), more with a lower SRCMIN
    shifts = {m: unpack._asm(2, False, False, m).count("sh") for m in unpack.SRCMINS}
    assert shifts[unpack.EXACT] == 6 and shifts[6] == 4 and shifts[4] == 2
    assert unpack._asm(4, False, False, 4).count("sh") == 2 and unpack._asm(4, False, False).count("sh") == 4


@pytest.mark.parametrize("e", [2, 4, 6])
def test_fold_ptx(e):
    rng = np.random.default_rng(e)
    for _ in range(50):
        s = rng.uniform(0.01, 0.5, 2).astype(np.float16)
        z = rng.uniform(-2, 2, 2).astype(np.float16)
        want = (z.astype(np.float64) - s.astype(np.float64) * (1 << e)).astype(np.float16)
        out = run_ptx(unpack._fold_asm(e, False), {"$1": _pair(*s), "$2": _pair(*z)})
        np.testing.assert_array_equal(_h2(out["$0"]), want)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("odd", [False, True])
@pytest.mark.parametrize("srcmin", unpack.SRCMINS)
def test_pairs_ptx_bf16_fields(bits, odd, srcmin):
    """bf16: after shift + lop3 the code sits in the mantissa of 2**e, e = fold_exp (checked on the bits)."""
    n = 8 // bits
    src = unpack._asm(bits, True, odd, srcmin).replace("fma.rn.bf16x2", "mov.b32")
    src = re.sub(r"mov\.b32 (\$\d+), u, \$\d+, \$\d+", r"mov.b32 \1, u", src)
    rng = np.random.default_rng(7)
    for _ in range(20):
        word = int(rng.integers(0, 1 << 32))
        byts = word.to_bytes(4, "little")
        out = run_ptx(src, {f"${2 * n}": word})
        for k in range(n):
            for p in range(2):
                bi = (p, p + 2) if odd else (2 * p, 2 * p + 1)
                e = unpack.fold_exp(bits, True, odd, k, p, srcmin)
                for h in range(2):
                    c = (byts[bi[h]] >> (k * bits)) & ((1 << bits) - 1)
                    half = (out[f"${2 * k + p}"] >> (16 * h)) & 0xFFFF
                    v = np.array([half << 16], dtype=np.uint32).view(np.float32)[0]
                    assert v == (1 << e) + c


def test_odd_pairs_ptx():
    a, b = _pair(1.0, 2.0), _pair(3.0, 4.0)  # channels (4w, 4w+1), (4w+2, 4w+3)
    out = run_ptx(unpack.ODD_PAIRS.value, {"$2": a, "$3": b})
    np.testing.assert_array_equal(_h2(out["$0"]), [1.0, 3.0])
    np.testing.assert_array_equal(_h2(out["$1"]), [2.0, 4.0])

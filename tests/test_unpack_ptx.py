"""The inline PTX of the decode kernel's unpack, checked without a GPU: a tiny interpreter for the four
instructions it uses (shl, shr, lop3 with the (a & b) | c table, packed fma) runs the generated text on
random words and folded scales and must give ``c * s + z`` for the codes the planar layout puts there
(written out here from the documented layout, not taken from the kernels)."""

import re

import pytest
import torch

from kivi_cache.kernels.unpack import _asm


def _halves(x: int, dtype):
    h = torch.tensor([x & 0xFFFF, (x >> 16) & 0xFFFF], dtype=torch.int32).to(torch.int16).view(dtype)
    return h.double()


def _pack(lo: float, hi: float, dtype) -> int:
    h = torch.tensor([lo, hi], dtype=torch.float64).to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(h[0]) | int(h[1]) << 16


def run_ptx(text: str, operands: list[int], dtype) -> list[int]:
    """Execute the PTX block; $i are 32-bit operands (outputs first, written in place)."""
    regs = {f"${i}": v for i, v in enumerate(operands)}

    def val(tok):
        tok = tok.strip()
        return int(tok, 16) if tok.startswith("0x") else regs[tok]

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [t.strip() for t in args.split(",")]
        if op == "shl.b32":
            regs[a[0]] = (val(a[1]) << int(a[2])) & 0xFFFFFFFF
        elif op == "shr.u32":
            regs[a[0]] = val(a[1]) >> int(a[2])
        elif op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "lop3.b32":
            assert a[4] == "0xEA", line  # (a & b) | c
            regs[a[0]] = (val(a[1]) & val(a[2])) | val(a[3])
        elif re.fullmatch(r"fma\.rn\.(f16|bf16)x2", op):
            x, y, z = (_halves(val(t), dtype) for t in a[1:4])
            r = x * y + z  # exact in float64 for these inputs, rounded once below
            regs[a[0]] = _pack(float(r[0]), float(r[1]), dtype)
        else:
            raise AssertionError(f"unexpected PTX instruction: {line}")
    return [regs[f"${i}"] for i in range(len(operands))]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unpack_ptx_gives_c_times_s_plus_z(bits, dtype):
    n = 8 // bits
    gen = torch.Generator().manual_seed(bits)
    text = _asm(bits, dtype == torch.bfloat16)
    for _ in range(50):
        word = int(torch.randint(0, 1 << 32, (1,), generator=gen, dtype=torch.int64))
        byte = [(word >> (8 * i)) & 0xFF for i in range(4)]
        s = (torch.rand(2 * n, 2, generator=gen) * 0.1 + 0.001).to(dtype).double()
        z = (torch.rand(2 * n, 2, generator=gen) - 0.5).to(dtype).double()
        sf, zf = s * (1 << bits), (z - s * (1 << bits)).to(dtype).double()  # folded as in fold_scale
        ins = [word]
        for k in range(n):
            for p in range(2):
                i = 2 * k + p
                ins += [_pack(float(sf[i, 0]), float(sf[i, 1]), dtype), _pack(float(zf[i, 0]), float(zf[i, 1]), dtype)]
        out = run_ptx(text, [0] * (2 * n) + ins, dtype)
        for k in range(n):
            for p in range(2):
                i = 2 * k + p
                # pair p of plane k: channels 4w + 2p (byte p) and 4w + 2p + 1 (byte p + 2)
                codes = [(byte[p] >> (k * bits)) & ((1 << bits) - 1), (byte[p + 2] >> (k * bits)) & ((1 << bits) - 1)]
                got = _halves(out[i], dtype)
                for h in range(2):
                    want = torch.tensor((1 + codes[h] / (1 << bits)) * sf[i, h].item() + zf[i, h].item(),
                                        dtype=torch.float64).to(dtype).double()
                    assert got[h] == want, (bits, dtype, k, p, h, codes, float(got[h]), float(want))
                    assert abs(float(got[h]) - (codes[h] * s[i, h].item() + z[i, h].item())) <= 2e-2 * (
                        1 + abs(z[i, h].item()))

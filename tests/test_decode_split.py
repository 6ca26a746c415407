"""kernels/decode_split.py: helpers of the split kernel run alone, in a probe kernel, against torch."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from kernel_cases import DEV

from kivi_cache.kernels import decode_split as KS


@triton.jit
def _key_words_probe(s_ptr, z_ptr, out_ptr, s_row, GPS: tl.constexpr, D: tl.constexpr, NK: tl.constexpr):
    """Stores the plane tiles of KS._key_words4 (NK 4) or KS._key_words2 (NK 2) one after another: out [2 NK, GPS,
    D/(2 NK)], (s, z) of plane 0, then plane 1, ..."""
    g = tl.arange(0, GPS)
    srow = (s_ptr + g * s_row).to(tl.pointer_type(tl.float16), bitcast=True)
    zrow = (z_ptr + g * s_row).to(tl.pointer_type(tl.float16), bitcast=True)
    o = out_ptr + g[:, None] * (D // (2 * NK)) + tl.arange(0, D // (2 * NK))[None, :]
    n: tl.constexpr = GPS * (D // (2 * NK))
    if NK == 4:
        s0, z0, s1, z1, s2, z2, s3, z3 = KS._key_words4(srow, zrow, D)
        tl.store(o + 4 * n, s2)
        tl.store(o + 5 * n, z2)
        tl.store(o + 6 * n, s3)
        tl.store(o + 7 * n, z3)
    else:
        s0, z0, s1, z1 = KS._key_words2(srow, zrow, D)
    tl.store(o, s0)
    tl.store(o + n, z0)
    tl.store(o + 2 * n, s1)
    tl.store(o + 3 * n, z1)


@pytest.mark.parametrize("nk", [4, 2], ids=["2bit", "4bit"])
def test_key_words_split_every_planes_words(nk):
    """_key_words4 / _key_words2 (KSZ, 2-/4-bit keys): one [2, GPS, D/2] load of the step's key scale
    and zero words, split in registers into plane k = words k D/(2 NK) .. (k+1) D/(2 NK) of each group row; checked
    here against torch slicing on random words (the decode kernel takes this path only with the GPU's inline-PTX
    unpack, which the interpreter cannot run)."""
    for gps, d in ((1, 64), (2, 64), (2, 128), (4, 256)):
        row = d // 2 + 3  # rows of the pools are further apart than a row's words (as the page pools' groups are)
        s = torch.randint(-2**31, 2**31 - 1, (gps, row), dtype=torch.int32, device=DEV)
        z = torch.randint(-2**31, 2**31 - 1, (gps, row), dtype=torch.int32, device=DEV)
        w = d // (2 * nk)
        out = torch.full((2 * nk, gps, w), -7, dtype=torch.int32, device=DEV)  # poisoned
        _key_words_probe[(1,)](s, z, out, row, GPS=gps, D=d, NK=nk)
        want = torch.stack([t[:, k * w:(k + 1) * w] for k in range(nk) for t in (s, z)])
        assert torch.equal(out, want), (gps, d)

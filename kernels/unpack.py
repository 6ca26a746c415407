"""Codes -> dequantized fp16/bf16 values inside the attention kernel (registers only).

The decode kernel loads packed codes as int32 words (4 bytes of one token's row).
Planar packing: byte ``j`` of a row holds channel ``j + k * row_bytes`` of plane
``k`` in bits ``[k * bits, (k + 1) * bits)``, ``k < 8 // bits``. So word ``w`` holds
channels ``4w .. 4w + 3`` of every plane.

``pairs_*`` turn a word tile ``[N, W]`` into, per plane ``k`` and byte pair
``p`` (bytes ``2p, 2p + 1``), an int32 tile whose two 16-bit halves are the
dequantized fp16/bf16 values of channels ``4w + 2p`` and ``4w + 2p + 1``;
:func:`plane` reassembles a plane as ``[N, 4W]`` in natural channel order (a
register relabelling: join, permute, reshape).

* ``pairs_asm`` (GPU, 2/4-bit codes): one PTX block per word. ``prmt`` spreads
  bytes ``2p, 2p+1`` into the low bytes of the two halves; per plane a shift and
  one ``lop3`` put the code in the top mantissa bits of ``2**bits`` (``v = 2**bits + c``,
  exact) and one packed ``fma`` gives ``v * s + (z - 2**bits s) = c s + z``:
  1.75 instructions per code, no integer-to-float conversions. The extra rounding
  of ``z - 2**bits s`` is at most 2**-11 (fp16) of ``|z| + 2**bits s``. (Same
  products and sums as with ``v = 1 + c / 2**bits`` and the scale ``2**bits s``,
  bit for bit, without the multiply that made ``2**bits s``.)
* ``pairs_emulated``: the same pairs from the same folded scales in plain Triton
  (fp32 math, then rounded): runs in the interpreter (CPU tests of everything but
  the PTX) and for 8-bit codes.

Scales enter as they are, zero points folded to ``z - 2**bits s`` (:func:`fold_scale`), both
packed as pairs (:func:`pack2`), the layout of the fma operands. A code that already sits in the top
mantissa bits of a half is not shifted there (2-bit keys, plane 0); ``SRCMIN`` (``DecodeTuning.srcmin``,
default exact) also lets codes lower in the mantissa be read in place, with the zero point folded with a
larger power of two (:func:`field`: fewer shifts, a larger rounding of the folded zero point).
"""

from __future__ import annotations

import triton
import triton.language as tl

# SRCMIN of the fields a code may be read from without a shift (see ``field``): ``EXACT`` reads only
# fields already at the top of the mantissa (results bit-identical to shifting every code there).
EXACT = 16
SRCMINS = (EXACT, 6, 4)


def field(bits: int, bf16: bool, odd: bool, k: int, p: int, srcmin: int = EXACT) -> tuple[int, int]:
    """Where the unpack of plane ``k``, pair ``p`` reads its code: ``(pos, shift)``, the code's bit position in
    each half after ``shift`` (> 0 left, < 0 right, 0 none) of the pair's source register. A code already at a
    position ``pos`` with ``pos + bits <= mantissa`` and ``pos >= min(srcmin, top)`` is taken there (no shift);
    its value is then ``2**(mantissa - pos) + c`` and the zero point is folded with that power of two
    (:func:`fold_exp`). The fold's one rounding is at most ``s * 2**(-1 - pos)`` (fp16): ``s / 2**(11 - bits)`` at
    the top position ``mantissa - bits`` (the only one with ``srcmin = EXACT``), ``s / 32`` at position 4.
    Sources: without ``odd`` the pair's register holds byte ``2p`` (``2p + 1``) twice in the low (high) half, so a
    code sits at ``k * bits`` and ``8 + k * bits``; with ``odd`` the word itself, byte ``p`` (``p + 2``) at
    ``8p + k * bits``."""
    mant = 7 if bf16 else 10
    top = mant - bits
    srcs = [8 * p + k * bits] if odd else [8 + k * bits, k * bits]
    for src in srcs:
        if src + bits <= mant and src >= min(srcmin, top):
            return src, 0
    return top, top - srcs[-1]


def fold_exp(bits: int, bf16: bool, odd: bool, k: int, p: int, srcmin: int = EXACT) -> int:
    """The power of two the zero point of plane ``k``, pair ``p`` is folded with: ``z - 2**e s`` (``bits`` at the
    top position)."""
    return (7 if bf16 else 10) - field(bits, bf16, odd, k, p, srcmin)[0]


def _asm(bits: int, bf16: bool, odd: bool = False, srcmin: int = EXACT) -> str:
    """PTX for one word. Operands: outputs $(2k+p) for plane k, pair p; input word $n2 (n2 = 2 * planes);
    then per plane k, pair p: scale $(n2+1+4k+2p), zero $(n2+2+4k+2p) (folded with ``fold_exp``). Pair p holds
    bytes (2p, 2p + 1) (channels 4w + 2p, 4w + 2p + 1); with ``odd`` bytes (p, p + 2) instead (channels 4w + p,
    4w + p + 2): they already sit in the two halves of the word, so a shift of the whole word replaces the prmt.
    Each code is read where :func:`field` says: a shift (unless it is already in place) and one ``lop3``."""
    n = 8 // bits
    n2 = 2 * n
    mant = 7 if bf16 else 10
    fma = "fma.rn.bf16x2" if bf16 else "fma.rn.f16x2"
    if odd:
        lines = ["{", ".reg .b32 u;"]
    else:
        lines = ["{", ".reg .b32 t0, t1, u;",
                 f"prmt.b32 t0, ${n2}, ${n2}, 0x1100;",  # bytes 0, 1 -> halves 0, 1 (each byte twice)
                 f"prmt.b32 t1, ${n2}, ${n2}, 0x3322;"]  # bytes 2, 3
    for k in range(n):
        for p in range(2):
            t = f"${n2}" if odd else f"t{p}"
            pos, sh = field(bits, bf16, odd, k, p, srcmin)
            e = mant - pos  # the value is 2**e + c: its ulp is 1
            one = (127 + e) << 7 if bf16 else (15 + e) << 10
            magic = f"0x{one | one << 16:08X}"
            fld = ((1 << bits) - 1) << pos
            mask = f"0x{fld | fld << 16:08X}"
            if sh > 0:
                lines.append(f"shl.b32 u, {t}, {sh};")
            elif sh < 0:
                lines.append(f"shr.u32 u, {t}, {-sh};")
            else:
                lines.append(f"mov.b32 u, {t};")
            lines.append(f"lop3.b32 u, u, {mask}, {magic}, 0xEA;")  # (u & mask) | magic
            lines.append(f"{fma} ${2 * k + p}, u, ${n2 + 1 + 4 * k + 2 * p}, ${n2 + 2 + 4 * k + 2 * p};")
    lines.append("}")
    return "\n".join(lines)


def _fold_asm(e: int, bf16: bool) -> str:
    """PTX folding a pair of zero points (two packed halves): $0 = z - 2**e * s (one rounding), from
    $1 = s, $2 = z. The scale pair itself is the fma's multiplier as it is."""
    one = (127 + e) << 7 if bf16 else (15 + e) << 10
    t = "bf16x2" if bf16 else "f16x2"
    return "\n".join(["{", ".reg .b32 c;", f"mov.b32 c, 0x{(one | 0x8000) * 0x10001:08X};",
                      f"fma.rn.{t} $0, $1, c, $2;", "}"])


def _constraints(bits: int) -> str:
    n = 8 // bits
    return ",".join(["=r"] * (2 * n) + ["r"] * (1 + 4 * n))


PAIRS = tl.constexpr({(b, f, o, m): _asm(b, f, o, m) for b in (2, 4) for f in (False, True) for o in (False, True)
                     for m in SRCMINS})


def fold_key(bits: int, bf16: bool, odd: bool, srcmin: int) -> int:
    """The integer key of ``FOLD_E`` for plane 0, pair 0 (plane k, pair p: ``(key * 8 + k) * 2 + p``). An int, not a
    tuple: Triton 3.6's interpreter cannot index a constexpr dict with a tuple. The kernels compute it inline."""
    return ((bits * 2 + bf16) * 2 + odd) * 32 + srcmin


FOLD_E = tl.constexpr({(fold_key(b, f, o, m) * 8 + k) * 2 + p: fold_exp(b, f, o, k, p, m) for b in (2, 4, 8)
                      for f in (False, True) for o in (False, True) for m in SRCMINS for k in range(8 // b)
                      for p in (0, 1)})
FOLDS = tl.constexpr({(e, f): _fold_asm(e, f) for e in range(1, 11) for f in (False, True)})
CON4 = tl.constexpr(_constraints(4))
CON2 = tl.constexpr(_constraints(2))


@triton.jit
def fold_scale(s, z, E: tl.constexpr, DT: tl.constexpr):
    """(s, z - 2**E * s) in DT (fp16/bf16): the fma operands of ``pairs_asm`` (``E``: :func:`fold_exp`, ``bits``
    for a code at the top of the mantissa). Computed in DT (packed half2 math on the GPU): the product is exact,
    the difference rounded once, as in fp32."""
    sd = s.to(DT)
    return sd, z.to(DT) - sd * (1 << E)


@triton.jit
def fold_pairs_asm(s, z, E: tl.constexpr, BF16: tl.constexpr):
    """``fold_scale`` on int32 tiles that hold (scale, scale) and (zero, zero) pairs of adjacent channels,
    as loaded from the fp16/bf16 pools viewed as int32: one packed fma per pair (GPU only)."""
    ASM: tl.constexpr = FOLDS[(E, BF16)]
    return s, tl.inline_asm_elementwise(ASM, "=r,r,r", [s, z], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def pack2(lo, hi):
    """Two fp16/bf16 tensors -> int32 with ``lo`` in bits 0-15 and ``hi`` in bits 16-31."""
    a = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    b = hi.to(tl.int16, bitcast=True).to(tl.int32)
    return a | (b << 16)


@triton.jit
def pack_channel_pairs(x, DT: tl.constexpr, ODD: tl.constexpr = False):
    """x [R, W, 4] (channel 4w + b) -> (pair 0, pair 1), each [R, W] int32 holding channels (4w, 4w+1) and
    (4w+2, 4w+3); with ``ODD`` (4w, 4w+2) and (4w+1, 4w+3)."""
    even, odd = tl.split(tl.reshape(x.to(DT), [x.shape[0], x.shape[1], 2, 2]))
    if ODD:
        e0, e1 = tl.split(even)
        o0, o1 = tl.split(odd)
        return pack2(e0, e1), pack2(o0, o1)
    p0, p1 = tl.split(pack2(even, odd))
    return p0, p1


ODD_PAIRS = tl.constexpr("prmt.b32 $0, $2, $3, 0x5410;\nprmt.b32 $1, $2, $3, 0x7632;")


@triton.jit
def odd_pairs_asm(a, b):
    """Pairs of channels (4w, 4w+1), (4w+2, 4w+3) -> ODD pairs (4w, 4w+2), (4w+1, 4w+3): two prmt (GPU)."""
    return tl.inline_asm_elementwise(ODD_PAIRS, "=r,=r,r,r", [a, b], dtype=(tl.int32, tl.int32), is_pure=True,
                                     pack=1)


@triton.jit
def unpack_half(x, DT: tl.constexpr):
    """int32 pair tile -> (low half, high half) as DT."""
    lo = x.to(tl.int16).to(DT, bitcast=True)
    hi = (x >> 16).to(tl.int16).to(DT, bitcast=True)
    return lo, hi


@triton.jit
def _opaque(x):
    """Identity on packed halves (a register move ptxas removes; GPU only) that Triton's operand-width
    analysis (``computeOrigBitWidth``) does not look through: past a ``tl.join`` it would otherwise
    pick 4-element-wide MMA operands (kWidth 4)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


@triton.jit
def plane(p0, p1, DT: tl.constexpr, CUT: tl.constexpr = False, ASM: tl.constexpr = True):
    """Pairs 0 and 1 of a plane, [N, W] int32 each -> [N, 4W] DT in natural channel order. ``CUT``:
    MMA operands built from it get the plain 2-wide layout (kWidth 2; the identity asm only with ``ASM``,
    on the GPU): used for value tiles, which go through shared memory (transposed by ``ldmatrix``)
    anyway and with kWidth 4 come out of it split across MMAs (one register move per fragment register)."""
    a0, a1 = unpack_half(p0, DT)
    a2, a3 = unpack_half(p1, DT)
    if CUT:  # [N, W, pair, half]: the two halves of a pair in one register, as the unpack made them
        x = tl.join(tl.join(a0, a2), tl.join(a1, a3))
        if ASM:
            x = _opaque(x)
    else:
        lo, hi = unpack_half(tl.join(p0, p1), DT)  # [N, W, pair]
        x = tl.join(lo, hi)  # [N, W, pair, half]: channel 4w + 2 * pair + half
    return tl.reshape(x, [p0.shape[0], 4 * p0.shape[1]])


@triton.jit
def pairs_asm(words, s0, z0, s1, z1, s2, z2, s3, z3, s4, z4, s5, z5, s6, z6, s7, z7,
              BITS: tl.constexpr, BF16: tl.constexpr, ODD: tl.constexpr = False, SRCMIN: tl.constexpr = EXACT):
    """words [N, W] int32; (s2k+p, z2k+p): packed folded scales of plane k, pair p (broadcastable to
    words; planes beyond 8 // BITS are ignored; zero points folded with ``fold_exp(..., SRCMIN)``). Returns
    2 * (8 // BITS) int32 tiles, plane-major. ``ODD``: pair p holds channels (4w + p, 4w + p + 2) (see ``_asm``)."""
    if BITS == 4:
        return tl.inline_asm_elementwise(PAIRS[(BITS, BF16, ODD, SRCMIN)], CON4,
                                         [words, s0, z0, s1, z1, s2, z2, s3, z3],
                                         dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(PAIRS[(BITS, BF16, ODD, SRCMIN)], CON2,
                                         [words, s0, z0, s1, z1, s2, z2, s3, z3, s4, z4, s5, z5, s6, z6, s7, z7],
                                         dtype=(tl.int32,) * 8, is_pure=True, pack=1)


@triton.jit
def pair_emulated(words, k: tl.constexpr, p: tl.constexpr, sp, zp, BITS: tl.constexpr, DT: tl.constexpr,
                  ODD: tl.constexpr = False, E: tl.constexpr = 0):
    """Plane k, pair p of ``pairs_asm`` in plain Triton (fp32 math): c * s + z = (2**E + c) * s + zf, zf the zero
    point folded with ``E`` (0: ``BITS``)."""
    EF: tl.constexpr = E if E > 0 else BITS
    s_lo, s_hi = unpack_half(sp, DT)
    z_lo, z_hi = unpack_half(zp, DT)
    lo: tl.constexpr = 8 * p if ODD else 16 * p  # bit offset of the low half's byte
    hi: tl.constexpr = 8 * p + 16 if ODD else 16 * p + 8
    c_lo = (words >> (lo + k * BITS)) & ((1 << BITS) - 1)
    c_hi = (words >> (hi + k * BITS)) & ((1 << BITS) - 1)
    v_lo = (c_lo + (1 << EF)).to(tl.float32) * s_lo.to(tl.float32) + z_lo.to(tl.float32)
    v_hi = (c_hi + (1 << EF)).to(tl.float32) * s_hi.to(tl.float32) + z_hi.to(tl.float32)
    return pack2(v_lo.to(DT), v_hi.to(DT))


@triton.jit
def plane_emulated(words, k: tl.constexpr, s0, z0, s1, z1, BITS: tl.constexpr, DT: tl.constexpr,
                   CUT: tl.constexpr = False, ODD: tl.constexpr = False, E0: tl.constexpr = 0, E1: tl.constexpr = 0):
    """Plane k as [N, 4W] DT from the emulated pairs 0 and 1 (scales as for ``pairs_asm``, folded with ``E0``/``E1``;
    ``CUT`` as for :func:`plane`, without the asm; ``ODD`` as for ``pairs_asm``: position 4w + 2p + h holds channel
    4w + p + 2h)."""
    return plane(pair_emulated(words, k, 0, s0, z0, BITS, DT, ODD, E0),
                 pair_emulated(words, k, 1, s1, z1, BITS, DT, ODD, E1), DT, CUT, False)


@triton.jit
def plane_plain(words, k: tl.constexpr, s, z, BITS: tl.constexpr, DT: tl.constexpr):
    """fp32 path: plane k of words [N, W] as [N, 4W] DT, from unfolded s, z [*, W, 4] (channel 4w + b)."""
    b = tl.arange(0, 4)[None, None, :]
    c = (words[:, :, None] >> (8 * b + k * BITS)) & ((1 << BITS) - 1)
    v = (c.to(tl.float32) * s.to(tl.float32) + z.to(tl.float32)).to(DT)
    return tl.reshape(v, [words.shape[0], 4 * words.shape[1]])


# ----------------------------------------------------------------------------- transposed value pages (VT2)
# Value codes stored per page as channel rows with the codes packed along tokens: word w of a row holds tokens
# T w .. T w + T - 1 (T = 32 // bits), byte p plane k holding token T w + 2 (p % 2 + 2 k) + p // 2, so that the
# ODD unpack (pairs = bytes (q, q + 2)) gives registers of two consecutive tokens (the MMA operand's k-pairs).


@triton.jit
def _plane_tokens(p0, p1, DT: tl.constexpr):
    """Pairs q = 0, 1 of one plane ([R, Wd] int32, halves h = tokens 2q + h of the plane's 4) -> [R, Wd, 4] DT."""
    lo, hi = unpack_half(tl.join(p0, p1), DT)  # [R, Wd, q]
    x = tl.join(lo, hi)  # [R, Wd, q, h]
    return tl.reshape(x, [p0.shape[0], p0.shape[1], 4])


@triton.jit
def plane_token_tile(p0, p1, DT: tl.constexpr):
    """One plane's ODD pairs of a transposed word tile ([R, Wd] int32 each) -> [R, 4 Wd] DT: the plane's tokens
    T w + 4 k + j in order of (w, j) (a strided subset of the step's tokens; ``plane_rows`` picks P's rows)."""
    x = _plane_tokens(p0, p1, DT)
    return tl.reshape(x, [x.shape[0], x.shape[1] * 4])


@triton.jit
def plane_rows(p, k: tl.constexpr, NP: tl.constexpr):
    """Rows T w + 4 k + j of p [BLOCK, N] (T = 4 NP tokens per word) in order of (w, j): [BLOCK / NP, N]."""
    wd: tl.constexpr = p.shape[0] // (4 * NP)
    # no early return: Triton's compiler still builds the statements after a constexpr-if's return (their reshapes
    # then fail for NP == 1, 8-bit values)
    if NP == 1:
        r = p
    elif NP == 2:
        x = tl.permute(tl.reshape(p, [wd, 2, 4, p.shape[1]]), (0, 2, 3, 1))
        a, b = tl.split(x)
        r = a if k == 0 else b
    else:
        x = tl.permute(tl.reshape(p, [wd, 2, 2, 4, p.shape[1]]), (0, 3, 4, 2, 1))  # [wd, j, N, k0, k1], k = 2 k1 + k0
        lo, hi = tl.split(x)
        y = lo if k // 2 == 0 else hi
        a, b = tl.split(y)
        r = a if k % 2 == 0 else b
    return tl.reshape(r, [p.shape[0] // NP, p.shape[1]])


@triton.jit
def token_plane_plain(words, k: tl.constexpr, s_row, z_row, BITS: tl.constexpr):
    """fp32 path: plane k of a transposed word tile [R, Wd] -> fp32 [R, 4 Wd] in the order of
    :func:`plane_token_tile` (token TW w + 4 k + j), with per-token scales and zeros loaded from ``s_row``/``z_row``
    (the group's token-contiguous rows at the step's first token)."""
    tw: tl.constexpr = 32 // BITS
    j = tl.arange(0, 4)
    sh = 8 * ((j // 2) % 2 + 2 * (j % 2)) + k * BITS  # token 2q + h of the plane sits in byte q + 2h
    c = (words[:, :, None] >> sh[None, None, :]) & ((1 << BITS) - 1)  # [R, Wd, j]
    tok = (tl.arange(0, words.shape[1])[:, None] * tw + 4 * k + j[None, :])[None, :, :]
    v = c.to(tl.float32) * tl.load(s_row + tok).to(tl.float32) + tl.load(z_row + tok).to(tl.float32)
    return tl.reshape(v, [words.shape[0], 4 * words.shape[1]])


@triton.jit
def join_planes2(v0, v1):
    """Plane tiles [R, 4 Wd] (token TW w + 4 k + j in order (w, j)) of 2 planes -> [R, 8 Wd] in token order."""
    x = tl.join(tl.reshape(v0, [v0.shape[0], v0.shape[1] // 4, 4]), tl.reshape(v1, [v1.shape[0], v1.shape[1] // 4, 4]))
    return tl.reshape(tl.permute(x, (0, 1, 3, 2)), [v0.shape[0], 2 * v0.shape[1]])  # [R, w, k, j]


@triton.jit
def join_planes4(v0, v1, v2, v3):
    """As :func:`join_planes2` for 4 planes -> [R, 16 Wd] in token order."""
    r: tl.constexpr = v0.shape[0]
    wd: tl.constexpr = v0.shape[1] // 4
    x = tl.join(tl.join(tl.reshape(v0, [r, wd, 4]), tl.reshape(v1, [r, wd, 4])),
                tl.join(tl.reshape(v2, [r, wd, 4]), tl.reshape(v3, [r, wd, 4])))  # [R, w, j, k0, k1], k = k0 + 2 k1
    return tl.reshape(tl.permute(x, (0, 1, 4, 3, 2)), [r, 4 * v0.shape[1]])

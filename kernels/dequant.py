"""In-register dequantization of page tiles, and dequantize_pages.

The two ``@triton.jit`` helpers here are shared with the attention kernels:
they read a block of ``BLOCK`` tokens of one page (``BLOCK`` divides the page
and is a multiple of G) straight from the packed codes and return the
dequantized ``[BLOCK, D]`` tile in fp32. Keys: planar unpacking, channel ``d``
is byte ``d % (D // n)`` of its token's row, shifted by ``(d // (D // n)) * bits``,
scales and zeros loaded once per group (``[BLOCK // G, 1, D]``). Values: channel
rows packed along tokens (:mod:`kivi_cache.quant`), per-token scales and zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _util, checks
from ._util import block_tokens, check_pool_strides, check_settings, interpreting


@triton.jit
def _key_tile(kc_base, ks_base, kz_base, off, valid_groups, s_kct, s_ksg,
              BLOCK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Keys of tokens ``off .. off + BLOCK`` of a page -> fp32 [BLOCK, D].

    kc_base/ks_base/kz_base point at (page, head); ``valid_groups`` [BLOCK//G, 1, 1]
    masks the scale/zero loads (masked groups dequantize to 0).
    """
    NG: tl.constexpr = BLOCK // G
    N: tl.constexpr = 8 // BITS
    DN: tl.constexpr = D // N
    MASK: tl.constexpr = (1 << BITS) - 1
    g3 = tl.arange(0, NG)[:, None, None]
    t3 = tl.arange(0, G)[None, :, None]
    d3 = tl.arange(0, D)[None, None, :]
    raw = tl.load(kc_base + (off + g3 * G + t3) * s_kct + (d3 % DN)).to(tl.int32)
    if N == 1:
        c = raw
    else:
        c = (raw >> ((d3 // DN) * BITS)) & MASK
    soff = (off // G + g3) * s_ksg + d3
    s = tl.load(ks_base + soff, mask=valid_groups, other=0.0).to(tl.float32)
    z = tl.load(kz_base + soff, mask=valid_groups, other=0.0).to(tl.float32)
    k = c.to(tl.float32) * s + z
    return tl.reshape(k, [BLOCK, D])


@triton.jit
def _value_tile(vc_base, vs_base, vz_base, off, valid_tok, s_vcd, s_vsg,
                BLOCK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Values of tokens ``off .. off + BLOCK`` of a page -> fp32 [BLOCK, D].

    Channel rows packed along tokens (row stride ``s_vcd`` bytes): token t is in byte
    ``4 (t // TW) + (t // 2) % 2 + 2 (t % 2)`` at bits ``((t % TW) // 4) * BITS`` (``TW = 32 // BITS``); scales and
    zeros ``[D // G, P]`` (row stride ``s_vsg``). ``valid_tok`` [BLOCK, 1] masks their loads (masked tokens are 0).
    """
    TW: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    t = off + tl.arange(0, BLOCK)[:, None]
    d = tl.arange(0, D)[None, :]
    r = t % TW
    raw = tl.load(vc_base + d * s_vcd + (t // TW) * 4 + (r // 2) % 2 + 2 * (r % 2)).to(tl.int32)
    c = (raw >> ((r // 4) * BITS)) & MASK
    soff = (d // G) * s_vsg + t
    s = tl.load(vs_base + soff, mask=valid_tok, other=0.0).to(tl.float32)
    z = tl.load(vz_base + soff, mask=valid_tok, other=0.0).to(tl.float32)
    return c.to(tl.float32) * s + z


@triton.jit
def _dequant_kernel(
    bt_ptr,  # [B, W] int block table
    len_ptr,  # [B] int quantized tokens per sequence
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,  # the pool (kernels/quantize.py's layout)
    ko_ptr, vo_ptr,  # [B, H, T, D] dequantized keys and values (zeros past each length)
    H, T, s_btb,  # KV heads, output tokens, block table row stride
    s_kcp, s_kch, s_kct, s_ksp, s_ksh, s_ksg,
    s_vcp, s_vch, s_vct, s_vsp, s_vsh, s_vst,
    s_ob, s_oh, s_ot,
    P: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    KBITS: tl.constexpr, VBITS: tl.constexpr,
):
    pid = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    b = pid // H
    h = pid % H
    length = tl.load(len_ptr + b).to(tl.int32)
    has = start < length
    page = tl.load(bt_ptr + b.to(tl.int64) * s_btb + start // P, mask=has, other=0).to(tl.int64)
    page = tl.maximum(page, 0)
    off = start % P
    NG: tl.constexpr = BLOCK // G
    gvalid = (start + tl.arange(0, NG) * G < length)[:, None, None]
    tvalid = (start + tl.arange(0, BLOCK) < length)[:, None]
    k = _key_tile(kc_ptr + page * s_kcp + h * s_kch, ks_ptr + page * s_ksp + h * s_ksh,
                  kz_ptr + page * s_ksp + h * s_ksh, off, gvalid, s_kct, s_ksg, BLOCK, G, D, KBITS)
    v = _value_tile(vc_ptr + page * s_vcp + h * s_vch, vs_ptr + page * s_vsp + h * s_vsh,
                    vz_ptr + page * s_vsp + h * s_vsh, off, tvalid, s_vct, s_vst, BLOCK, G, D, VBITS)
    tt = start + tl.arange(0, BLOCK)
    ok = (tt < length)[:, None]
    k = tl.where(ok, k, 0.0)
    v = tl.where(ok, v, 0.0)
    o = b.to(tl.int64) * s_ob + h * s_oh + tt[:, None] * s_ot + tl.arange(0, D)[None, :]
    st = (tt < T)[:, None]
    tl.store(ko_ptr + o, k.to(ko_ptr.dtype.element_ty), mask=st)
    tl.store(vo_ptr + o, v.to(vo_ptr.dtype.element_ty), mask=st)


def dequantize_pages(block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                     key_bits: int, value_bits: int, group_size: int, max_len: int | None = None, *, out=None):
    """Triton twin of :func:`kivi_cache.reference.dequantize_pages`.

    Returns k, v ``[B, H, T, D]`` in the scale dtypes; zero at or past each length.
    ``max_len=None`` reads ``lengths.max()`` (one device sync). ``out=(k, v)``
    preallocated ``[B, H, T, D]`` floating outputs on the pool's device (last dim contiguous, the same strides) are
    written in place if given (converted to their dtype).
    """
    pool = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    np_, h, p, d = checks.check_pool(pool, key_bits, value_bits, group_size)
    b = checks.check_tables(block_table, lengths, np_, p, device=k_codes.device)
    checks.check_max_len(max_len)
    check_settings(d, key_bits, value_bits, group_size, p)
    check_pool_strides(pool)
    t = int(lengths.max()) if (max_len is None and b > 0) else (max_len or 0)
    if out is None:
        k_out = torch.empty(b, h, t, d, dtype=k_scale.dtype, device=k_scale.device)
        v_out = torch.empty(b, h, t, d, dtype=v_scale.dtype, device=v_scale.device)
    else:
        k_out, v_out = checks.check_dequant_out(out, (b, h, t, d), k_codes.device)
    if b == 0 or t == 0 or h == 0:
        return k_out, v_out
    blk = block_tokens(p, group_size, 256 if interpreting() else 32)
    lengths = lengths.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    grid = (b * h, triton.cdiv(t, blk))
    _dequant_kernel[grid](
        block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_out, v_out,
        h, t, block_table.stride(0),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        v_codes.stride(0), v_codes.stride(1), v_codes.stride(2),
        v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
        k_out.stride(0), k_out.stride(1), k_out.stride(2),
        P=p, G=group_size, D=d, BLOCK=blk, KBITS=key_bits, VBITS=value_bits,
        num_warps=4, **_util.FP_FUSION,
    )
    return k_out, v_out

"""Merging the decode op's split partials: the merge kernel ``_decode_reduce_kernel`` (launched by
:func:`decode_reduce`, and by the op with the plan's :func:`_reduce_launch` settings) and :func:`_merge_pair`, the
same merge run by the split kernel's last program of a (sequence, KV head) where it merges in place (``MERGE``).

The partials are the split kernel's fp32 workspace ``[B * Hq, NS + NR(, D)]``: per (sequence, query head) row and per
split program, the running max (exp2 domain), the sum of weights and the unnormalized output. The merge kernel's grid
is ``(B * Hq, D / DB)``: program ``(row, dc)`` merges channels ``[dc DB, (dc + 1) DB)`` of one row with the
log-sum-exp rule and writes them to ``out`` ``[B, Hq, D]`` in out's dtype. Learned attention sinks (``SINK``: one
logit per query head, natural log) join the maximum and the sum, on no value.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _merge_chunk(m_ws, o_ws, base, m_safe, gmask, s0, NSP1, D: tl.constexpr, BSM: tl.constexpr):
    """Partials ``[s0, s0 + BSM)`` of rows ``base`` weighted by ``exp2(m - m_safe)``, summed: ``[GP, D]``."""
    so = s0 + tl.arange(0, BSM)
    okc = gmask[:, None] & (so[None, :] < NSP1)
    w = tl.exp2(tl.load(m_ws + base[:, None] + so[None, :], mask=okc, other=float("-inf"), cache_modifier=".cg")
                - m_safe[:, None])
    o = tl.load(o_ws + ((base[:, None] + so[None, :]) * D)[:, :, None] + tl.arange(0, D)[None, None, :],
                mask=okc[:, :, None], other=0.0, cache_modifier=".cg")
    return tl.sum(w[:, :, None] * o, axis=1)


@triton.jit
def _merge_pair(m_ws, l_ws, o_ws, out_ptr, row, hq, gmask, out_off, s_oh, NSP1, GP: tl.constexpr, D: tl.constexpr,
                BM: tl.constexpr, BSM: tl.constexpr, sink_ptr, SINK: tl.constexpr):
    """The split kernel's in-place merge (MERGE): rows ``row`` ``[GP]`` (query heads ``hq`` of one sequence and KV
    head) from their ``NSP1`` (<= BM) partials, as :func:`_decode_reduce_kernel` does for one row."""
    base = row * NSP1
    offs_s = tl.arange(0, BM)
    ok = gmask[:, None] & (offs_s[None, :] < NSP1)
    m_all = tl.load(m_ws + base[:, None] + offs_s[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
    l_all = tl.load(l_ws + base[:, None] + offs_s[None, :], mask=ok, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m_all, axis=1)
    if SINK:  # one more softmax term per query head, on no value: in the maximum and the sum only
        sink = tl.load(sink_ptr + hq, mask=gmask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.sum(tl.exp2(m_all - m_safe[:, None]) * l_all, axis=1)
    if SINK:
        l_sum += tl.exp2(sink - m_safe)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([GP, D], tl.float32)
    if BM <= 16:  # a few partials: the loop unrolled (its loads issued together)
        for s0 in tl.static_range(0, BM, BSM):
            acc += _merge_chunk(m_ws, o_ws, base, m_safe, gmask, s0, NSP1, D, BSM)
    else:  # many (eager batch 1 at long context, DecodeTuning.merge_max): a loop
        for s0 in tl.range(0, NSP1, BSM):
            acc += _merge_chunk(m_ws, o_ws, base, m_safe, gmask, s0, NSP1, D, BSM)
    res = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + out_off + hq[:, None] * s_oh + offs_d[None, :], res.to(out_ptr.dtype.element_ty),
             mask=gmask[:, None])


@triton.jit
def _decode_reduce_kernel(m_ws, l_ws, o_ws, out_ptr, sink_ptr, NSP1, s_ob, s_oh, Hq,
                          D: tl.constexpr, DB: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
                          SINK: tl.constexpr = 0):
    """Program (row, dc): channels ``[dc * DB, (dc + 1) * DB)`` of one (sequence, query head).
    The global max and the sum of weights come from one load of all ``NSP1`` (<= BM) partial maxima,
    so the accumulation loop has no running rescale and its loads do not wait on each other. ``SINK``: the query
    head's learned sink logit (``sink_ptr[hq]``, natural log) joins the maximum and the sum, on no value."""
    row = tl.program_id(0).to(tl.int64)
    dc = tl.program_id(1)
    b = row // Hq
    hq = row % Hq
    base = row * NSP1
    offs_m = tl.arange(0, BM)
    ok_m = offs_m < NSP1
    m_all = tl.load(m_ws + base + offs_m, mask=ok_m, other=float("-inf"))
    l_all = tl.load(l_ws + base + offs_m, mask=ok_m, other=0.0)
    m_max = tl.max(m_all, axis=0)
    if SINK:
        sink = tl.load(sink_ptr + hq).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.sum(tl.exp2(m_all - m_safe) * l_all, axis=0)
    if SINK:
        l_sum += tl.exp2(sink - m_safe)
    offs_d = dc * DB + tl.arange(0, DB)
    acc = tl.zeros([DB], tl.float32)
    for s0 in range(0, NSP1, BS):
        offs = s0 + tl.arange(0, BS)
        ok = offs < NSP1
        w = tl.exp2(tl.load(m_ws + base + offs, mask=ok, other=float("-inf")) - m_safe)
        o = tl.load(o_ws + (base + offs)[:, None] * D + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
    res = acc / tl.where(l_sum > 0, l_sum, 1.0)
    tl.store(out_ptr + b * s_ob + hq * s_oh + offs_d, res.to(out_ptr.dtype.element_ty))


def _reduce_launch(rows: int, nsp1: int, d: int, sink: bool = False):
    """Grid and compile-time settings of the merge kernel. Grid ``(B * Hq, D / DB)``: 32-channel programs
    (``DB = 32``) while rows are few, so batch 1 gets ``Hq * D / 32`` programs; one program per row would give it
    only ``Hq``, each looping over hundreds of splits. Whole rows (``DB = D``) from 512 rows on, where the rows alone
    give enough programs."""
    db = min(d, 32) if rows < 512 else d
    bs = max(1, min(triton.next_power_of_2(nsp1), 4096 // db))
    meta = dict(D=d, DB=db, BS=bs, BM=triton.next_power_of_2(nsp1), num_warps=4, **({"SINK": 1} if sink else {}))
    return (rows, d // db), meta


def decode_reduce(ws_m, ws_l, ws_o, out, hq: int, sink_logits=None) -> None:
    """Merge ``ws_*`` (``[B * Hq, NS + NR(, D)]`` fp32 partial max / sum / output: NS paged splits, NR window
    chunks) into ``out`` ``[B, Hq, D]``; ``sink_logits`` ``[Hq]``: learned attention sinks (one more softmax term per
    query head, on no value)."""
    rows, nsp1, d = ws_o.shape
    grid, meta = _reduce_launch(rows, nsp1, d, sink_logits is not None)
    _decode_reduce_kernel[grid](ws_m, ws_l, ws_o, out, ws_m if sink_logits is None else sink_logits, nsp1,
                                out.stride(0), out.stride(1), hq, **meta)

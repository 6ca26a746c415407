"""The prefix op, ``paged_prefix_attention``: several query tokens per sequence over the quantized past (chunked
prefill, continued generation, assisted decoding).

A torch path, a batch slice at a time (bounded memory): the slice's pages are dequantized by the Triton dequant
kernel into one buffer with the residual window and the new tokens, then one fused ``scaled_dot_product_attention``
call runs with the query heads of each KV head stacked on the query axis.
"""

from __future__ import annotations

import torch

from . import checks
from ._util import check_pool_strides
from .decode_plan import _check_common
from .dequant import dequantize_pages
from .sinks import SINK_CHANNELS, sink_channels

PREFIX_SLICE_BYTES = 512 << 20  # working set of one batch slice of the prefix path


def paged_prefix_attention(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                           res_k, res_v, res_lengths, new_k, new_v, new_mask, key_bits: int, value_bits: int,
                           group_size: int, sm_scale: float, *, batch_slice: int | None = None,
                           sliding_window: int | None = None, sink_logits=None):
    """Triton-assisted twin of :func:`kivi_cache.reference.paged_prefix_attention` (several query tokens
    per sequence over the quantized past: chunked prefill, continued generation, assisted decoding).

    A slice of the batch at a time: its pages are dequantized by the Triton dequant kernel into a
    buffer of that slice's history only, the residual window and the new tokens are appended, and
    ``torch.nn.functional.scaled_dot_product_attention`` (a fused kernel on the GPU: no score matrix
    in memory) runs over it with the query heads of each KV head stacked along the query axis
    (grouped-query attention without repeating keys). Slices hold at most ``PREFIX_SLICE_BYTES``
    (512 MiB) of keys, values and mask; ``batch_slice`` fixes the sequences per slice instead.
    One device sync (``lengths.max()``). ``sliding_window``: as in the reference. ``sink_logits`` (``[Hq]``, learned
    attention sinks): one more key per sequence that every query sees, on extra channels that only it and the queries
    fill (:func:`.sinks.sink_channels`: its logit is the sink to fp32 accuracy, the other keys' are
    unchanged), with a zero value: the fused kernel then normalizes by the sum with the sink's term included.
    """
    checks.check_sliding_window(sliding_window)
    checks.check_sm_scale(sm_scale)
    checks.check_sink_logits(sink_logits, q)
    checks.check_attention(q, block_table, lengths, (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), res_k,
                           res_v, res_lengths, key_bits, value_bits, group_size)
    checks.check_prefix_chunk(q, new_k, new_v, new_mask, k_codes.shape[1])
    check_pool_strides((k_codes, k_scale, k_zero, v_codes, v_scale, v_zero))
    bsz, hq, ql, d = q.shape
    _check_common(d, k_codes, k_scale, key_bits, value_bits, group_size)
    _, hkv, p, _ = k_codes.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if batch_slice is not None and (isinstance(batch_slice, bool) or not isinstance(batch_slice, int)
                                    or batch_slice < 1):
        raise ValueError(f"batch_slice must be None (by memory) or an int >= 1 (sequences per slice), got "
                         f"{batch_slice!r}")
    out = torch.empty_like(q)
    if bsz == 0 or ql == 0:
        return out
    grp = hq // hkv
    dt = q.dtype
    t_max = int(lengths.max())
    c = res_k.shape[2]
    s_len = t_max + c + ql
    sink = sink_logits is not None
    d2 = d + SINK_CHANNELS if sink else d  # the sink key's channels (zeros for every other key and value)
    s_pad = -(-(s_len + sink) // 16) * 16  # aligned key axis for the fused kernels' mask; pads are masked out
    if batch_slice is None:
        elt = torch.finfo(dt).bits // 8
        per_seq = 2 * hkv * s_pad * d2 * elt + grp * ql * s_pad * (1 + elt) + hq * ql * (d + d2) * elt
        batch_slice = max(1, PREFIX_SLICE_BYTES // per_seq)
    pos = torch.arange(s_pad, device=q.device)
    if sink:  # the query heads' halves of sink / scale (the sum is the sink to fp32 accuracy)
        q_sink = sink_channels(sink_logits, sm_scale, dt)
        q_sink = q_sink.reshape(hkv, grp, 1, d2 - d).expand(hkv, grp, ql, d2 - d)
    for b0 in range(0, bsz, batch_slice):
        sl = slice(b0, min(bsz, b0 + batch_slice))
        n = sl.stop - sl.start
        k = torch.zeros(n, hkv, s_pad, d2, dtype=dt, device=q.device)
        v = torch.zeros_like(k)
        if t_max:  # straight into the slice's buffer (the kernel converts to the buffer's dtype)
            dequantize_pages(block_table[sl], lengths[sl], k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                             key_bits, value_bits, group_size, max_len=t_max,
                             out=(k[:, :, :t_max, :d], v[:, :, :t_max, :d]))
        # the window's slots past res_lengths hold no token (anything: NaN would pass through a zero weight): zeros
        win = (torch.arange(c, device=q.device)[None, :] < res_lengths[sl].long()[:, None])[:, None, :, None]
        k[:, :, t_max:t_max + c, :d] = torch.where(win, res_k[sl], 0)
        v[:, :, t_max:t_max + c, :d] = torch.where(win, res_v[sl], 0)
        k[:, :, t_max + c:s_len, :d] = new_k[sl]
        v[:, :, t_max + c:s_len, :d] = new_v[sl]
        if sink:
            k[:, :, s_len, d:d + 2] = 1
        hist = pos[None, :] < lengths[sl].long()[:, None]
        hist |= ((pos[None, :] >= t_max) & (pos[None, :] < t_max + res_lengths[sl].long()[:, None]))
        if sliding_window is None:
            mask = hist[:, None, :].expand(n, ql, s_pad).clone()
        else:  # stored token index of each key (pages, then the window) against each query's (after them)
            index = torch.where(pos[None, :] < t_max, pos[None, :], lengths[sl].long()[:, None] + pos[None, :] - t_max)
            first = lengths[sl].long() + res_lengths[sl].long()
            queries = first[:, None] + torch.arange(ql, device=q.device)[None, :]
            mask = hist[:, None, :] & (queries[:, :, None] - index[:, None, :] < sliding_window)
        mask[:, :, t_max + c:s_len] = new_mask[sl]
        nothing = None
        if sink:
            mask[:, :, s_len] = True  # every query sees the sink (so none has nothing to attend to)
        else:  # a query with nothing to attend to (padding): a defined softmax here, zeros out (as the reference)
            nothing = ~mask.any(-1)
            mask[:, :, 0] |= nothing
        mask = mask[:, None].expand(n, grp, ql, s_pad).reshape(n, 1, grp * ql, s_pad)
        if sink:
            qs = torch.cat([q[sl].reshape(n, hkv, grp, ql, d), q_sink.expand(n, hkv, grp, ql, d2 - d)],
                           dim=-1).reshape(n, hkv, grp * ql, d2)
        else:
            qs = q[sl].reshape(n, hkv, grp * ql, d)
        o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=float(sm_scale))
        o = o[..., :d].reshape(n, hq, ql, d)
        out[sl] = o if nothing is None else o.masked_fill(nothing[:, None, :, None], 0)
    return out

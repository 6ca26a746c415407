"""Torch reference implementations of the paged operations.

Each function here has a Triton twin in ``kivi_cache.kernels`` with the same
signature; these are the oracle in tests and the CPU path. Kernel seams are
tensors and integers only.

Page pool layout (per layer; ``NP`` pages, ``H`` KV heads, ``P`` tokens per
page, ``D`` head_dim, ``G`` group_size, ``kb``/``vb`` key/value bits):

=============  ==============================  ==========================
tensor         shape                           meaning
=============  ==============================  ==========================
``k_codes``    ``[NP, H, P, D * kb // 8]``     uint8, planar-packed codes
``k_scale``    ``[NP, H, P // G, D]``          per-channel scale per group
``k_zero``     ``[NP, H, P // G, D]``          per-channel zero (min)
``v_codes``    ``[NP, H, D, P * vb // 8]``     uint8, channel rows packed along tokens
``v_scale``    ``[NP, H, D // G, P]``          per-token scale per group
``v_zero``     ``[NP, H, D // G, P]``          per-token zero (min)
=============  ==============================  ==========================

A sequence's quantized tokens ``0 .. n - 1`` live in pages
``block_table[b, t // P]`` at slot ``t % P``; ``n`` is always a multiple of G.
Unused block-table entries are -1. The packings (keys: token rows, planar over
channels; values: channel rows packed along tokens) are documented in :mod:`kivi_cache.quant`.
"""

from __future__ import annotations

import torch

from .kernels import checks
from .kernels.sinks import SINK_CHANNELS, sink_channels  # noqa: F401  (the sink helpers, also here: hook.py)
from .quant import (
    dequantize_keys,
    dequantize_values,
    pack,
    pack_tokens,
    quantize_keys,
    quantize_values,
    unpack,
    unpack_tokens,
)
from .window import window_append


def quantize_and_write(k, v, pages, slots, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                       key_bits: int, value_bits: int, group_size: int, *, clip_keys: bool = False,
                       clip_values: bool = False) -> None:
    """Quantize N key/value groups and write them into their pages in place (``clip_keys``/``clip_values``: the
    range search of :mod:`kivi_cache.quant` for the keys' / values' groups).

    k, v: ``[N, H, G, D]`` (G = group_size consecutive tokens of one sequence).
    pages: ``[N]`` int page ids; slots: ``[N]`` int token offsets in the page
    (multiples of G). Checked by :func:`kivi_cache.kernels.checks.check_write` (ValueError) before anything is written.
    """
    pool = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    checks.check_write(k, v, pages, slots, pool, key_bits, value_bits, group_size)
    if k.shape[0] == 0:
        return
    g = group_size
    pages = pages.long()
    slots = slots.long()
    kc, ks, kz = quantize_keys(k, key_bits, g, k_scale.dtype, clip_keys)  # [N,H,G,D], [N,H,1,D]
    vc, vs, vz = quantize_values(v, value_bits, g, v_scale.dtype, clip_values)  # [N,H,G,D], [N,H,G,D/G]
    tok = slots[:, None] + torch.arange(g, device=slots.device)  # [N, G]
    pg = pages[:, None]
    # advanced indices around a slice put [N, G] first: [N, G, H, ...]
    k_codes[pg, :, tok] = pack(kc, key_bits).transpose(1, 2)
    # values: channel rows, the group's bytes of each row; advanced indices around two slices put [N, X] first
    vb = g * value_bits // 8
    cols = (slots * value_bits // 8)[:, None] + torch.arange(vb, device=slots.device)  # [N, vb]
    v_codes[pg, :, :, cols] = pack_tokens(vc.transpose(-1, -2), value_bits).permute(0, 3, 1, 2)
    v_scale[pg, :, :, tok] = vs.permute(0, 2, 1, 3)
    v_zero[pg, :, :, tok] = vz.permute(0, 2, 1, 3)
    k_scale[pages, :, slots // g] = ks[:, :, 0]
    k_zero[pages, :, slots // g] = kz[:, :, 0]


def append_and_flush(new_k, new_v, res_k, res_v, res_lengths, sink_lengths, lengths, block_table, k_codes, k_scale,
                     k_zero, v_codes, v_scale, v_zero, key_bits: int, value_bits: int, group_size: int,
                     residual_length: int, sink_length: int, *, clip_keys: bool = False,
                     clip_values: bool = False) -> None:
    """One decode step's window bookkeeping, in place, for every sequence b (the compiled cache's step; ``clip_keys``/
    ``clip_values`` as in :func:`quantize_and_write`):

    1. the step's token ``new_k/new_v[b]`` (``[B, H, D]`` or ``[B, H, 1, D]``) goes into the window
       ``res_k/res_v[b, :, res_lengths[b]]`` (``[B, H, capacity, D]``, capacity >= sinks + R + G);
    2. the sinks count it if they are not all there: ``s = sink_lengths[b] + 1`` if below ``sink_length``;
    3. if the window is then full, ``res_lengths[b] + 1 - s >= R + G`` (``R = residual_length``, ``G =
       group_size``; the window rule, :func:`kivi_cache.window.window_append`), its oldest group (window slots
       ``s .. s + G - 1``) is quantized into page
       ``block_table[b, lengths[b] // P]`` (a column the table must have) at slot ``lengths[b] % P``, and the R
       tokens after it move down to slots ``s .. s + R - 1``.

    The lengths are read, not written: the caller advances them (``res_lengths += 1 - G * full``, ``lengths += G *
    full``, the sinks as in 2.), with ``full`` as in 3. Checked by :func:`kivi_cache.kernels.checks.check_flush`.
    """
    checks.check_flush(new_k, new_v, res_k, res_v, res_lengths, sink_lengths, lengths, block_table,
                       (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), key_bits, value_bits, group_size,
                       residual_length, sink_length)
    if new_k.dim() == 4:
        new_k, new_v = new_k[:, :, 0], new_v[:, :, 0]
    bsz = res_k.shape[0]
    if bsz == 0:
        return
    g, p = group_size, k_codes.shape[2]
    rows = torch.arange(bsz, device=res_k.device)
    r = res_lengths.long()
    res_k[rows, :, r] = new_k.to(res_k.dtype)
    res_v[rows, :, r] = new_v.to(res_v.dtype)
    s, flushed = window_append(r, sink_lengths.long(), 1, sink_length=sink_length, residual_length=residual_length,
                               group_size=g)
    full = flushed.nonzero()[:, 0]
    if full.numel() == 0:
        return
    q = lengths.long()[full]
    pages = block_table[full, q // p]
    first = s[full]
    grp = first[:, None] + torch.arange(g, device=res_k.device)  # [N, G] window slots of each oldest group
    idx = grp[:, None, :, None].expand(-1, res_k.shape[1], -1, res_k.shape[3])
    quantize_and_write(res_k[full].gather(2, idx), res_v[full].gather(2, idx), pages, q % p, k_codes, k_scale,
                       k_zero, v_codes, v_scale, v_zero, key_bits, value_bits, g, clip_keys=clip_keys,
                       clip_values=clip_values)
    for b, s0 in zip(full.tolist(), first.tolist(), strict=True):
        for res in (res_k, res_v):
            res[b, :, s0:s0 + residual_length] = res[b, :, s0 + g:s0 + g + residual_length].clone()


def dequantize_pages(block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                     key_bits: int, value_bits: int, group_size: int, max_len: int | None = None, *, out=None):
    """Dequantize each sequence's quantized tokens.

    Returns k, v ``[B, H, T, D]`` in the scale dtype, T = max_len (default:
    ``max(lengths)``); positions at or past a sequence's length are zero. ``out=(k, v)``: ``[B, H, T, D]`` floating
    tensors on the pool's device (last dimension contiguous, the same strides; views of a larger buffer allowed)
    to write into (converted to their dtype) and return.
    """
    np_, h, p, d = checks.check_pool((k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), key_bits, value_bits,
                                     group_size)
    checks.check_tables(block_table, lengths, np_, p, device=k_codes.device)
    checks.check_max_len(max_len)
    b = block_table.shape[0]
    t = (int(lengths.max()) if b else 0) if max_len is None else max_len
    if out is not None:
        k_out, v_out = checks.check_dequant_out(out, (b, h, t, d), k_codes.device)
        k, v = dequantize_pages(block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, key_bits,
                                value_bits, group_size, t)
        return k_out.copy_(k), v_out.copy_(v)
    if b == 0 or t == 0:
        empty = k_scale.new_zeros(b, h, t, d)
        return empty, empty.clone()
    npages = min(-(-t // p), block_table.shape[1])  # max_len may reach past the table: zeros there
    pages = block_table[:, :npages].long().clamp(min=0)  # [B, np]

    def gather(x):  # [NP, H, X, ...] -> [B, H, np * X, ...]
        y = x[pages]  # [B, np, H, X, ...]
        y = y.transpose(1, 2)
        return y.reshape(b, h, npages * x.shape[2], *x.shape[3:])

    def gather_t(x):  # [NP, H, C, X] (token axis last) -> [B, H, np * X, C]
        return x[pages].permute(0, 2, 1, 4, 3).reshape(b, h, npages * x.shape[3], x.shape[2])

    k = dequantize_keys(unpack(gather(k_codes), key_bits), gather(k_scale), gather(k_zero), group_size)
    vc = unpack_tokens(v_codes[pages], value_bits)  # [B, np, H, D, P]
    v = dequantize_values(vc.permute(0, 2, 1, 4, 3).reshape(b, h, npages * p, d), gather_t(v_scale),
                          gather_t(v_zero), group_size)
    k, v = k[:, :, :t], v[:, :, :t]
    if k.shape[2] < t:
        k = torch.nn.functional.pad(k, (0, 0, 0, t - k.shape[2]))
        v = torch.nn.functional.pad(v, (0, 0, 0, t - v.shape[2]))
    if bool((lengths.long() < t).any()):  # a sequence shorter than t: zero its positions past its length
        valid = (torch.arange(t, device=lengths.device)[None, :] < lengths[:, None].long())[:, None, :, None]
        k = torch.where(valid, k, 0)
        v = torch.where(valid, v, 0)
    return k, v


def _attend(q, k, v, valid, sm_scale, sink_logits=None):
    """q ``[B, Hq, L, D]``, k/v ``[B, Hkv, S, D]``, valid ``[B, 1|L, S]`` bool -> fp32 ``[B, Hq, L, D]``.
    ``sink_logits`` ``[Hq]``: one more softmax column per query head, with no value (learned attention sinks)."""
    bsz, hq, ql, d = q.shape
    hkv = k.shape[1]
    grp = hq // hkv
    qf = q.float().reshape(bsz, hkv, grp * ql, d)
    scores = qf @ k.float().transpose(-1, -2) * sm_scale  # [B, Hkv, grp*L, S]
    scores = scores.reshape(bsz, hkv, grp, ql, k.shape[2])  # (no -1: an empty batch has no elements)
    probs = softmax(scores, valid, sink_logits).reshape(bsz, hkv, grp * ql, k.shape[2])
    out = probs @ v.float()
    return out.reshape(bsz, hq, ql, d)


def softmax(scores, valid, sink_logits=None):
    """scores ``[B, Hkv, grp, L, S]`` fp32, valid ``[B, 1|L, S]`` bool (None: all valid) -> probabilities, zeros where
    not valid. ``sink_logits`` ``[Hq]``: one more softmax column per query head, with no value (learned attention
    sinks): in the sum, on no key."""
    bsz, hkv, grp, ql, _ = scores.shape
    if valid is not None:
        scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
    if sink_logits is not None:
        sink = sink_logits.float().reshape(1, hkv, grp, 1, 1).expand(bsz, hkv, grp, ql, 1)
        scores = torch.cat([scores, sink], dim=-1)
    # a query that may attend to nothing (a padding position of a chunk) gets zeros, not NaN: NaN would reach
    # the stored keys and values of the next layer and, through 0 * NaN, every query of that sequence
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs[..., :-1] if sink_logits is not None else probs


def _history(block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
             res_k, res_v, res_lengths, key_bits, value_bits, group_size):
    hk, hv = dequantize_pages(block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                              key_bits, value_bits, group_size)
    t = hk.shape[2]
    c = res_k.shape[2]
    # the window's slots past res_lengths hold no token (anything: NaN would pass through a zero weight): zeros
    win = (torch.arange(c, device=res_k.device)[None, :] < res_lengths[:, None].long())[:, None, :, None]
    k = torch.cat([hk.to(res_k.dtype), torch.where(win, res_k, 0)], dim=2)
    v = torch.cat([hv.to(res_v.dtype), torch.where(win, res_v, 0)], dim=2)
    return (k, v, *positions(lengths, res_lengths, t, c))


def positions(lengths, res_lengths, t: int, c: int):
    """For keys laid out as ``t`` page slots then ``c`` window slots: valid ``[B, t + c]`` bool (a stored token) and
    each key's index among its sequence's stored tokens ``[B, t + c]`` (pages first, then the window)."""
    pos = torch.arange(t + c, device=lengths.device)
    valid = torch.where(pos[None, :] < t, pos[None, :] < lengths[:, None].long(),
                        (pos[None, :] - t) < res_lengths[:, None].long())
    index = torch.where(pos[None, :] < t, pos[None, :], lengths[:, None].long() + pos[None, :] - t)
    return valid, index


def write_new_token(res_k, res_v, res_lengths, new_k, new_v) -> None:
    """The decode ops' step token (``new_k``/``new_v`` ``[B, Hkv, D]`` or ``[B, Hkv, 1, D]``): written into the
    window at ``res_lengths[b] - 1`` of each sequence with a non-empty window, in place."""
    if new_k.dim() == 4:
        new_k, new_v = new_k[:, :, 0], new_v[:, :, 0]
    rows = (res_lengths > 0).nonzero().squeeze(-1)
    last = res_lengths.long()[rows] - 1
    res_k[rows, :, last] = new_k[rows].to(res_k.dtype)
    res_v[rows, :, last] = new_v[rows].to(res_v.dtype)


def in_window(index, query_index, window):
    """[B, L, S] bool: stored token ``index`` [B, S] is within ``window`` positions of query ``query_index`` [B, L]
    (visible while ``query - key < window``, transformers' sliding-window rule); everything for ``window=None``."""
    if window is None:
        return torch.ones(index.shape[0], query_index.shape[1], index.shape[1], dtype=torch.bool, device=index.device)
    return query_index[:, :, None] - index[:, None, :] < window


def paged_decode_attention(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                           res_k, res_v, res_lengths, key_bits: int, value_bits: int, group_size: int,
                           sm_scale: float, *, new_k=None, new_v=None, merge: bool = True,
                           sliding_window: int | None = None, sink_logits=None):
    """One query token per sequence over its quantized pages and residual window.

    q: ``[B, Hq, D]``; res_k/res_v: ``[B, Hkv, C, D]`` full precision with
    ``res_lengths[b]`` valid tokens; lengths: quantized tokens per sequence.
    ``new_k``/``new_v`` (``[B, Hkv, D]`` or ``[B, Hkv, 1, D]``, optional): the step's own token, written into the
    window at ``res_lengths[b] - 1`` (in place; the lengths already count it) before attending.
    ``merge`` (the kernels' choice of where partial results are merged) changes nothing here.
    ``sliding_window``: the query, the sequence's newest stored token (index ``n - 1`` of its ``n = lengths +
    res_lengths`` stored tokens, pages first, then the window), sees only the last ``sliding_window`` of them
    (indices ``>= n - sliding_window``); None: all. Pages wholly before that are never read.
    ``sink_logits`` (``[Hq]``, optional): learned attention sinks (GPT-OSS): each query head's softmax has one more
    logit, ``sink_logits[h]``, which weighs no value (``out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sink))``).
    Returns ``[B, Hq, D]`` in q's dtype.
    """
    checks.check_decode(q, block_table, lengths, (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), res_k, res_v,
                        res_lengths, key_bits, value_bits, group_size, sm_scale, sliding_window, sink_logits, new_k,
                        new_v)
    if new_k is not None:
        write_new_token(res_k, res_v, res_lengths, new_k, new_v)
    k, v, valid, index = _history(block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                  res_k, res_v, res_lengths, key_bits, value_bits, group_size)
    newest = (lengths.long() + res_lengths.long() - 1)[:, None]
    out = _attend(q[:, :, None], k, v, valid[:, None] & in_window(index, newest, sliding_window), sm_scale,
                  sink_logits)
    return out[:, :, 0].to(q.dtype)


def paged_prefix_attention(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                           res_k, res_v, res_lengths, new_k, new_v, new_mask, key_bits: int, value_bits: int,
                           group_size: int, sm_scale: float, *, sliding_window: int | None = None, sink_logits=None):
    """Several query tokens over a quantized past plus their own (full precision) chunk.

    q: ``[B, Hq, L, D]``; new_k/new_v: ``[B, Hkv, L, D]``; new_mask: ``[B, L, L]``
    bool, True where query i may attend to new token j (causal and padding; a sliding window among the new
    tokens is the mask's to apply). Every stored token (pages and residual) is visible to every query, or with
    ``sliding_window`` only those within ``sliding_window`` positions of it (query i is stored token
    ``lengths + res_lengths + i``). ``sink_logits``: as in :func:`paged_decode_attention`.
    Returns ``[B, Hq, L, D]`` in q's dtype.
    """
    checks.check_prefix(q, block_table, lengths, (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), res_k, res_v,
                        res_lengths, new_k, new_v, new_mask, key_bits, value_bits, group_size, sm_scale, sliding_window,
                        sink_logits)
    k, v, valid, index = _history(block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                                  res_k, res_v, res_lengths, key_bits, value_bits, group_size)
    ql = q.shape[2]
    k = torch.cat([k, new_k.to(k.dtype)], dim=2)
    v = torch.cat([v, new_v.to(v.dtype)], dim=2)
    first = (lengths.long() + res_lengths.long())[:, None]
    queries = first + torch.arange(ql, device=q.device)[None, :]
    valid = torch.cat([valid[:, None, :] & in_window(index, queries, sliding_window), new_mask], dim=2)
    return _attend(q, k, v, valid, sm_scale, sink_logits).to(q.dtype)

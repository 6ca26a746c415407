"""Paged attention in plain torch, a chunk of pages at a time: the path where the Triton kernels do not run.

:mod:`kivi_cache.reference` (the oracle) dequantizes every page into a full-precision history on each call, then
concatenates the window and attends. This path never builds the history: it dequantizes a chunk of pages at a time
(:data:`CHUNK_CODES` codes, so its transient memory is bounded at any length), each in one pass from the packed
codes (``code * scale + zero``, one ``addcmul`` from the unpacked bytes), and attends to the pages and the window
separately: the keys' scores for every chunk first (they are small), one softmax, then the values chunk by chunk.
Value codes stay in the order :func:`_unpack` leaves them (:mod:`kivi_cache.quant`'s token-pair layout) and the
probabilities and value scales are permuted to match, so the large tensors are never reordered. Pages before every
sequence's sliding window are not read. Arithmetic is fp32; the reference rounds the dequantized history to the
scale dtype before attending, so the two agree to that rounding (in fp32 up to summation order).

Same functions, signatures and argument checks as the reference (the other operations are the reference's own), and
a :class:`DecodeRunner` like the kernels' (the fixed tensors' shapes checked once, their index values again after an
in-place write): what :mod:`kivi_cache.ops` runs where the Triton kernels do not (the CPU, a GPU without working
kernels). It never builds the dequantized history, which makes the CPU decode step several times cheaper than the
reference's (``benchmarks/cpu_step.py`` measures it).
"""

from __future__ import annotations

import torch

from .kernels import checks
from .quant import qmax
from .reference import (  # noqa: F401  (the operations this path shares with the reference)
    append_and_flush,
    in_window,
    positions,
    quantize_and_write,
    softmax,
    write_new_token,
)

CHUNK_CODES = 1 << 22  # codes of keys (and of values) dequantized at a time: 16 MiB as fp32


def _unpack(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed rows ``[..., R]`` -> uint8 codes ``[..., R * 8 // bits]``: bit field ``k`` of every byte, for ``k = 0,
    1, ...``, one block after the other (scalar shifts: one op per field, several times faster on the CPU than one
    shift by a broadcast vector). Planar key rows (:mod:`kivi_cache.quant`) come out in channel order; value rows as
    ``(k, w, h, q)`` over field ``k``, word ``w`` and byte ``q + 2 h`` of the word: token ``tw w + 4 k + 2 q + h``
    (``tw = 32 // bits``)."""
    if bits == 8:
        return x
    m, n = qmax(bits), 8 // bits
    return torch.cat([x & m] + [(x >> (k * bits)) & m for k in range(1, n - 1)] + [x >> (8 - bits)], dim=-1)


def _token_major(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed value rows ``[..., D, R]`` (:mod:`kivi_cache.quant`'s token-pair layout) -> uint8 codes ``[..., P, D]``
    in token order: the bytes transposed and put in (word, q, h) order in one copy (byte ``q + 2 h`` of word ``w``
    holds tokens ``tw w + 4 k + 2 q + h``, bit field ``k``), then each bit field written to its tokens' rows (about
    2x faster on the CPU than unpacking each row and gathering the tokens)."""
    n, r = 8 // bits, x.shape[-1]
    y = x.transpose(-1, -2).unflatten(-2, (r // 4, 2, 2)).transpose(-3, -2).contiguous()  # [..., W, q, h, D]
    if n == 1:
        return y.flatten(-4, -2)
    out = torch.empty(*y.shape[:-3], n, *y.shape[-3:], dtype=torch.uint8, device=x.device)  # [..., W, k, q, h, D]
    m = qmax(bits)
    torch.bitwise_and(y, m, out=out.select(-4, 0))
    for k in range(1, n - 1):
        torch.bitwise_and(y >> (k * bits), m, out=out.select(-4, k))
    torch.bitwise_right_shift(y, 8 - bits, out=out.select(-4, n - 1))
    return out.flatten(-5, -2)


def _storage_perm(bits: int, p: int, device) -> torch.Tensor:
    """``[P]`` long: the page token at each position of :func:`_unpack`'s order of a value row."""
    key = (bits, p, device)
    perm = _PERMS.get(key)
    if perm is None:
        n = 8 // bits
        w, k, q, h = torch.meshgrid(torch.arange(p // (4 * n)), torch.arange(n), torch.arange(2), torch.arange(2),
                                    indexing="ij")
        token = (4 * n * w + 4 * k + 2 * q + h).permute(1, 0, 3, 2).reshape(-1)  # (k, w, h, q): the unpacked order
        perm = _PERMS[key] = token.to(device)
    return perm


_PERMS: dict = {}


def _stored(lengths, lens, start: int, n: int, p: int, perm) -> torch.Tensor:
    """``[B, n P]`` bool: the slots of pages ``start / P ..`` (``n`` of them, each in ``perm``'s order) that hold a
    token of their sequence (slot < its length). One sequence: cached by its length (a view, no op)."""
    if len(lens) == 1:
        key = (lens[0] - start, n, p, perm.data_ptr())
        out = _STORED.get(key)
        if out is None:
            if len(_STORED) > 64:
                _STORED.clear()
            out = _STORED[key] = ((torch.arange(0, n * p, p, device=perm.device)[:, None] + perm).view(1, -1)
                                  < lens[0] - start)
        return out
    return (torch.arange(start, start + n * p, p, device=perm.device)[:, None] + perm).view(1, -1) < lengths[:, None]


_STORED: dict = {}


def _chunk_pages(block_table, a: int, e: int):
    """Pages ``a .. e - 1`` of every sequence: the first page's id where there is one sequence and its pages are
    consecutive (read as a view), else the ids ``[B * (e - a)]`` (-1, past a shorter sequence's pages, as page 0:
    its slots are masked)."""
    if block_table.shape[0] == 1 and e > a:
        row = block_table[0, a:e].tolist()
        if row[0] >= 0 and row == list(range(row[0], row[0] + e - a)):
            return row[0]
    return block_table[:, a:e].reshape(-1).clamp(min=0)


def _take(x: torch.Tensor, pages, n: int) -> torch.Tensor:
    """``[B * n, ...]``: those pages of a pool tensor (:func:`_chunk_pages`)."""
    return x.narrow(0, pages, n) if isinstance(pages, int) else x.index_select(0, pages)


def _gather(x: torch.Tensor, pages, bsz: int, n: int, h: int, *shape) -> torch.Tensor:
    """``[B, H, n, *shape]``: :func:`_take`'s pages of a pool tensor, viewed per sequence and head."""
    return _take(x, pages, n).view(bsz, n, h, *shape).transpose(1, 2)


def _keys(k_codes, k_scale, k_zero, pages, bsz: int, n: int, bits: int, g: int, out=None) -> torch.Tensor:
    """fp32 keys ``[B, H, n P, D]`` of ``n`` pages a sequence (:func:`_chunk_pages`), ``code * scale + zero`` in one
    pass from the unpacked bytes (the uint8 codes promote inside the ``addcmul``). ``out`` ``[B, H, t, D]`` (``t <= n
    P``; any float dtype, views allowed): the first ``t`` tokens written there instead (rounded once), and returned."""
    _, h, p, row = k_codes.shape
    d = k_scale.shape[-1]

    def gather(x, *shape):  # [B, H, n, *shape]
        return _gather(x, pages, bsz, n, h, *shape)

    codes = _unpack(gather(k_codes, p, row), bits)
    if out is None:
        k = torch.empty(bsz, h, n, p // g, g, d, device=k_codes.device)  # (addcmul's output follows the zeros' strides)
        torch.addcmul(gather(k_zero, p // g, 1, d).float(), codes.view(bsz, h, n, p // g, g, d),
                      gather(k_scale, p // g, 1, d).float(), out=k)
        return k.view(bsz, h, n * p, d)
    t = out.shape[2]
    ng = -(-t // g)  # key groups holding the t tokens
    codes = codes.reshape(bsz, h, n * p // g, g, d)[:, :, :ng]
    ks, kz = (gather(x, p // g, 1, d).reshape(bsz, h, n * p // g, 1, d)[:, :, :ng].float() for x in (k_scale, k_zero))
    if t == ng * g:
        torch.addcmul(kz, codes, ks, out=out.unflatten(2, (ng, g)))
    else:  # a partial key group: through a buffer
        k = torch.empty(bsz, h, ng, g, d, device=out.device)
        out.copy_(torch.addcmul(kz, codes, ks, out=k).view(bsz, h, ng * g, d)[:, :, :t])
    return out


def _attend(q, block_table, lengths, pool, key_bits, value_bits, group_size, sm_scale, other_k, other_v, keep,
            first, lens, sink_logits):
    """q ``[B, Hq, L, D]`` over each sequence's pages from page ``first`` of its block table on, and ``other_k``/
    ``other_v`` (``[B, Hkv, S, D]``, full precision, zeros where not valid). ``keep`` ``[B, 1 | L, T + S]`` (``T``
    page slots from page 0, then the others) says which key each query sees; None: every stored token (``lens``,
    ``lengths`` as a list, tells which page slots hold one). -> fp32 ``[B, Hq, L, D]``."""
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = pool
    bsz, hq, ql, d = q.shape
    _, h, p, _ = k_codes.shape
    g = group_size
    m = hq // h * ql
    top = max(lens, default=0)
    npages = -(-top // p)
    step = max(1, CHUNK_CODES // max(1, bsz * h * p * d))
    chunks = [(a, min(a + step, npages)) for a in range(first, npages, step)]
    pages = [_chunk_pages(block_table, a, e) for a, e in chunks]  # read by the keys' pass and the values'
    qf = q.float().reshape(bsz, h, m, d) * sm_scale

    parts = []
    for (a, e), ids in zip(chunks, pages, strict=True):
        k = _keys(k_codes, k_scale, k_zero, ids, bsz, e - a, key_bits, group_size)
        parts.append(qf @ k.transpose(-1, -2))
    if keep is None and parts:  # the page slots past the longest sequence: not keys (one length: none left over)
        parts[-1] = parts[-1][..., :parts[-1].shape[-1] - (npages * p - top)]
    parts.append(qf @ other_k.float().transpose(-1, -2))
    scores = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    keys = scores.shape[-1]  # (no -1 in the views: an empty batch has no elements)
    if keep is None and sink_logits is None:  # every query sees a key: no mask, no empty row
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = softmax(scores.view(bsz, h, hq // h, ql, keys), None if keep is None else keep[..., first * p:],
                        sink_logits).view(bsz, h, m, keys)
    paged = keys - other_k.shape[2]
    out = probs[..., paged:] @ other_v.float()  # [B, H, M, D]
    if not chunks:
        return out.reshape(bsz, hq, ql, d)
    pp = probs[..., :paged]
    if paged < (npages - first) * p:
        pp = torch.nn.functional.pad(pp, (0, (npages - first) * p - paged))
    perm = _storage_perm(value_bits, p, q.device)
    short = min(lens) < npages * p  # page slots past some sequence's length: their scales and zeros may be anything

    def per_token(x, ids, n):  # value scales or zeros of the chunk, tokens in the codes' order: [B, H, D/G, 1, n, P]
        x = _take(x, ids, n).index_select(-1, perm).float()
        return x.view(bsz, n, h, d // g, 1, p).permute(0, 2, 3, 4, 1, 5)

    for (a, e), ids in zip(chunks, pages, strict=True):  # values [B, H, D, n P], tokens in the codes' order
        n = e - a  # (the probabilities permuted to match)
        vs, vz = per_token(v_scale, ids, n), per_token(v_zero, ids, n)
        if short:
            here = _stored(lengths, lens, a * p, n, p, perm).view(bsz, 1, 1, 1, n, p)
            vs, vz = torch.where(here, vs, 0), torch.where(here, vz, 0)
        codes = _take(v_codes, ids, n).view(bsz, n, h, d, v_codes.shape[-1]).permute(0, 2, 3, 1, 4)
        codes = _unpack(codes, value_bits)
        v = torch.empty(bsz, h, d // g, g, n, p, device=q.device)
        torch.addcmul(vz, codes.view(bsz, h, d // g, g, n, p), vs, out=v)
        pr = pp[..., (a - first) * p:(e - first) * p].reshape(bsz, h, m, n, p).index_select(-1, perm)
        torch.baddbmm(out.view(bsz * h, m, d), pr.view(bsz * h, m, n * p), v.view(bsz * h, d, n * p).transpose(1, 2),
                      out=out.view(bsz * h, m, d))  # out += pr @ v^T in one op
    return out.reshape(bsz, hq, ql, d)


def _dequantize_into(pool, pages, bsz: int, n: int, key_bits: int, value_bits: int, g: int, k_out, v_out) -> None:
    """The first ``t`` tokens (``k_out``/``v_out`` ``[B, H, t, D]``, any float dtype, views allowed; ``t <= n P``) of
    ``n`` pages a sequence (:func:`_chunk_pages`) dequantized into ``k_out``/``v_out``: keys and values each in one
    ``addcmul`` from the uint8 codes (fp32 arithmetic, rounded once to the output's dtype)."""
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = pool
    _, h, p, _ = k_codes.shape
    d, t = k_scale.shape[-1], v_out.shape[2]
    _keys(k_codes, k_scale, k_zero, pages, bsz, n, key_bits, g, out=k_out)

    def gather(x, *shape):  # [B, H, n, *shape]
        return _gather(x, pages, bsz, n, h, *shape)

    # values: the codes in token order (uint8 [B, H, n P, D]), then one addcmul
    codes = _token_major(gather(v_codes, d, v_codes.shape[-1]), value_bits).view(bsz, h, n * p, d // g, g)[:, :, :t]
    vs, vz = (gather(x, d // g, p).transpose(-1, -2).reshape(bsz, h, n * p, d // g, 1)[:, :, :t].float()
              for x in (v_scale, v_zero))
    torch.addcmul(vz, codes, vs, out=v_out.unflatten(3, (d // g, g)))


def dequantize_pages(block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                     key_bits: int, value_bits: int, group_size: int, max_len: int | None = None, *, out=None):
    """:func:`kivi_cache.reference.dequantize_pages` (the history the eager-attention fallback attends to; ``out``
    as there), keys and values each dequantized in one pass from the codes (``addcmul``) straight into the output,
    the value codes put in token order first (:func:`_token_major`). Same result up to the fp32 rounding of ``code *
    scale + zero`` (fused here)."""
    pool = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    np_, h, p, d = checks.check_pool(pool, key_bits, value_bits, group_size)
    checks.check_tables(block_table, lengths, np_, p, device=k_codes.device)
    checks.check_max_len(max_len)
    bsz = block_table.shape[0]
    lens = lengths.tolist()
    t = max(lens, default=0) if max_len is None else max_len
    if out is None:
        k_out, v_out = k_scale.new_empty(bsz, h, t, d), v_scale.new_empty(bsz, h, t, d)
    else:
        k_out, v_out = checks.check_dequant_out(out, (bsz, h, t, d), k_codes.device)
    if bsz == 0 or t == 0:
        return k_out.zero_(), v_out.zero_()
    n = min(-(-t // p), block_table.shape[1])  # max_len may reach past the table: zeros there
    s = min(t, n * p)
    _dequantize_into(pool, _chunk_pages(block_table, 0, n), bsz, n, key_bits, value_bits, group_size,
                     k_out[:, :, :s], v_out[:, :, :s])
    if s < t:
        k_out[:, :, s:] = 0
        v_out[:, :, s:] = 0
    if min(lens) < s:  # a sequence shorter than t: zeros past its length (its slots there hold anything)
        past = (torch.arange(t, device=k_codes.device)[None, :] >= lengths[:, None].long())[:, None, :, None]
        k_out.masked_fill_(past, 0)
        v_out.masked_fill_(past, 0)
    return k_out, v_out


def _window(res_k, res_v, res_lengths, rls):
    """The window cut to its longest sequence's tokens (``rls``: ``res_lengths`` as a list), zeros in the other
    sequences' empty slots."""
    c = max(rls, default=0)
    rk, rv = res_k[:, :, :c], res_v[:, :, :c]
    if min(rls, default=c) < c:
        win = (torch.arange(c, device=res_k.device)[None, :] < res_lengths[:, None])[:, None, :, None]
        rk, rv = torch.where(win, rk, 0), torch.where(win, rv, 0)
    return rk, rv


def _first_page(lens, first_query, sliding_window, p: int) -> int:
    """The first page any query can see: 0, or with a sliding window the page of the earliest key any sequence's
    first query (``first_query`` ``[B]``) sees."""
    if sliding_window is None or not lens:
        return 0
    return max(0, min(int(first_query.min()) - sliding_window + 1, max(lens))) // p


def _decode(q, block_table, lengths, pool, res_k, res_v, res_lengths, key_bits, value_bits, group_size, sm_scale,
            new_k, new_v, sliding_window, sink_logits):
    """:func:`paged_decode_attention` after its checks."""
    lens, rls = lengths.tolist(), res_lengths.tolist()
    if not lens:
        return torch.zeros_like(q)
    if new_k is not None:
        r = rls[0]
        if r > 0 and rls.count(r) == len(rls):  # one window length (the cache's steps): two slice copies
            res_k[:, :, r - 1] = new_k.reshape(res_k.shape[0], res_k.shape[1], res_k.shape[3])
            res_v[:, :, r - 1] = new_v.reshape(res_v.shape[0], res_v.shape[1], res_v.shape[3])
        else:
            write_new_token(res_k, res_v, res_lengths, new_k, new_v)
    rk, rv = _window(res_k, res_v, res_lengths, rls)
    p = pool[0].shape[2]
    first, keep = 0, None
    if sliding_window is not None or lens.count(lens[0]) < len(lens) or rls.count(rls[0]) < len(rls):
        newest = (lengths.long() + res_lengths.long() - 1)[:, None]
        first = _first_page(lens, newest[:, 0], sliding_window, p)
        valid, index = positions(lengths, res_lengths, -(-max(lens) // p) * p, rk.shape[2])
        keep = valid[:, None] & in_window(index, newest, sliding_window)
    out = _attend(q[:, :, None], block_table, lengths, pool, key_bits, value_bits, group_size, sm_scale, rk, rv,
                  keep, first, lens, sink_logits)
    return out[:, :, 0].to(q.dtype)


def paged_decode_attention(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                           res_k, res_v, res_lengths, key_bits: int, value_bits: int, group_size: int,
                           sm_scale: float, *, new_k=None, new_v=None, merge: bool = True,
                           sliding_window: int | None = None, sink_logits=None):
    """:func:`kivi_cache.reference.paged_decode_attention`, computed without building the dequantized history."""
    pool = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    checks.check_decode(q, block_table, lengths, pool, res_k, res_v, res_lengths, key_bits, value_bits, group_size,
                        sm_scale, sliding_window, sink_logits, new_k, new_v)
    return _decode(q, block_table, lengths, pool, res_k, res_v, res_lengths, key_bits, value_bits, group_size,
                   sm_scale, new_k, new_v, sliding_window, sink_logits)


class DecodeRunner:
    """:func:`paged_decode_attention` split into plan and run, as the kernels' :class:`kivi_cache.kernels.decode.
    DecodeRunner` is (the cache's layer between two changes of its block table). The first run with a given shape,
    dtype and device of what changes per step (``q``, ``res_lengths``, the step's token, the sink logits) is the
    ordinary call, with all its checks; later ones skip the checks of the fixed tensors' shapes (the block table,
    lengths, pool and window: they may be written to, not replaced or resized; build a new runner then). The values of
    the block table and lengths are checked again on the first run after an in-place write to either (their version
    counter moved: the cache's flush advances the lengths so; inference tensors have none: every run), those of
    ``res_lengths`` on every run."""

    def __init__(self, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v,
                 key_bits: int, value_bits: int, group_size: int, sliding_window: int | None = None):
        checks.check_sliding_window(sliding_window)
        self.fixed = (block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v)
        self.bits = (key_bits, value_bits, group_size)
        self.sliding_window = sliding_window
        self._checked: set = set()
        self._versions = None  # (block table, lengths) versions whose values were last checked
        self.fast_runs = 0  # for tests

    def run(self, q, res_lengths, sm_scale: float, new_k=None, new_v=None, sink_logits=None):
        """Attention of one query token per sequence, ``q`` ``[B, Hq, D]``; returns ``[B, Hq, D]``."""
        bt, ql, kc, ks, kz, vc, vs, vz, rk, rv = self.fixed
        key = tuple(None if t is None else (t.shape, t.dtype, t.device)
                    for t in (q, res_lengths, new_k, new_v, sink_logits))
        if key in self._checked:
            checks.check_sm_scale(sm_scale)
            if checks.values_checked(ql):  # Python reads only: no tensor operation unless something changed
                versions = _versions(bt, ql)
                if versions is None or versions != self._versions:
                    checks.table_values(bt, ql, kc.shape[0], kc.shape[2])
                    self._versions = versions
                checks.window_values(res_lengths, rk.shape[2], res_lengths.tolist())
            self.fast_runs += 1
            return _decode(q, bt, ql, (kc, ks, kz, vc, vs, vz), rk, rv, res_lengths, *self.bits, sm_scale, new_k,
                           new_v, self.sliding_window, sink_logits)
        out = paged_decode_attention(q, bt, ql, kc, ks, kz, vc, vs, vz, rk, rv, res_lengths, *self.bits, sm_scale,
                                     new_k=new_k, new_v=new_v, sliding_window=self.sliding_window,
                                     sink_logits=sink_logits)
        self._checked.add(key)
        self._versions = _versions(bt, ql) if checks.values_checked(ql) else None
        return out


def _versions(*tensors) -> tuple | None:
    """The tensors' version counters (every in-place write moves them); None where one is an inference tensor (made
    under ``torch.inference_mode``), which keeps none: its values are then checked on every run."""
    return None if any(t.is_inference() for t in tensors) else tuple(t._version for t in tensors)


def paged_prefix_attention(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                           res_k, res_v, res_lengths, new_k, new_v, new_mask, key_bits: int, value_bits: int,
                           group_size: int, sm_scale: float, *, sliding_window: int | None = None, sink_logits=None):
    """:func:`kivi_cache.reference.paged_prefix_attention`, computed without building the dequantized history."""
    pool = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    checks.check_prefix(q, block_table, lengths, pool, res_k, res_v, res_lengths, new_k, new_v, new_mask, key_bits,
                        value_bits, group_size, sm_scale, sliding_window, sink_logits)
    lens, rls = lengths.tolist(), res_lengths.tolist()
    rk, rv = _window(res_k, res_v, res_lengths, rls)
    p = k_codes.shape[2]
    queries = (lengths.long() + res_lengths.long())[:, None] + torch.arange(q.shape[2], device=q.device)[None, :]
    valid, index = positions(lengths, res_lengths, -(-max(lens, default=0) // p) * p, rk.shape[2])
    keep = torch.cat([valid[:, None, :] & in_window(index, queries, sliding_window), new_mask], dim=2)
    return _attend(q, block_table, lengths, pool, key_bits, value_bits, group_size, sm_scale,
                   torch.cat([rk, new_k.to(rk.dtype)], dim=2), torch.cat([rv, new_v.to(rv.dtype)], dim=2), keep,
                   _first_page(lens, queries[:, 0], sliding_window, p), lens, sink_logits).to(q.dtype)

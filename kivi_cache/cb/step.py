"""One forward of transformers' continuous-batching engine over the quantized cache.

The engine packs a ragged batch into one sequence of ``T`` tokens: each row is a request's next ``q`` tokens after
the ``past`` it holds, either one decode token or a chunk of its prompt (long prompts come in several chunks). The
cache records the rows while the engine prepares the batch (:class:`Row`); at the first layer the rows become a
:class:`Step`, built once per forward: every length and index each layer needs, on the device. Each layer then
calls :meth:`Step.attend` through the attention hook, which attends and stores that layer's new tokens:

* **decode rows** (``q == 1``, ``past > 0``), all at once: the token joins its request's window and a full window
  flushes its oldest group into the pages (:func:`kivi_cache.ops.append_and_flush`), then
  :func:`kivi_cache.ops.paged_decode_attention` reads pages and window (the Triton kernels on a GPU);
* **chunk rows**, one at a time: a first chunk attends to itself (causal sdpa, full precision); a later chunk also
  to the request's pages and window (:func:`kivi_cache.ops.paged_prefix_attention`). After attending, the chunk's
  tokens join the window and the whole groups beyond the sinks and the newest ``residual_length`` tokens leave it
  for the pages (:func:`kivi_cache.ops.quantize_and_write`), the rule of :mod:`kivi_cache.window`.

Rows are distinct requests, so a layer's order of rows changes nothing. A failure midway leaves some layers stored
and others not: the cache refuses further steps (``KiviPagedAttentionCache.error``) until its ``reset()``, and the
engine's loop stops and fails its requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops, rotation


@dataclass
class Row:
    """One row of the engine's batch: window slot, tokens held before the step, new tokens, the request's block ids
    (= page ids) and the row's first token in the packed batch."""

    slot: int
    past: int
    q: int
    blocks: list[int]
    start: int


def _table(rows: list[Row], device) -> torch.Tensor:
    """int32 ``[B, W]`` page table (unused columns 0, a valid page id; the ops read only a row's own pages)."""
    width = max(1, max(len(r.blocks) for r in rows))
    data = [r.blocks + [0] * (width - len(r.blocks)) for r in rows]
    return torch.tensor(data, dtype=torch.int32, device=device)


class _Decode:
    """The decode rows' tensors: token positions, slots, page table and the window lengths before and after."""

    def __init__(self, cache, rows: list[Row]):
        dev = cache.device
        before = [cache.window_state(r.past) for r in rows]
        after = [cache.window_state(r.past + 1) for r in rows]
        ints = torch.tensor([[r.start for r in rows], [r.slot for r in rows],
                             [b[1] for b in before], [b[2] for b in before], [b[0] for b in before],
                             [a[1] for a in after], [a[2] for a in after]], dtype=torch.int32, device=dev)
        self.idx, self.slots = ints[0].long(), ints[1].long()
        self.paged0, self.window0, self.sinks0, self.paged1, self.window1 = ints[2], ints[3], ints[4], ints[5], ints[6]
        self.window0_long = ints[3].long()
        self.table = _table(rows, dev)
        flush = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a[1] > b[1]]
        self.flush_rows = torch.tensor(flush, dtype=torch.long, device=dev) if flush else None


class _Chunk:
    """One chunk row: its history's lengths and, where it has one, the tensors to attend to it; where its window
    flushes, the pages and slots of the groups leaving it."""

    def __init__(self, cache, row: Row):
        cfg, dev = cache.quant, cache.device
        self.row = row
        self.sinks0, self.paged0, self.window0 = cache.window_state(row.past)
        self.sinks1, paged1, _ = cache.window_state(row.past + row.q)
        self.flushed = paged1 - self.paged0
        self.history = row.past > 0
        if self.history:
            self.table = _table([row], dev)
            self.lengths = torch.tensor([self.paged0, self.window0], dtype=torch.int32, device=dev)
            self.mask = torch.ones(row.q, row.q, dtype=torch.bool, device=dev).tril()[None]
        if self.flushed:
            g, p = cfg.group_size, cfg.page_size
            positions = range(self.paged0, paged1, g)
            self.pages = torch.tensor([row.blocks[x // p] for x in positions], dtype=torch.int32, device=dev)
            self.page_slots = torch.tensor([x % p for x in positions], dtype=torch.int32, device=dev)


class Step:
    """What every layer of one forward needs (module docstring); :meth:`attend` is called once per layer."""

    def __init__(self, cache, rows: list[Row]):
        self.cache = cache
        cfg = cache.quant
        self.bits = dict(key_bits=cfg.key_bits, value_bits=cfg.value_bits, group_size=cfg.group_size)
        self.rule = dict(residual_length=cfg.residual_length, sink_length=cfg.sink_length)
        self.clip = cfg.clip_args
        self.rotations = None  # kivi_cache.rotation.matrices of cfg.rotate, made at the first layer
        decode = [r for r in rows if r.q == 1 and r.past > 0]
        self.decode = _Decode(cache, decode) if decode else None
        self.chunks = [_Chunk(cache, r) for r in rows if not (r.q == 1 and r.past > 0)]

    def attend(self, layer: int, query, key, value, scaling: float):
        """``query`` ``[1, Hq, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]`` (the batch's new tokens) -> attention
        output ``[1, T, Hq, D]`` (rows of padding tokens zero); the layer's new tokens are stored. With
        ``QuantConfig.rotate`` everything stored is rotated (:mod:`kivi_cache.rotation`): the step's keys and queries
        by ``H`` where keys are, its values where values are, and the output turned back."""
        try:
            if self.rotations is None:
                self.rotations = rotation.matrices(self.cache.quant.rotate, query.shape[-1], query.dtype,
                                                   query.device)
            rot_k, rot_v = self.rotations
            if rot_k is not None:
                query, key = query @ rot_k, key @ rot_k
            if rot_v is not None:
                value = value @ rot_v
            out = self._attend(layer, query, key, value, scaling)
            return out if rot_v is None else out @ rot_v
        except BaseException as exc:
            self.cache.error = exc
            raise

    def _attend(self, layer: int, query, key, value, scaling: float):
        out = query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3])
        pool = self.cache.cache_allocators["full_attention"].pools[layer]
        res_k, res_v = self.cache.res_k[layer], self.cache.res_v[layer]
        if self.decode is not None:
            out[0, self.decode.idx] = self._decode(pool, res_k, res_v, query, key, value, scaling)
        for chunk in self.chunks:
            r = chunk.row
            out[0, r.start:r.start + r.q] = self._chunk(chunk, pool, res_k, res_v, query, key, value, scaling)
        return out

    def _decode(self, pool, res_k, res_v, query, key, value, scaling):
        d = self.decode
        q = query[0, :, d.idx].transpose(0, 1).contiguous()  # [B, Hq, D]
        new_k = key[0, :, d.idx].transpose(0, 1).contiguous()  # [B, Hkv, D]
        new_v = value[0, :, d.idx].transpose(0, 1).contiguous()
        win_k, win_v = res_k.index_select(0, d.slots), res_v.index_select(0, d.slots)
        ops.append_and_flush(new_k, new_v, win_k, win_v, d.window0, d.sinks0, d.paged0, d.table, pool, **self.bits,
                             **self.rule, **self.clip)
        out = ops.paged_decode_attention(q, d.table, d.paged1, pool, res_k=win_k, res_v=win_v,
                                         res_lengths=d.window1, **self.bits, sm_scale=scaling)
        # the windows that did not flush gained one token; those that did moved: copy them whole
        res_k[d.slots, :, d.window0_long] = new_k.to(res_k.dtype)
        res_v[d.slots, :, d.window0_long] = new_v.to(res_v.dtype)
        if d.flush_rows is not None:
            slots = d.slots.index_select(0, d.flush_rows)
            res_k.index_copy_(0, slots, win_k.index_select(0, d.flush_rows))
            res_v.index_copy_(0, slots, win_v.index_select(0, d.flush_rows))
        return out

    def _chunk(self, c: _Chunk, pool, res_k, res_v, query, key, value, scaling):
        r = c.row
        q = query[:, :, r.start:r.start + r.q]  # [1, Hq, L, D]
        k = key[:, :, r.start:r.start + r.q]  # [1, Hkv, L, D]
        v = value[:, :, r.start:r.start + r.q]
        if c.history:
            out = ops.paged_prefix_attention(q, c.table, c.lengths[:1], pool, res_k=res_k[r.slot:r.slot + 1],
                                             res_v=res_v[r.slot:r.slot + 1], res_lengths=c.lengths[1:], new_k=k,
                                             new_v=v, new_mask=c.mask, **self.bits, sm_scale=scaling)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                                   enable_gqa=q.shape[1] != k.shape[1])
        self._store(c, pool, res_k, res_v, k[0], v[0])
        return out[0].transpose(0, 1)

    def _store(self, c: _Chunk, pool, res_k, res_v, k, v) -> None:
        """The chunk's tokens ``[Hkv, L, D]`` into the request's window, and its whole groups beyond the sinks and
        the newest ``residual_length`` tokens into the pages (:func:`kivi_cache.window.window_append`)."""
        r, w0 = c.row, c.window0
        if not c.flushed:
            res_k[r.slot, :, w0:w0 + r.q] = k
            res_v[r.slot, :, w0:w0 + r.q] = v
            return
        s, n, g = c.sinks1, c.flushed, self.bits["group_size"]
        # window, then chunk: [H, w0 + L, D]; its tokens s .. s + n leave for the pages, the rest stays
        seq_k = torch.cat([res_k[r.slot, :, :w0], k.to(res_k.dtype)], dim=1)
        seq_v = torch.cat([res_v[r.slot, :, :w0], v.to(res_v.dtype)], dim=1)
        groups = [x[:, s:s + n].unflatten(1, (n // g, g)).transpose(0, 1).contiguous() for x in (seq_k, seq_v)]
        ops.quantize_and_write(*groups, c.pages, c.page_slots, pool, **self.bits, **self.clip)  # [N, H, G, D] each
        keep = seq_k.shape[1] - n
        for res, seq in ((res_k, seq_k), (res_v, seq_v)):
            res[r.slot, :, :s] = seq[:, :s]  # the sinks (a first chunk's are new)
            res[r.slot, :, s:keep] = seq[:, s + n:]

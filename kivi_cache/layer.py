"""One model layer's quantized, paged KV cache (a transformers ``CacheLayerMixin``).

State per sequence ``b``:

* ``pads[b]``: positions of the batch's virtual timeline that hold no stored
  token (left padding; those tokens are never stored when the attention hook
  sees the padding mask);
* ``q_lens[b]`` quantized tokens in the pages listed by ``tables[b]``
  (always a multiple of ``group_size``);
* ``r_lens[b]`` tokens in full precision in ``res_k/res_v[b]``: first the sequence's
  ``sinks[b]`` attention-sink tokens (its first ``sink_length`` tokens, kept for good),
  then the newest tokens (the residual window proper);
* ``hidden[b]``: leading entries of ``tables[b]`` whose pages were released (a sliding-window
  layer: no query can see their tokens again); they point at the pool's zero page.

``seen`` is the virtual length (what ``get_seq_length`` reports and the masks
are built for): ``seen == pads[b] + q_lens[b] + r_lens[b]`` for every b.

Semantics every path follows: a single new token is stored first and then
attended to from the pages and residual window; a chunk of several new tokens
attends to the stored history plus its own full-precision keys and values
(causal within the chunk), and is stored afterwards. A prompt on an empty cache
is thus attended in full precision, as in KIVI.
"""

from __future__ import annotations

import dataclasses
import numbers
import weakref

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from . import checks, ops
from .config import QuantConfig
from .lazy import KVHandle, PendingStep
from .pool import PagePool
from .window import capacity, window_append


class CacheUnusableError(RuntimeError):
    """An operation on the cache failed after it had started changing it (out of memory while the pool grew, a
    kernel error while a step was stored): the cache refuses every later use until ``reset()``, instead of going on
    from a half-changed state."""


class QuantizedPagedLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False
    is_croppable = True
    # the device block table gets spare columns (-1) up to a power of two: a decode step's flush that starts a page
    # column writes it in place, so the table stays the same tensor and the layer's decode runner stays valid (a new
    # table would mean a new runner: an ordinary op call and a plan per layer every other flush)
    SPARE_COLUMNS = True

    def __init__(self, cfg: QuantConfig):
        super().__init__()
        self.cfg = cfg
        self._bits = dict(key_bits=cfg.key_bits, value_bits=cfg.value_bits, group_size=cfg.group_size)
        self.pool: PagePool | None = None
        # the model layer's sliding window (None: full attention), learned from the attention hook
        # (use_sliding_window); the layer then keeps no sink tokens
        self.sliding_window: int | None = None
        # transformers' past recording (assisted decoding): a sliding-window layer then writes every token of a step
        # (no skipped pages), so that crop can take back any of the last step's tokens
        self.record_past = False
        self.unusable: str | None = None  # why the layer refuses use until reset() (see CacheUnusableError)
        self._clear_sequences()

    def activate_past_recording(self, **kwargs) -> None:
        """transformers' hook before a generation that crops (assisted decoding): see ``record_past``. (Keyword
        arguments, such as 5.25's ``recurrent_states_to_keep`` for recurrent layers, do not apply.)"""
        self.record_past = True

    def use_sliding_window(self, window: int) -> bool:
        """Serve this layer as sliding-window attention of ``window`` positions (its module says so at every step).
        A layer that holds no sink tokens can (the first time: before it stores anything, its sink setting is
        dropped: sinks are the sequence's first tokens, which the window hides); one that already holds some
        cannot, nor one told another window before (False)."""
        if self.sliding_window is not None:
            return self.sliding_window == window
        if self.cfg.sink_length:
            if any(self.sinks) or any(self.q_lens) or any(self.r_lens):
                return False
            self.cfg = dataclasses.replace(self.cfg, sink_length=0)
        self.sliding_window = window
        return True

    # ------------------------------------------------------------------ state
    def _clear_sequences(self) -> None:
        self.batch_size = 0
        self.tables: list[list[int]] = []
        self.q_lens: list[int] = []
        self.r_lens: list[int] = []
        self.pads: list[int] = []
        self.sinks: list[int] = []
        self.hidden: list[int] = []
        self.seen = 0
        self.res_k = self.res_v = None
        self.pending: PendingStep | None = None
        self._dev = None  # cached (block_table, q_lens, r_lens) device tensors
        self._bt_width = 0  # the columns of the cached device block table that hold pages (the rest: spare, -1)
        self._length_rows = None  # this batch's rows of the shared window-length table (_uniform_lengths)
        if self.pool is not None:
            self.pool.decode_runner = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.cfg.check_head_dim(d)  # raises before any state is touched
        if value_states.shape[1] != h or value_states.shape[-1] != d:
            raise ValueError(
                f"key and value heads must have the same shape (heads and head_dim), got keys "
                f"{tuple(key_states.shape)} and values {tuple(value_states.shape)}: a model whose values have "
                f"another head_dim than its keys (DeepSeek's multi-head latent attention) is not supported; use "
                f"transformers' DynamicCache for it")
        if key_states.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"key_states dtype must be float16, bfloat16 or float32, got {key_states.dtype}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_heads, self.head_dim = h, d
        pool = self.pool
        if pool is None or (pool.num_heads, pool.head_dim, pool.dtype, pool.device) != (h, d, self.dtype,
                                                                                          self.device):
            self.pool = PagePool(self.cfg, h, d, self.dtype, self.device)
        self._clear_sequences()
        self.batch_size = b
        self.tables = [[] for _ in range(b)]
        self.q_lens = [0] * b
        self.r_lens = [0] * b
        self.pads = [0] * b
        self.sinks = [0] * b
        self.hidden = [0] * b
        cap = capacity(self.cfg.sink_length, self.cfg.residual_length, self.cfg.group_size)
        self.res_k = torch.zeros(b, h, cap, d, dtype=self.dtype, device=self.device)
        self.res_v = torch.zeros_like(self.res_k)
        self.is_initialized = True

    def _device_state(self):
        if self._dev is None:
            width = max(1, max(map(len, self.tables), default=1))
            cols = self._table_columns(width)
            # through numpy, not torch.tensor on nested lists (892 sequences: 1.05 -> 0.42 ms, eval/host_probe.py)
            bt = np.array([t if len(t) == cols else t + [-1] * (cols - len(t)) for t in self.tables], dtype=np.int32)
            r = self.r_lens
            self._bt_width = width
            self._dev = (
                self._upload(bt.reshape(len(self.tables), cols)),
                self._upload(np.array(self.q_lens, dtype=np.int32)),
                self._uniform_lengths(r[0]) if _all_equal(r) else self._upload(np.array(r, dtype=np.int32)),
            )
        return self._dev

    def _table_columns(self, width: int) -> int:
        """Columns of the device block table for tables of ``width`` pages (spare ones up to a power of two)."""
        return 1 << (width - 1).bit_length() if self.SPARE_COLUMNS else width

    def _uniform_lengths(self, r: int) -> torch.Tensor:
        """``[B]`` int32 on the device, every entry ``r`` (0 <= r <= the window's capacity): a row of a constant
        table shared by the layers (a view: the decode step's window length grows with no copy or launch). Never
        written to."""
        rows = self._length_rows
        if rows is None:  # dropped whenever the batch changes (_clear_sequences, _select)
            cap = self.res_k.shape[2]
            key = (self.device, self.batch_size, cap)
            rows = _LENGTH_ROWS.get(key)
            if rows is None:
                if len(_LENGTH_ROWS) > 16:
                    _LENGTH_ROWS.clear()
                # rows padded to 16 bytes: every row's address has the same alignment (Triton specializes pointers
                # on it: unpadded rows would compile a second decode kernel for the odd ones)
                width = -(-self.batch_size // 4) * 4
                table = self._upload(np.repeat(np.arange(cap + 1, dtype=np.int32)[:, None], width, axis=1))
                rows = _LENGTH_ROWS[key] = [row[:self.batch_size] for row in table]  # views, made once
            self._length_rows = rows
        return rows[r]

    def _upload(self, a: np.ndarray) -> torch.Tensor:
        """A host array on the cache's device without a stream sync. torch's blocking copy from pageable memory
        ends in a stream synchronize (5 such copies per layer at every flush), and an async copy from pageable
        memory may still sync in the driver; so the array goes through pinned memory from torch's caching host
        allocator, which keeps the block until the copy has run."""
        t = torch.from_numpy(a)
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    # ----------------------------------------------------------------- update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.unusable is not None:
            self.check_usable()
        checks.check_states(key_states, value_states)
        if value_states.dtype != key_states.dtype:
            raise ValueError(f"key_states ({key_states.dtype}) and value_states ({value_states.dtype}) must have one "
                             f"dtype")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, n, d = key_states.shape
        if (b, h, d) != (self.batch_size, self.num_heads, self.head_dim) or value_states.shape != key_states.shape:
            raise ValueError(
                f"key/value states of shape {tuple(key_states.shape)}/{tuple(value_states.shape)} do not match "
                f"the cache (batch {self.batch_size}, {self.num_heads} heads, head_dim {self.head_dim})")
        if key_states.dtype != self.dtype or key_states.device != self.device:
            raise ValueError(f"key/value states must have the dtype and device of the tokens stored ({self.dtype} on "
                             f"{self.device}), got {key_states.dtype} on {key_states.device}: a cache holds one "
                             f"model's states (reset() it, or make a new cache, for another dtype or device)")
        if self.pending is not None:
            self.commit(self.pending)  # the last step's attention never read its handles
        step = PendingStep(self, key_states, value_states)
        self.pending = step
        self.seen += n
        shape = (b, h, self.seen, d)
        return KVHandle(step, 0, shape), KVHandle(step, 1, shape)

    def commit(self, step: PendingStep, valid: torch.Tensor | None = None, defer_write: bool = False) -> bool:
        """Store the step's new tokens. ``valid`` ``[B, L]`` bool marks real (non-pad) tokens. ``defer_write``: a
        one-token step may leave its window write to the decode op (``new_k``/``new_v``) when no group is flushed;
        returns whether it did (the caller must then pass the step's key and value to the op)."""
        if step.done:
            return False
        if step is not self.pending:
            raise RuntimeError("kivi_cache: a stale key/value handle was used after a later cache update")
        step.done = True
        self.pending = None
        k, v = step_tensors(step)
        try:
            if valid is None and k.shape[2] == 1:
                return self._append_one(k, v, defer_write)
            # the stored index of each sequence's first new token: the step's first query (a sliding-window layer
            # keeps what it sees, so that crop may take the step's tokens back: assisted decoding's rejected candidates)
            first = [q + r for q, r in zip(self.q_lens, self.r_lens, strict=True)] if self.sliding_window else None
            self._append_chunk(k, v, valid)
            if first is not None:
                self._release_hidden_pages(first)
        except BaseException as exc:  # the step is counted (seen) but only partly stored
            self.mark_unusable("storing a step", exc)
            raise
        return False

    # ------------------------------------------------------- sliding window: pages no query can see again
    def _hidden_prefix(self, q: int, c: int, r: int) -> int:
        """Of ``c`` tokens about to be quantized after a sequence's ``q`` (page-aligned), leaving ``r`` in the window:
        how many (whole pages) no later query will see, so need not be written (a long prompt on a sliding-window
        layer). 0 while the cache records its past (transformers' ``activate_past_recording``, assisted decoding):
        ``crop`` may then take back any of the step's tokens, and those of its first queries see them."""
        w, p = self.sliding_window, self.cfg.page_size
        if w is None or q % p or self.record_past:
            return 0
        dead = min(q + c, q + c + r - w) // p * p
        return max(0, dead - q)

    def _skip_hidden(self, seqs, q: int, r: int, groups):
        """The ``groups`` (keys, values; token axis -2) about to be quantized for sequences ``seqs``, each holding
        ``q`` quantized tokens, less their leading whole pages that no later query will see (:meth:`_hidden_prefix`):
        those are not stored but become zero-page entries (the earlier pages are hidden too). None if nothing is
        left to write."""
        skip = self._hidden_prefix(q, groups[0].shape[-2], r)
        if skip:
            for i in seqs:
                self._hide(i, (q + skip) // self.cfg.page_size)
                self.q_lens[i] += skip
            groups = (groups[0][..., skip:, :], groups[1][..., skip:, :])
        return groups if groups[0].shape[-2] else None

    def _hide(self, i: int, dead: int) -> bool:
        """Point sequence ``i``'s first ``dead`` table entries at the zero page, releasing their pages (entries
        past the table's end are added: a prompt's skipped pages). Returns whether anything changed."""
        h = self.hidden[i]
        if dead <= h:
            return False
        table, pool = self.tables[i], self.pool
        pool.release([page for page in table[h:dead] if page != pool.zero])  # first: the zero page may reuse one
        table[h:dead] = [pool.zero_page()] * (dead - h)
        self.hidden[i] = dead
        return True

    def _release_hidden_pages(self, first: list[int] | None = None) -> None:
        """Release the whole pages of a sliding-window layer that the step's queries and every later one's window
        starts after: a query at stored index ``t`` sees indices ``> t - window``; the step's first query is at
        ``first[i]`` (None: a one-token step, the newest stored token). Their entries then point at the pool's zero
        page. Keeping what the step's first query sees lets ``crop`` take back the step's tokens."""
        w, p = self.sliding_window, self.cfg.page_size
        if first is None and self.hidden and _all_equal(self.hidden) and _all_equal(self.q_lens) and _all_equal(
                self.r_lens):  # a decode step of an unpadded batch: one answer for all (most flushes release nothing)
            q = self.q_lens[0]
            if max(0, min(q, q + self.r_lens[0] - w)) // p <= self.hidden[0]:
                return
        changed = False
        for i in range(self.batch_size):
            q = self.q_lens[i]
            t = q + self.r_lens[i] - 1 if first is None else first[i]
            changed |= self._hide(i, max(0, min(q, t + 1 - w)) // p)
        if changed:
            self._dev = None

    def _append_one(self, k, v, defer_write: bool = False) -> bool:
        r, rule, b = self.r_lens, self._rule(), self.batch_size
        uniform = self._uniform()  # no padding so far: one window length and sink count for all
        if uniform:  # O(1) list updates
            s0, c = window_append(r[0], self.sinks[0], 1, **rule)
            new_r, new_s = [r[0] + 1] * b, [s0] * b
            full = list(range(b)) if c else []
        else:
            new_r = [x + 1 for x in r]
            steps = [window_append(x, s, 1, **rule) for x, s in zip(r, self.sinks, strict=True)]
            new_s = [s for s, _ in steps]
            full = [i for i, (_, c) in enumerate(steps) if c]
        deferred = defer_write and not full  # a flush reads the window: then it is written here first
        if not deferred:
            self._window_write(k, v, uniform or _all_equal(r))
        self.r_lens, self.sinks = new_r, new_s
        if self._dev is not None:
            if _all_equal(new_r):
                self._dev = (*self._dev[:2], self._uniform_lengths(new_r[0]))
            else:  # lengths that differ stayed different: an uploaded tensor of this layer, not a shared row
                self._dev[2].add_(1)
        if full:
            self._flush_residual(full)
            if self.sliding_window is not None:
                self._release_hidden_pages()
        return deferred

    def _window_write(self, k, v, equal: bool) -> None:
        """Write a one-token step into every window at its current length (``equal``: one length for all)."""
        if equal:  # narrow + copy_: half the host time of an indexed assignment
            r = self.r_lens[0]
            self.res_k.narrow(2, r, 1).copy_(k)
            self.res_v.narrow(2, r, 1).copy_(v)
        else:
            rows = torch.arange(self.batch_size, device=self.device)
            idx = self._device_state()[2].long()
            self.res_k[rows, :, idx] = k[:, :, 0]
            self.res_v[rows, :, idx] = v[:, :, 0]

    def _uniform(self) -> bool:
        """Every sequence has the same window and sink lengths (no padding so far): bulk tensor ops apply."""
        return _all_equal(self.r_lens) and _all_equal(self.sinks)

    def _rule(self) -> dict:
        """The window rule's settings (:func:`kivi_cache.window.window_append`) for this layer."""
        cfg = self.cfg
        return dict(sink_length=cfg.sink_length, residual_length=cfg.residual_length, group_size=cfg.group_size)

    def _flush_count(self, total: int, sinks: int) -> int:
        """Tokens to quantize out of a window of ``total`` tokens (``sinks`` of them sinks): whole groups beyond R."""
        return window_append(total, sinks, 0, **self._rule())[1]

    def _flush_residual(self, seqs) -> None:
        if len(seqs) == self.batch_size and self._uniform():  # every window at once
            s, r = self.sinks[0], self.r_lens[0]
            c = self._flush_count(r, s)
            old, old_width = self._dev, self._bt_width
            # quantized before the shift; a flush into the pages of the cached table's last column reads their ids
            # from it (no upload)
            last = old[0][:, old_width - 1] if old is not None and old_width == len(self.tables[0]) else None
            done = self._write_batch(self.res_k[:, :, s:s + c], self.res_v[:, :, s:s + c], last)
            self._window_drop(slice(None), s, r, c)
            self.r_lens = [r - c] * self.batch_size
            width = len(self.tables[0])
            if old is not None and done is not None and (done[1], old_width) in (("same", width),
                                                                                  ("append", width - 1)):
                # a decode step's flush: the device state follows without uploading it again: the quantized lengths
                # grow by c, the block table keeps its pages or gains the column of pages just written (in a spare
                # column: the same tensor; else a wider copy)
                pages, change = done
                bt = old[0]
                if change == "append":
                    if width > bt.shape[1]:
                        spare = bt.new_full((bt.shape[0], self._table_columns(width) - width), -1)
                        bt = torch.cat([bt, pages[:, None], spare], dim=1)
                    else:
                        bt[:, width - 1] = pages
                self._dev = (bt, old[1].add_(c), self._uniform_lengths(r - c))
                self._bt_width = width
                return
        else:
            items = []
            for i in seqs:
                s = self.sinks[i]
                c = self._flush_count(self.r_lens[i], s)
                items.append((i, self.res_k[i, :, s:s + c], self.res_v[i, :, s:s + c]))
            self._write_groups(items)  # copies the groups out before the shift below
            for i, kc, _ in items:
                self._window_drop(i, self.sinks[i], self.r_lens[i], kc.shape[1])
                self.r_lens[i] -= kc.shape[1]
        self._dev = None

    def _window_drop(self, idx, s: int, r: int, c: int) -> None:
        """Remove the ``c`` window tokens after the ``s`` sinks of sequence ``idx`` (an int) or of every
        sequence (``slice(None)``), shifting the rest of the ``r``-token window left."""
        for res in (self.res_k[idx], self.res_v[idx]):
            res[..., s:r - c, :] = res[..., s + c:r, :].clone()

    def _window_append(self, idx, r: int, s: int, nk, nv):
        """Append ``nk``/``nv`` (token axis -2) to the window of sequence ``idx`` (an int) or of the whole batch
        (``slice(None)``, every window holding ``r`` tokens, ``s`` of them sinks). Returns the new sink count, the new
        window length and the groups to quantize (keys, values; token axis -2), or None."""
        total = r + nk.shape[-2]
        s, c = window_append(r, s, nk.shape[-2], **self._rule())
        rk, rv = self.res_k[idx], self.res_v[idx]  # views
        if c == 0:
            rk[..., r:total, :] = nk
            rv[..., r:total, :] = nv
            return s, total, None
        if r:
            nk = torch.cat([rk[..., :r, :], nk], dim=-2)
            nv = torch.cat([rv[..., :r, :], nv], dim=-2)
        groups = (nk[..., s:s + c, :], nv[..., s:s + c, :])  # nk/nv never alias the window: safe after the writes
        rk[..., :s, :] = nk[..., :s, :]
        rv[..., :s, :] = nv[..., :s, :]
        rk[..., s:total - c, :] = nk[..., s + c:, :]
        rv[..., s:total - c, :] = nv[..., s + c:, :]
        return s, total - c, groups

    def _append_chunk(self, k, v, valid) -> None:
        n_new = k.shape[2]
        if valid is None and self._uniform():  # the whole batch at once (a prompt or chunk without padding)
            s, r, groups = self._window_append(slice(None), self.r_lens[0], self.sinks[0], k, v)
            if groups is not None:
                groups = self._skip_hidden(range(self.batch_size), self.q_lens[0], r, groups)
            if groups is not None:
                self._write_batch(*groups)
            self.sinks = [s] * self.batch_size
            self.r_lens = [r] * self.batch_size
            self._dev = None
            return
        items = []
        for i in range(self.batch_size):
            if valid is None:
                nk, nv = k[i], v[i]
            else:
                keep = valid[i].nonzero().squeeze(-1)
                nk, nv = k[i].index_select(1, keep), v[i].index_select(1, keep)
            self.pads[i] += n_new - nk.shape[1]
            self.sinks[i], self.r_lens[i], groups = self._window_append(i, self.r_lens[i], self.sinks[i], nk, nv)
            if groups is not None:
                groups = self._skip_hidden((i,), self.q_lens[i], self.r_lens[i], groups)
            if groups is not None:
                items.append((i, *groups))
        self._write_groups(items)
        self._dev = None

    def _reserve_pages(self, counts) -> None:
        """Grow the pool once for a step: ``counts`` = (sequence, tokens to quantize) pairs."""
        p = self.cfg.page_size
        self.pool.reserve(sum(max(0, -(-(self.q_lens[i] + c) // p) - len(self.tables[i])) for i, c in counts))

    def _reserve(self, i: int, c: int, pages: list, slots: list) -> None:
        """Page and slot of each of sequence ``i``'s next ``c // G`` groups (pages allocated as needed)."""
        g, p, pool = self.cfg.group_size, self.cfg.page_size, self.pool
        table = self.tables[i]
        for t in range(self.q_lens[i], self.q_lens[i] + c, g):
            j, slot = divmod(t, p)
            if j == len(table):
                table.append(pool.allocate())
            elif t == self.q_lens[i]:  # first write into a partly filled page
                table[j] = pool.copy_on_write(table[j])
            pages.append(table[j])
            slots.append(slot)
        self.q_lens[i] += c

    def _reserve_one_group_each(self):
        """:meth:`_reserve` of one group for every sequence when all hold the same number of quantized tokens (the
        flush of a uniform batch: every decode step's flush): one page index and slot for all, new pages taken from
        the pool in one slice; the same page ids as the per-sequence loop, without its per-sequence Python (which
        costs milliseconds per layer and flush at hundreds of sequences). Returns (pages, the slot, how the tables
        changed: "append" (a page each), "same" or "cow" (a shared page replaced by a private copy)); None (nothing
        done) where the tables differ in width."""
        p, pool, tables = self.cfg.page_size, self.pool, self.tables
        q0, b = self.q_lens[0], self.batch_size
        j, slot = divmod(q0, p)
        widths = {len(t) for t in tables}
        change = "same"
        if widths == {j}:  # every sequence starts a page: allocate b, in pop order
            for t, page in zip(tables, pool.allocate_many(b), strict=True):
                t.append(page)
            change = "append"
        elif widths == {j + 1}:  # each writes into its page j: a private copy only where a page is shared
            rc = pool.refcount
            for t in tables:
                if rc[t[j]] != 1:
                    t[j] = pool.copy_on_write(t[j])
                    change = "cow"
        else:  # tables of different widths (not seen in practice): the per-sequence loop
            return None
        self.q_lens = [q0 + self.cfg.group_size] * b
        return [t[j] for t in tables], slot, change

    def _quantize(self, k_groups, v_groups, pages: list, slots, pages_dev=None) -> torch.Tensor:
        """Quantize groups into (pages, slots); ``slots`` a list, or one int for all; ``pages_dev``: the pages already
        on the device (else uploaded). Returns the pages on the device. The caller updates or drops the cached
        device state."""
        cfg = self.cfg
        if pages_dev is None:
            pages_dev = self._upload(np.array(pages, dtype=np.int32))
        if isinstance(slots, int) and slots <= self.res_k.shape[2] and len(pages) == self.batch_size:
            # one slot for every sequence: a row of the constant table
            slots_dev = self._uniform_lengths(slots)
        else:
            slots = [slots] * len(pages) if isinstance(slots, int) else slots
            slots_dev = self._upload(np.array(slots, dtype=np.int32))
        with checks.own_state():  # strided views of the window are fine (the kernels take strides): no copies
            ops.quantize_and_write(k_groups, v_groups, pages_dev, slots_dev, *self.pool.args(), key_bits=cfg.key_bits,
                                   value_bits=cfg.value_bits, group_size=cfg.group_size)
        return pages_dev

    def _write_groups(self, items) -> None:
        """Quantize and write ``(seq, keys [H, c, D], values [H, c, D])`` items (c multiple of G), one launch."""
        if not items:
            return
        g = self.cfg.group_size
        pages, slots, ks, vs = [], [], [], []
        self._reserve_pages((i, kc.shape[1]) for i, kc, _ in items)
        for i, kc, vc in items:
            c = kc.shape[1]
            self._reserve(i, c, pages, slots)
            h, _, d = kc.shape
            ks.append(kc.reshape(h, c // g, g, d).transpose(0, 1))
            vs.append(vc.reshape(h, c // g, g, d).transpose(0, 1))
        self._quantize(torch.cat(ks), torch.cat(vs), pages, slots)
        self._dev = None

    def _write_batch(self, kc, vc, last_column=None):
        """Every sequence's next ``c`` tokens (keys/values ``[B, H, c, D]``, c multiple of G), one launch. Drops the
        cached device state; for a decode flush (one group each, same page index) returns the pages on the device
        and how the tables changed (see :meth:`_reserve_one_group_each`) so the caller may rebuild it in place.
        ``last_column``: the cached block table's last page column on the device (the pages of a flush that writes
        into each sequence's last page, no copy-on-write)."""
        b, h, c, d = kc.shape
        g = self.cfg.group_size
        self._dev = None
        fast = c == g and _all_equal(self.q_lens)  # a decode flush: one group each, same page index
        reserved = self._reserve_one_group_each() if fast else None
        if reserved is not None:
            pages, slots, change = reserved
        else:
            pages, slots = [], []
            self._reserve_pages((i, c) for i in range(b))
            for i in range(b):
                self._reserve(i, c, pages, slots)

        def groups(x):  # [B, H, c, D] -> [B * c/G, H, G, D], sequence-major like pages/slots
            if c == g:  # a decode flush: already that shape (no view ops)
                return x
            return x.reshape(b, h, c // g, g, d).transpose(1, 2).reshape(b * (c // g), h, g, d)

        same = reserved is not None and change == "same" and last_column is not None
        pages_dev = self._quantize(groups(kc), groups(vc), pages, slots, last_column if same else None)
        return None if reserved is None else (pages_dev, change)

    # -------------------------------------------------------------- attention
    def attend(self, step: PendingStep, query: torch.Tensor, attention_mask, scaling: float, sdpa_fn, module,
               window: int | None = None, sink_logits=None, **kwargs) -> torch.Tensor:
        """Attention for the step's queries ``[B, Hq, L, D]``; returns ``[B, L, Hq, D]``. ``window``: the layer's
        sliding window (the hook passes it once :meth:`use_sliding_window` accepted it); ``sink_logits``: learned
        attention sinks (``[Hq]``; ``sdpa_fn`` computes them itself from ``kwargs``)."""
        n = query.shape[2]
        valid = _valid_tokens(attention_mask, n, self.batch_size)
        bits = self._bits
        if n == 1:
            deferred = self.commit(step, valid, defer_write=FUSE_WINDOW_WRITE)
            try:
                bt, ql, rl = self._device_state()
                pool = self.pool
                run = pool.decode_runner  # plan once, run every step until the block table or window is replaced
                if (run is None or run.block_table is not bt or run.lengths is not ql or run.res_k is not self.res_k
                        or run.sliding_window != window):
                    run = pool.decode_runner = ops.DecodeRunner(bt, ql, *pool.args(), res_k=self.res_k,
                                                                res_v=self.res_v, direct=DECODE_RUNNER,
                                                                sliding_window=window, own=True, **bits)
                if deferred:  # the op writes the step's token into the window (counted already by commit)
                    k, v = step_tensors(step)
                    return run(query.select(2, 0), rl, scaling, k, v, sink_logits).unsqueeze(1)
            except BaseException as exc:
                if deferred:
                    self.mark_unusable("storing a step", exc)
                raise
            return run(query.select(2, 0), rl, scaling, sink_logits=sink_logits).unsqueeze(1)
        if not any(self.q_lens) and not any(self.r_lens):
            # a prompt on an empty cache: plain full-precision attention over it
            mask = None if attention_mask is None else attention_mask[..., -n:]
            out, _ = sdpa_fn(module, query, step.key, step.value, mask, scaling=scaling, **kwargs)
            self.commit(step, valid)
            return out
        bt, ql, rl = self._device_state()
        new_mask = _chunk_visibility(attention_mask, n, self.batch_size, query.device, window)
        with checks.own_state():
            out = ops.paged_prefix_attention(
                query, bt, ql, *self.pool.args(), res_k=self.res_k, res_v=self.res_v, res_lengths=rl,
                new_k=step.key, new_v=step.value, sm_scale=scaling, sliding_window=window, sink_logits=sink_logits,
                **bits, new_mask=new_mask)
        self.commit(step, valid)
        return out.transpose(1, 2)

    def materialize(self, step: PendingStep, valid: torch.Tensor | None = None):
        """Full-precision ``[B, H, seen, D]`` keys and values for attention functions the hook does not serve.
        ``valid`` ``[B, L]`` bool marks the step's real tokens (None: all; pads are then stored)."""
        n = step.key.shape[2]
        if n == 1:
            self.commit(step, valid)
            return self._stored_layout(self.seen)
        k, v = self._stored_layout(self.seen - n, tail=(step.key, step.value))
        self.commit(step, valid)
        return k, v

    # --------------------------------------- DynamicLayer's keys/values, for code that reads a layer's tensors
    @property
    def keys(self) -> torch.Tensor | None:
        """The cached keys in full precision, ``[B, H, seen, D]``, as ``DynamicLayer.keys`` holds them (stored
        tokens dequantized, right-aligned, pads and a sliding-window layer's released tokens as zeros; a pending
        step's tokens included, nothing committed);
        None before the first update. For code that reads a layer's tensors (Whisper's ``generate`` with
        ``return_dict_in_generate``, iterating the cache): a new tensor each time, so writing to it changes
        nothing, and a dequantization per read."""
        return self._full_precision(0)

    @keys.setter
    def keys(self, value) -> None:
        self._read_only("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """The cached values in full precision, ``[B, H, seen, D]`` (see :attr:`keys`)."""
        return self._full_precision(1)

    @values.setter
    def values(self, value) -> None:
        self._read_only("values", value)

    @staticmethod
    def _read_only(name: str, value) -> None:
        if value is not None:  # CacheLayerMixin.__init__ sets None
            raise AttributeError(f"QuantizedPagedLayer.{name} is read-only: the dequantized history, computed on "
                                 "each read (the cache stores codes, scales and a full-precision window)")

    def _full_precision(self, which: int):
        if not self.is_initialized:
            return None
        self.check_usable()
        step = self.pending
        if step is None:
            return self._stored_layout(self.seen)[which]
        return self._stored_layout(self.seen - step.key.shape[2], tail=(step.key, step.value))[which]

    def _stored_layout(self, length: int, tail=None):
        """Stored tokens dequantized, right-aligned in a ``[B, H, length, D]`` timeline (pads as zeros); ``tail``:
        keys and values ``[B, H, n, D]`` appended (-> ``[B, H, length + n, D]``)."""
        b, h, d = self.batch_size, self.num_heads, self.head_dim
        if length == 0:
            k = torch.zeros(b, h, 0, d, dtype=self.dtype, device=self.device)
            if tail is None:
                return k, torch.zeros_like(k)
            return torch.cat([k, tail[0]], dim=2), torch.cat([k, tail[1]], dim=2)
        cfg = self.cfg
        bt, ql, _ = self._device_state()
        bits = dict(key_bits=cfg.key_bits, value_bits=cfg.value_bits, group_size=cfg.group_size)
        if (b and self.q_lens[0] + self.r_lens[0] == length and _all_equal(self.q_lens) and _all_equal(self.r_lens)
                and _all_equal(self.sinks) and not any(self.hidden)):
            # no pads, nothing released (eager attention's step): sinks, quantized tokens and the newest written
            # straight into one buffer
            q, r, s = self.q_lens[0], self.r_lens[0], self.sinks[0]
            k = torch.empty(b, h, length + (0 if tail is None else tail[0].shape[2]), d, dtype=self.dtype,
                            device=self.device)
            v = torch.empty_like(k)
            for i, (out, res) in enumerate(((k, self.res_k), (v, self.res_v))):
                out[:, :, :s] = res[:, :, :s]
                out[:, :, s + q:length] = res[:, :, s:r]
                if tail is not None:
                    out[:, :, length:] = tail[i]
            with checks.own_state():
                ops.dequantize_pages(bt, ql, *self.pool.args(), **bits, max_len=q,
                                     out=(k[:, :, s:s + q], v[:, :, s:s + q]))
            return k, v
        with checks.own_state():
            qk, qv = ops.dequantize_pages(bt, ql, *self.pool.args(), **bits, max_len=max(self.q_lens))
        k = torch.zeros(b, h, length, d, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        for i in range(b):
            q, r, s = self.q_lens[i], self.r_lens[i], self.sinks[i]
            start = length - q - r  # timeline: [pads][sinks][quantized][newest]
            k[i, :, start:start + s] = self.res_k[i, :, :s]
            v[i, :, start:start + s] = self.res_v[i, :, :s]
            z = min(q, self.hidden[i] * self.cfg.page_size)  # released tokens stay zeros (a static ring reuses pages)
            k[i, :, start + s + z:start + s + q] = qk[i, :, z:q]
            v[i, :, start + s + z:start + s + q] = qv[i, :, z:q]
            k[i, :, start + s + q:length] = self.res_k[i, :, s:r]
            v[i, :, start + s + q:length] = self.res_v[i, :, s:r]
        if tail is not None:
            return torch.cat([k, tail[0]], dim=2), torch.cat([v, tail[1]], dim=2)
        return k, v

    # ------------------------------------------------- sizes, as transformers asks
    def get_seq_length(self) -> int:
        if self.unusable is not None:
            self.check_usable()
        return self.seen

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        return self.seen + query_len(query_length), 0

    def get_max_length(self) -> int:
        return -1

    # ------------------------------------------------------- batch operations
    # Each operation checks its arguments against the layer first (raising leaves the layer as it was), then
    # changes it through _apply (a failure part way marks the layer unusable). The cache runs the checks of every
    # layer before it changes any (QuantizedPagedCache.crop and the batch operations).
    def _flush_pending(self) -> None:
        if self.pending is not None:
            self.commit(self.pending)

    def _apply(self, what: str, change, *args) -> None:
        try:
            change(*args)
        except BaseException as exc:
            self.mark_unusable(what, exc)
            raise

    def check_usable(self) -> None:
        if self.unusable is not None:
            raise CacheUnusableError(f"kivi_cache: this cache is unusable: {self.unusable}; call reset() (or make a "
                                     f"new cache) before using it again")

    def mark_unusable(self, what: str, exc: BaseException) -> None:
        if self.unusable is None:
            self.unusable = f"{what} failed part way ({type(exc).__name__}: {exc})"

    def check_index(self, index, name: str) -> list[int]:
        """``index`` (a 1-d integer tensor or sequence of ints in ``[0, batch)``, or a bool mask of the batch size) as
        a list of ints; IndexError naming ``name`` for anything else."""
        return batch_index(index, self.batch_size, name)

    def _select(self, index: list[int]) -> None:
        """Sequence ``i`` becomes the current sequence ``index[i]`` (checked by :meth:`check_index`)."""
        new_tables = [list(self.tables[i]) for i in index]
        rows = torch.tensor(index, dtype=torch.long, device=self.device)
        res_k = self.res_k.index_select(0, rows)  # allocations first: nothing changed yet if they fail
        res_v = self.res_v.index_select(0, rows)
        for t in new_tables:
            self.pool.share(t)
        for t in self.tables:
            self.pool.release(t)
        self.tables = new_tables
        self.q_lens = [self.q_lens[i] for i in index]
        self.r_lens = [self.r_lens[i] for i in index]
        self.pads = [self.pads[i] for i in index]
        self.sinks = [self.sinks[i] for i in index]
        self.hidden = [self.hidden[i] for i in index]
        self.res_k, self.res_v = res_k, res_v
        self.batch_size = len(index)
        self._length_rows = None
        self._dev = None
        self.pool.decode_runner = None  # it holds the old window

    def select(self, index, name: str = "indices") -> None:
        """Check ``index`` (:meth:`check_index`), then :meth:`_select` it."""
        if not self.is_initialized:
            return
        self.check_usable()
        self._flush_pending()
        self._apply("selecting sequences", self._select, self.check_index(index, name))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select(beam_idx, "beam_idx")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.select(repeat_index(self.batch_size, repeats), "repeats")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select(indices, "indices")

    def check_crop(self, tokens_to_remove) -> int:
        """The tokens ``crop(tokens_to_remove)`` removes (0: none), or ValueError if it cannot (a pending step must
        be committed first: its tokens count)."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, numbers.Integral):
            raise ValueError(f"crop takes an int (-n: remove the n newest tokens; m > 0: keep the first m), got "
                             f"{tokens_to_remove!r}")
        if not self.is_initialized:
            return 0
        n = int(tokens_to_remove)
        remove = min(-n if n <= 0 else max(0, self.seen - n), self.seen)
        p, w = self.cfg.page_size, self.sliding_window
        for i in range(self.batch_size):
            kept = self.q_lens[i] + self.r_lens[i] - min(remove, self.q_lens[i] + self.r_lens[i])
            # the next query (stored index kept) sees indices > kept - w
            if remove and self.hidden[i] and self.hidden[i] * p > kept + 1 - w:
                raise ValueError(
                    f"crop({tokens_to_remove}) would bring tokens back into the sliding window ({w}) of a layer that "
                    f"released their pages (sequence {i}: {self.hidden[i] * p} released, {kept} would stay); "
                    f"crop by at most {self.q_lens[i] + self.r_lens[i] + 1 - self.hidden[i] * p - w} tokens here")
        return remove

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens: ``crop(-n)`` removes n; ``crop(m)`` with m > 0 keeps the first m (the older
        transformers' form); ``crop(0)`` removes nothing (transformers >= 5.24 calls it when assisted decoding
        accepted every candidate)."""
        self.check_usable()
        self._flush_pending()
        remove = self.check_crop(tokens_to_remove)
        if remove:
            self._apply("crop", self._crop, remove)

    def _crop(self, remove: int) -> None:
        """Remove the ``remove`` newest tokens (checked by :meth:`check_crop`)."""
        cfg = self.cfg
        g, p = cfg.group_size, cfg.page_size
        for i in range(self.batch_size):
            q, r, s = self.q_lens[i], self.r_lens[i], self.sinks[i]
            drop = min(remove, q + r)  # newest first: window tokens, then pages, then sinks
            if drop <= r - s:
                self.r_lens[i] = r - drop
                continue
            keep_q = q + (r - s) - drop  # tokens that stay in pages (negative: sinks go too)
            start = max(0, keep_q) // g * g  # a partial group goes back to the residual window
            if keep_q > start:
                bt, ql, _ = self._device_state()
                dk, dv = ops.dequantize_pages(bt[i:i + 1], ql[i:i + 1], *self.pool.args(), key_bits=cfg.key_bits,
                                              value_bits=cfg.value_bits, group_size=g, max_len=keep_q)
                self.res_k[i, :, s:s + keep_q - start] = dk[0, :, start:keep_q]
                self.res_v[i, :, s:s + keep_q - start] = dv[0, :, start:keep_q]
            if keep_q >= 0:
                self.r_lens[i] = s + keep_q - start
            else:
                self.sinks[i] = self.r_lens[i] = s + keep_q
            self.q_lens[i] = start
            n_pages = -(-start // p)
            self.pool.release(self.tables[i][n_pages:])
            del self.tables[i][n_pages:]
            self._dev = None
        self.pads = [max(0, x - max(0, remove - (self.seen - x))) for x in self.pads]
        self.seen -= remove
        self._dev = None

    def reset(self) -> None:
        if self.pool is not None:
            for t in self.tables:
                self.pool.release(t)
        self._clear_sequences()
        self.is_initialized = False
        self.unusable = None

    def offload(self):
        raise NotImplementedError("kivi_cache does not support cache offloading")

    def prefetch(self):
        raise NotImplementedError("kivi_cache does not support cache offloading")

    # ----------------------------------------------------------------- memory
    def _held_page_tokens(self) -> int:
        """Quantized tokens the pages hold: a page shared by several sequences (beams) counted once, by its
        fullest sequence."""
        p, held, zero = self.cfg.page_size, {}, self.pool.zero
        for table, q, h in zip(self.tables, self.q_lens, self.hidden, strict=True):
            for j, page in enumerate(table):
                if page != zero and j >= h:  # released entries (a static ring's) hold nothing
                    held[page] = max(held.get(page, 0), min(p, max(0, q - j * p)))
        return sum(held.values())

    def memory_stats(self) -> dict:
        if self.pool is None:
            return {}
        c, h, d = self.cfg, self.num_heads, self.head_dim
        per_page = self.pool.page_nbytes()
        # quantized tokens still held (a sliding-window layer's released ones are not: they count nowhere)
        live_q = sum(self.q_lens) - sum(self.hidden) * c.page_size
        frac = self._held_page_tokens() / c.page_size
        elem = torch.empty((), dtype=self.dtype).element_size()
        live_r = sum(self.r_lens)
        live_s = sum(self.sinks)
        residual_alloc = 0 if self.res_k is None else 2 * self.res_k.numel() * elem
        pages_used = self.pool.pages_in_use
        return {
            "quantized_tokens": live_q,
            "residual_tokens": live_r,
            "codes": int(per_page["codes"] * frac),
            "scales": int(per_page["scales"] * frac),
            "zeros": int(per_page["zeros"] * frac),
            "residual": 2 * live_r * h * d * elem,
            "sink_tokens": live_s,
            "sinks": 2 * live_s * h * d * elem,
            "residual_allocated": residual_alloc,
            "pool_allocated": self.pool.allocated_bytes(),
            "pages_total": self.pool.capacity,
            "pages_in_use": pages_used,
            "fp16_equivalent": 2 * (live_q + live_r) * h * d * 2,
        }


def _all_equal(xs: list) -> bool:
    """Every element equals the first (an empty list counts as equal). ``list.count`` runs in C: ~1 us for 892
    ints against ~20 us for ``min(xs) == max(xs)``, and the cache asks every layer and decode step."""
    return not xs or xs.count(xs[0]) == len(xs)


def query_len(query_length) -> int:
    """``get_mask_sizes``'s first argument as a token count (older transformers pass ``cache_position``)."""
    return query_length.shape[0] if isinstance(query_length, torch.Tensor) else query_length


# A one-token step's window write done by the decode op itself (its new_k/new_v), not by two copies: two launches
# fewer per layer in a host-bound eager step. (Tests and benchmarks set it False to compare the two.)
FUSE_WINDOW_WRITE = True
# The decode op planned once per block table and run every step (ops.DecodeRunner: direct launches of the first call's
# argument list); False: the op's ordinary call every step (for tests and benchmarks that compare the two).
DECODE_RUNNER = True
_LENGTH_ROWS: dict = {}  # (device, batch, window capacity) -> capacity + 1 views of [batch] int32, row r all r

_LAST_VALID: list = [None, None, None]  # (weakref to the mask, key, result) of the last call


def _valid_tokens(mask, n: int, batch: int):
    """From the model's 4-D mask, the new tokens that are real (``[B, n]``; None if all are, or no mask).
    Reduces the mask's last ``n x n`` block without materializing it (at a 32k prompt an ``n x n`` bool is 1 GiB).
    Deciding "all real" reads a flag back from the device (a sync); transformers hands every layer of a forward
    the same mask tensor, so the answer is kept for that tensor (while it is alive and unmodified): one sync per
    forward instead of one per layer (32 per decode step of a padded batch on a GPU)."""
    if mask is None:
        return None
    try:
        key = (id(mask), mask._version, mask.data_ptr(), tuple(mask.shape), n, batch)
    except RuntimeError:  # an inference-mode tensor has no version counter: no memo (a sync per layer)
        key = None
    ref, last_key, last = _LAST_VALID
    if key is not None and last_key == key and ref is not None and ref() is mask:
        return last
    cols = mask[:, 0, -n:, -n:]
    if mask.dtype == torch.bool:
        valid = cols.any(dim=1)
    else:
        valid = cols.amax(dim=1) > torch.finfo(mask.dtype).min / 2
    valid = valid.expand(batch, n)
    valid = None if bool(valid.all()) else valid
    try:
        _LAST_VALID[:] = [weakref.ref(mask), key, valid] if key is not None else [None, None, None]
    except TypeError:  # a tensor subclass without weak references: no memo
        _LAST_VALID[:] = [None, None, None]
    return valid


def _chunk_visibility(mask, n: int, batch: int, device, window: int | None = None):
    """The chunk-internal visibility ``[B, n, n]`` (True = may attend): causal (within ``window`` positions) without
    a mask. Only a chunk of several tokens on a filled cache needs it (``paged_prefix_attention``)."""
    if mask is None:
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        if window is not None:
            causal = causal.triu(1 - window)
        return causal.expand(batch, n, n)
    m = mask[:, 0, -n:, -n:]
    m = m if mask.dtype == torch.bool else m > torch.finfo(mask.dtype).min / 2
    return m.expand(batch, n, n)


def batch_index(index, batch: int, name: str) -> list[int]:
    """A batch operation's ``index`` as a list of ints in ``[0, batch)``: a 1-d integer tensor, a sequence of ints, or
    a bool mask of exactly ``batch`` entries (DynamicCache's index forms). IndexError naming ``name`` otherwise."""
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise IndexError(f"{name} must be a 1-d tensor (indices into the batch of {batch}, or a bool mask of "
                             f"{batch}), got shape {list(index.shape)}")
        if index.dtype == torch.bool:
            if index.shape[0] != batch:
                raise IndexError(f"{name} as a bool mask must have one entry per sequence ({batch}), got "
                                 f"{index.shape[0]}")
            index = index.nonzero().squeeze(-1)
        elif index.is_floating_point() or index.is_complex():
            raise IndexError(f"{name} must hold integer indices (or be a bool mask), got dtype {index.dtype}")
        index = index.tolist()
    elif not isinstance(index, (list, tuple, range)):
        raise IndexError(f"{name} must be a 1-d integer tensor, a sequence of ints or a bool mask, got "
                         f"{type(index).__name__}")
    bad = [i for i in index if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
    if bad:
        raise IndexError(f"{name} must hold ints, got {bad[0]!r}")
    index = [int(i) for i in index]
    if any(i < 0 or i >= batch for i in index):
        raise IndexError(f"{name} must hold indices in [0, {batch}) (the batch size), got {index}")
    return index


def repeat_index(batch: int, repeats) -> list[int]:
    """``batch_repeat_interleave(repeats)``'s selection: every sequence ``repeats`` times in a row."""
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    return [i for i in range(batch) for _ in range(int(repeats))]


def step_tensors(step: PendingStep) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's keys and values as the cache stores them: without autograd history (a forward run with grad
    enabled still attends through ``step.key``/``step.value``; the cache keeps data, not graphs)."""
    k, v = step.key, step.value
    if k.requires_grad or v.requires_grad:
        return k.detach(), v.detach()
    return k, v

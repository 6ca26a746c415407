"""How a step's tokens reach the residual window and the pages.

:class:`Store` is a part of :class:`~kivi_cache.layer.QuantizedPagedLayer`: a one-token step goes into the
window (``_append_one``), a chunk through the window (``_append_chunk``); whole key groups leaving the window
(the rule: :func:`kivi_cache.window.window_append`) are quantized into pages reserved from the layer's pool
(``_flush_residual``, ``_write_groups``, ``_write_batch``: one ``quantize_and_write`` launch each); a sliding-window
layer releases the pages no later query can see (``_release_hidden_pages``).
"""

from __future__ import annotations

import numpy as np
import torch

from . import checks, ops
from .mirror import all_equal
from .window import window_append


class Store:
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
                self.paged_lens[i] += skip
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
        # a decode step of an unpadded batch: one answer for all (most flushes release nothing)
        if (first is None and self.hidden and all_equal(self.hidden) and all_equal(self.paged_lens)
                and all_equal(self.window_lens)):
            q = self.paged_lens[0]
            if max(0, min(q, q + self.window_lens[0] - w)) // p <= self.hidden[0]:
                return
        changed = False
        for i in range(self.batch_size):
            q = self.paged_lens[i]
            t = q + self.window_lens[i] - 1 if first is None else first[i]
            changed |= self._hide(i, max(0, min(q, t + 1 - w)) // p)
        if changed:
            self._device_tables = None

    def _append_one(self, k, v, defer_write: bool = False) -> bool:
        r, rule, b = self.window_lens, self._rule(), self.batch_size
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
            self._window_write(k, v, uniform or all_equal(r))
        self.window_lens, self.sinks = new_r, new_s
        if self._device_tables is not None:
            if all_equal(new_r):
                self._device_tables = (*self._device_tables[:2], self._uniform_lengths(new_r[0]))
            else:  # lengths that differ stayed different: an uploaded tensor of this layer, not a shared row
                self._device_tables[2].add_(1)
        if full:
            self._flush_residual(full)
            if self.sliding_window is not None:
                self._release_hidden_pages()
        return deferred

    def _window_write(self, k, v, equal: bool) -> None:
        """Write a one-token step into every window at its current length (``equal``: one length for all)."""
        if equal:  # narrow + copy_: half the host time of an indexed assignment
            r = self.window_lens[0]
            self.res_k.narrow(2, r, 1).copy_(k)
            self.res_v.narrow(2, r, 1).copy_(v)
        else:
            rows = torch.arange(self.batch_size, device=self.device)
            idx = self._device_state()[2].long()
            self.res_k[rows, :, idx] = k[:, :, 0]
            self.res_v[rows, :, idx] = v[:, :, 0]

    def _uniform(self) -> bool:
        """Every sequence has the same window and sink lengths (no padding so far): bulk tensor ops apply."""
        return all_equal(self.window_lens) and all_equal(self.sinks)

    def _rule(self) -> dict:
        """The window rule's settings (:func:`kivi_cache.window.window_append`) for this layer."""
        cfg = self.cfg
        return dict(sink_length=cfg.sink_length, residual_length=cfg.residual_length, group_size=cfg.group_size)

    def _flush_count(self, total: int, sinks: int) -> int:
        """Tokens to quantize out of a window of ``total`` tokens (``sinks`` of them sinks): whole groups beyond R."""
        return window_append(total, sinks, 0, **self._rule())[1]

    def _flush_residual(self, seqs) -> None:
        if len(seqs) == self.batch_size and self._uniform():  # every window at once
            s, r = self.sinks[0], self.window_lens[0]
            c = self._flush_count(r, s)
            old, old_width = self._device_tables, self._bt_width
            # quantized before the shift; a flush into the pages of the cached table's last column reads their ids
            # from it (no upload)
            last = old[0][:, old_width - 1] if old is not None and old_width == len(self.tables[0]) else None
            done = self._write_batch(self.res_k[:, :, s:s + c], self.res_v[:, :, s:s + c], last)
            self._window_drop(slice(None), s, r, c)
            self.window_lens = [r - c] * self.batch_size
            width = len(self.tables[0])
            if old is not None and done is not None and (done[1], old_width) in (("same", width),
                                                                                  ("append", width - 1)):
                # a decode step's flush: the device state follows without uploading it again: the paged lengths
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
                self._device_tables = (bt, old[1].add_(c), self._uniform_lengths(r - c))
                self._bt_width = width
                return
        else:
            items = []
            for i in seqs:
                s = self.sinks[i]
                c = self._flush_count(self.window_lens[i], s)
                items.append((i, self.res_k[i, :, s:s + c], self.res_v[i, :, s:s + c]))
            self._write_groups(items)  # copies the groups out before the shift below
            for i, kc, _ in items:
                self._window_drop(i, self.sinks[i], self.window_lens[i], kc.shape[1])
                self.window_lens[i] -= kc.shape[1]
        self._device_tables = None

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
            s, r, groups = self._window_append(slice(None), self.window_lens[0], self.sinks[0], k, v)
            if groups is not None:
                groups = self._skip_hidden(range(self.batch_size), self.paged_lens[0], r, groups)
            if groups is not None:
                self._write_batch(*groups)
            self.sinks = [s] * self.batch_size
            self.window_lens = [r] * self.batch_size
            self._device_tables = None
            return
        items = []
        for i in range(self.batch_size):
            if valid is None:
                nk, nv = k[i], v[i]
            else:
                keep = valid[i].nonzero().squeeze(-1)
                nk, nv = k[i].index_select(1, keep), v[i].index_select(1, keep)
            self.pads[i] += n_new - nk.shape[1]
            self.sinks[i], self.window_lens[i], groups = self._window_append(i, self.window_lens[i], self.sinks[i], nk,
                                                                             nv)
            if groups is not None:
                groups = self._skip_hidden((i,), self.paged_lens[i], self.window_lens[i], groups)
            if groups is not None:
                items.append((i, *groups))
        self._write_groups(items)
        self._device_tables = None

    def _reserve_pages(self, counts) -> None:
        """Grow the pool once for a step: ``counts`` = (sequence, tokens to quantize) pairs."""
        p = self.cfg.page_size
        self.pool.reserve(sum(max(0, -(-(self.paged_lens[i] + c) // p) - len(self.tables[i])) for i, c in counts))

    def _reserve(self, i: int, c: int, pages: list, slots: list) -> None:
        """Page and slot of each of sequence ``i``'s next ``c // G`` groups (pages allocated as needed)."""
        g, p, pool = self.cfg.group_size, self.cfg.page_size, self.pool
        table = self.tables[i]
        for t in range(self.paged_lens[i], self.paged_lens[i] + c, g):
            j, slot = divmod(t, p)
            if j == len(table):
                table.append(pool.allocate())
            elif t == self.paged_lens[i]:  # first write into a partly filled page
                table[j] = pool.copy_on_write(table[j])
            pages.append(table[j])
            slots.append(slot)
        self.paged_lens[i] += c

    def _reserve_one_group_each(self):
        """:meth:`_reserve` of one group for every sequence when all hold the same number of quantized tokens (the
        flush of a uniform batch: every decode step's flush): one page index and slot for all, new pages taken from
        the pool in one slice; the same page ids as the per-sequence loop, without its per-sequence Python (which
        costs milliseconds per layer and flush at hundreds of sequences). Returns (pages, the slot, how the tables
        changed: "append" (a page each), "same" or "cow" (a shared page replaced by a private copy)); None (nothing
        done) where the tables differ in width."""
        p, pool, tables = self.cfg.page_size, self.pool, self.tables
        q0, b = self.paged_lens[0], self.batch_size
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
        self.paged_lens = [q0 + self.cfg.group_size] * b
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
            ops.quantize_and_write(k_groups, v_groups, pages_dev, slots_dev, self.pool.args(), key_bits=cfg.key_bits,
                                   value_bits=cfg.value_bits, group_size=cfg.group_size, **cfg.clip_args)
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
        self._device_tables = None

    def _write_batch(self, kc, vc, last_column=None):
        """Every sequence's next ``c`` tokens (keys/values ``[B, H, c, D]``, c multiple of G), one launch. Drops the
        cached device state; for a decode flush (one group each, same page index) returns the pages on the device
        and how the tables changed (see :meth:`_reserve_one_group_each`) so the caller may rebuild it in place.
        ``last_column``: the cached block table's last page column on the device (the pages of a flush that writes
        into each sequence's last page, no copy-on-write)."""
        b, h, c, d = kc.shape
        g = self.cfg.group_size
        self._device_tables = None
        fast = c == g and all_equal(self.paged_lens)  # a decode flush: one group each, same page index
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

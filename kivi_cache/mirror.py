"""The device mirror of a layer's block tables and lengths: what the paged ops read on the device.

:class:`DeviceMirror` is a part of :class:`~kivi_cache.layer.QuantizedPagedLayer` (it reads the layer's host
bookkeeping: ``tables``, ``paged_lens``, ``window_lens``): ``_device_state()`` gives ``(block_table [B, W] int32,
paged_lens [B] int32, window_lens [B] int32)`` on the cache's device, uploaded once and kept (``_device_tables``)
until the host state changes; the store (:mod:`kivi_cache.store`) updates it in place where a decode step's flush
allows.
"""

from __future__ import annotations

import numpy as np
import torch

_LENGTH_ROWS: dict = {}  # (device, batch, window capacity) -> capacity + 1 views of [batch] int32, row r all r


def all_equal(xs: list) -> bool:
    """Every element equals the first (an empty list counts as equal). ``list.count`` runs in C, an order of
    magnitude faster than ``min(xs) == max(xs)`` on long lists, and the cache asks every layer and decode step."""
    return not xs or xs.count(xs[0]) == len(xs)


class DeviceMirror:
    # the device block table gets spare columns (-1) up to a power of two: a decode step's flush that starts a page
    # column writes it in place, so the table stays the same tensor and the layer's decode runner stays valid (a new
    # table would mean a new runner: an ordinary op call and a plan per layer every other flush)
    SPARE_COLUMNS = True

    def _device_state(self):
        if self._device_tables is None:
            width = max(1, max(map(len, self.tables), default=1))
            cols = self._table_columns(width)
            # through numpy: torch.tensor on nested lists is several times slower for large batches
            bt = np.array([t if len(t) == cols else t + [-1] * (cols - len(t)) for t in self.tables], dtype=np.int32)
            r = self.window_lens
            self._bt_width = width
            self._device_tables = (
                self._upload(bt.reshape(len(self.tables), cols)),
                self._upload(np.array(self.paged_lens, dtype=np.int32)),
                self._uniform_lengths(r[0]) if all_equal(r) else self._upload(np.array(r, dtype=np.int32)),
            )
        return self._device_tables

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

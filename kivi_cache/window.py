"""The residual window's one rule: when tokens leave it for the pages, and how the lengths advance.

A sequence's window holds, in order, its ``s`` sink tokens (its first ``sink_length`` tokens, kept for good) and its
newest tokens; ``r`` counts both. Appending ``n`` tokens:

* the sinks take the first of them while fewer than ``sink_length`` are there: ``s' = min(sink_length, s + n)``;
* the window then flushes the oldest whole key groups beyond the sinks and the newest ``residual_length`` tokens:
  ``c = max(0, r + n - s' - residual_length) // group_size * group_size`` tokens, quantized into the pages;
* ``r' = r + n - c`` stay, and the quantized length grows by ``c``.

So a sequence longer than its sinks plus ``residual_length`` keeps between ``residual_length`` and
``residual_length + group_size - 1`` newest tokens in full precision. One function computes this for every path: the
eager layer (Python ints, one sequence or a whole batch), the static layer's compiled step and the torch reference of
``append_and_flush`` (integer tensors, one entry per sequence); the Triton kernel of ``append_and_flush`` computes
the same on the device and is tested against the reference.
"""

from __future__ import annotations

import torch


def window_append(r, s, n, *, sink_length: int, residual_length: int, group_size: int):
    """``(s', c)``: the sink count after appending ``n`` tokens to a window of ``r`` tokens holding ``s`` sinks, and
    how many tokens it flushes (a multiple of ``group_size``; the window keeps ``r + n - c``). ``r``, ``s``, ``n``:
    ints, or integer tensors of one shape (then ``s'`` and ``c`` are tensors)."""
    total = r + n
    if isinstance(total, torch.Tensor):
        sinks = (s + n).clamp(max=sink_length)
        return sinks, (total - sinks - residual_length).clamp(min=0) // group_size * group_size
    sinks = min(sink_length, s + n)
    return sinks, max(0, total - sinks - residual_length) // group_size * group_size


def capacity(sink_length: int, residual_length: int, group_size: int) -> int:
    """Slots a window needs: the sinks, and the newest tokens up to the moment a group leaves
    (``residual_length + group_size``)."""
    return sink_length + residual_length + group_size

"""The arguments of the batch operations (reorder_cache, batch_select_indices, batch_repeat_interleave, crop), checked
as DynamicCache's forms and turned into plain ints before any layer changes."""

from __future__ import annotations

import numbers
import operator

import torch


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


def as_int(x) -> int | None:
    """``x`` as an int where it is one exactly (an int, a numpy integer, a 0-d integer tensor: transformers 5.17
    passes crop one), else None (bools too)."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def repeat_index(batch: int, repeats) -> list[int]:
    """``batch_repeat_interleave(repeats)``'s selection: every sequence ``repeats`` times in a row."""
    n = as_int(repeats)
    if n is None or n < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    return [i for i in range(batch) for _ in range(n)]

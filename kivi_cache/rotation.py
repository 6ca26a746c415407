"""Orthogonal rotation of keys and values before quantization (``QuantConfig.rotate``).

An orthogonal ``H`` with ``H = H^T`` and ``H H = I`` leaves attention unchanged when it is applied on both sides:
keys stored as ``k H`` meet queries ``q H`` (``q H (k H)^T = q k^T``); values stored as ``v H`` give the output ``o H``,
turned back by one more ``H``. Quantization sees the rotated vectors, in which an outlier channel's energy is spread
over all channels of its block. ``H`` is the normalized Sylvester-Hadamard matrix of head_dim, or, for a head_dim that
is not a power of two, block-diagonal with Hadamard blocks of the largest power of two dividing head_dim (which
spreads outliers within each block only; blocks below 8 channels are refused).
"""

from __future__ import annotations

import functools

import torch

ROTATE = ("none", "keys", "values", "both")
MIN_BLOCK = 8


def block_size(head_dim: int) -> int:
    """The Hadamard block of ``head_dim``: its largest power-of-two divisor."""
    return head_dim & -head_dim


def check_head_dim(head_dim: int) -> None:
    if block_size(head_dim) < MIN_BLOCK:
        raise ValueError(f"rotate needs a head_dim divisible by {MIN_BLOCK} (Hadamard blocks of at least {MIN_BLOCK} "
                         f"channels), got head_dim={head_dim}")


@functools.lru_cache(maxsize=16)
def _hadamard(head_dim: int) -> torch.Tensor:
    p = block_size(head_dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < p:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / p ** 0.5
    return torch.block_diag(*([h] * (head_dim // p)))


def hadamard(head_dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[head_dim, head_dim]``: symmetric, orthogonal (module docstring)."""
    check_head_dim(head_dim)
    return _hadamard(head_dim).to(device=device, dtype=dtype)


def matrices(rotate: str, head_dim: int, dtype: torch.dtype, device) -> tuple:
    """``(rot_k, rot_v)`` for ``QuantConfig.rotate``: :func:`hadamard` where keys / values are rotated, else None
    (stored keys are ``k @ rot_k``, stored values ``v @ rot_v``)."""
    h = None if rotate == "none" else hadamard(head_dim, dtype, device)
    return (h if rotate in ("keys", "both") else None), (h if rotate in ("values", "both") else None)

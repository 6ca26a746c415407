"""Small shared helpers for the kivi_cache Triton kernels (no Triton code)."""

from __future__ import annotations

import os

import torch

ALLOWED_HEAD_DIMS = (64, 128, 256)
ALLOWED_BITS = (2, 4, 8)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_head_dim(d: int) -> None:
    if d not in ALLOWED_HEAD_DIMS:
        raise ValueError(f"head_dim={d} is not supported by the Triton kernels; allowed values: {ALLOWED_HEAD_DIMS}")


def check_bits(key_bits: int, value_bits: int) -> None:
    for name, b in (("key_bits", key_bits), ("value_bits", value_bits)):
        if b not in ALLOWED_BITS:
            raise ValueError(f"{name}={b} is not supported; allowed values: {ALLOWED_BITS}")


def check_group(d: int, group_size: int, page_size: int | None = None) -> None:
    g = group_size
    if g < 1 or g & (g - 1) or d % g:
        raise ValueError(f"group_size={g} must be a power of two dividing head_dim={d}")
    if page_size is not None and page_size % g:
        raise ValueError(f"page_size={page_size} must be a multiple of group_size={g}")


def pow2_divisor(n: int) -> int:
    """Largest power of two dividing n (n > 0)."""
    return n & -n


def block_tokens(page_size: int, group_size: int, cap: int) -> int:
    """Tokens per kernel iteration: a power of two that divides the page and is a multiple of G.

    On a GPU, tiles of fewer than 32 tokens gave wrong results (seen on an H200 with
    Triton 3.6 for page sizes 16 and 48), so there the largest power of two dividing
    the page size must be >= 32 (page sizes 32, 64, 96, 128, ...); else ValueError.
    """
    blk = max(min(pow2_divisor(page_size), cap), group_size)
    if blk < 32 and not interpreting():
        raise ValueError(
            f"page_size={page_size} with group_size={group_size} needs {blk}-token tiles; the GPU kernels "
            f"need page_size divisible by 32 (e.g. 64)"
        )
    return blk


_SM_COUNT: dict = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]

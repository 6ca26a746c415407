"""kernels/dequant.py: dequantize_pages against the torch reference (the codes and scales of kernel_cases.make_pool),
empty batches and max_len past the block table included."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import BITS, DEV, make_block_table, make_pool

from kivi_cache import reference as R
from kivi_cache.kernels import api as K


@pytest.mark.parametrize("kb,vb", BITS)
def test_dequantize_pages(kb, vb):
    g, p, d, h = 32, 64, 64, 2
    lengths = torch.tensor([96, 0, 150], device=DEV)  # not page (nor group) multiples, and an empty sequence
    bt, np_ = make_block_table(lengths.tolist(), p, width=4)
    pool = make_pool(np_, h, p, d, g, kb, vb, torch.float16)
    for max_len in (None, 200):
        ref = R.dequantize_pages(bt, lengths, *pool, kb, vb, g, max_len=max_len)
        t = ref[0].shape[2]
        out = (torch.full((3, h, t, d), float("nan"), device=DEV, dtype=torch.float16),
               torch.full((3, h, t, d), float("nan"), device=DEV, dtype=torch.float16))
        got = K.dequantize_pages(bt, lengths, *pool, kb, vb, g, max_len=max_len, out=out)
        for a, b_ in zip(got, ref, strict=True):
            assert torch.isfinite(a).all()
            assert a.dtype == b_.dtype and a.shape == b_.shape
            torch.testing.assert_close(a.float(), b_.float(), rtol=1e-3, atol=1e-3)


def test_dequantize_pages_empty_batch_and_max_len_past_the_table():
    """An empty batch, and max_len past what the block table covers (zeros there): the reference as the kernels
    (neither takes ``lengths.max()`` of no sequences or reshapes past the table), the attention ops through it too;
    a negative max_len is a ValueError in both."""
    g, p, d, h = 32, 64, 64, 1
    lengths = torch.tensor([96, 32], dtype=torch.int32, device=DEV)
    bt, np_ = make_block_table(lengths.tolist(), p, width=2)
    pool = make_pool(np_, h, p, d, g, 4, 4, torch.float16)
    for impl in (K, R):
        k, v = impl.dequantize_pages(bt, lengths, *pool, 4, 4, g, max_len=300)  # the table covers 128 tokens
        assert k.shape == v.shape == (2, h, 300, d), impl.__name__
        assert not k[:, :, 96:].any() and not v[:, :, 96:].any() and not k[1, :, 32:].any()
        torch.testing.assert_close(k[:, :, :96], R.dequantize_pages(bt, lengths, *pool, 4, 4, g)[0])
        k, v = impl.dequantize_pages(bt[:0], lengths[:0], *pool, 4, 4, g)
        assert k.shape == v.shape == (0, h, 0, d), impl.__name__
        with pytest.raises(ValueError, match="max_len must be None or an int >= 0"):
            impl.dequantize_pages(bt, lengths, *pool, 4, 4, g, max_len=-1)
    q = torch.randn(0, 2, d, device=DEV, dtype=torch.float16)
    win = torch.randn(0, h, 4, d, device=DEV, dtype=torch.float16)
    out = R.paged_decode_attention(q, bt[:0], lengths[:0], *pool, win, win, lengths[:0], 4, 4, g, 0.125)
    assert out.shape == (0, 2, d)


def test_dequantize_pages_fp32_scales():
    g, p, d, h = 32, 32, 64, 1
    lengths = torch.tensor([64, 32], device=DEV)
    bt, np_ = make_block_table(lengths.tolist(), p)
    pool = make_pool(np_, h, p, d, g, 4, 2, torch.float32)
    got = K.dequantize_pages(bt, lengths, *pool, 4, 2, g)
    ref = R.dequantize_pages(bt, lengths, *pool, 4, 2, g)
    for a, b_ in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-6, atol=1e-6)

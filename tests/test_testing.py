"""kivi_cache.testing: random pools the ops read as any pool."""

import torch

from kivi_cache import ops, reference, torch_ops
from kivi_cache.kernels.checks import PoolTensors
from kivi_cache.testing import decode_args, pool_of, random_pool


def test_random_pool_shapes_pages_and_lengths():
    gen = torch.Generator().manual_seed(3)
    pool = random_pool(3, 2, 150, 64, 64, 32, 4, 2, generator=gen, dtype=torch.float32)
    t = pool_of(pool)
    assert isinstance(t, PoolTensors)
    assert [tuple(x.shape) for x in t] == [(9, 2, 64, 32), (9, 2, 2, 64), (9, 2, 2, 64), (9, 2, 64, 16),
                                           (9, 2, 2, 64), (9, 2, 2, 64)]
    assert t.k_scale.dtype == torch.float32 and t.k_codes.dtype == torch.uint8
    assert pool["block_table"].shape == (3, 3) and pool["block_table"].dtype == torch.int32
    assert sorted(pool["block_table"].flatten().tolist()) == list(range(9))  # distinct pages
    assert pool["lengths"].tolist() == [150] * 3
    assert (t.k_scale > 0).all() and (t.k_scale <= 2 / 16).all() and (t.v_scale <= 2 / 4).all()
    again = random_pool(3, 2, 150, 64, 64, 32, 4, 2, generator=torch.Generator().manual_seed(3),
                        dtype=torch.float32)
    assert all(torch.equal(pool[k], again[k]) for k in pool)  # the generator decides everything


def test_decode_args_run_the_reference_and_the_ops():
    gen = torch.Generator().manual_seed(5)
    pool = random_pool(2, 2, 96, 64, 32, 32, 4, 4, generator=gen, dtype=torch.float32)
    q = torch.randn(2, 4, 64, generator=gen)
    rk, rv = torch.randn(2, 2, 64, 64, generator=gen), torch.randn(2, 2, 64, 64, generator=gen)
    rl = torch.tensor([5, 40], dtype=torch.int32)
    args = decode_args(pool, q, rk, rv, rl, 4, 4, 32, 0.125)
    ref = reference.paged_decode_attention(*args)
    assert ref.shape == q.shape and torch.isfinite(ref).all()
    torch.testing.assert_close(torch_ops.paged_decode_attention(*args), ref, rtol=1e-4, atol=1e-4)
    out = ops.paged_decode_attention(q, pool["block_table"], pool["lengths"], pool_of(pool), res_k=rk, res_v=rv,
                                     res_lengths=rl, key_bits=4, value_bits=4, group_size=32, sm_scale=0.125)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)

"""Random page pools for tests and benchmarks of the op API (as ``torch.testing`` is for torch).

:func:`random_pool` fills a pool with random codes, scales and zero points (not the quantization of any data: the
ops read it as they read any pool) and gives each sequence distinct pages in random order; :func:`decode_args` lays
it out as the positional arguments of the kernels' and the reference's ``paged_decode_attention``.
"""

from __future__ import annotations

import torch

from .kernels.checks import PoolTensors


def random_pool(batch: int, kv_heads: int, tokens: int, head_dim: int, page_size: int, group_size: int,
                key_bits: int, value_bits: int, device=None, generator: torch.Generator | None = None,
                dtype: torch.dtype = torch.float16) -> dict:
    """A pool holding ``batch`` sequences of ``tokens`` quantized tokens each, on scattered pages. Returns a dict of
    the six pool tensors (:class:`~kivi_cache.kernels.checks.PoolTensors`' names), ``block_table`` (``[batch,
    ceil(tokens / page_size)]`` int32, distinct pages in random order) and ``lengths`` (``[batch]`` int32, all
    ``tokens``). Scales and zero points are in ``dtype`` (the queries' dtype); scales are at most ``2 / 2**bits`` and
    zero points about ``-1``, so dequantized values are of order 1."""
    pages_per_seq = -(-tokens // page_size)
    n = max(1, batch * pages_per_seq)
    d, p, g = head_dim, page_size, group_size
    kw = dict(device=device, generator=generator)
    kc = torch.randint(0, 256, (n, kv_heads, p, d * key_bits // 8), dtype=torch.uint8, **kw)
    vc = torch.randint(0, 256, (n, kv_heads, d, p * value_bits // 8), dtype=torch.uint8, **kw)
    ks = torch.rand(n, kv_heads, p // g, d, dtype=dtype, **kw) * (2.0 / (1 << key_bits))
    kz = torch.randn(n, kv_heads, p // g, d, dtype=dtype, **kw) - 1.0
    vs = torch.rand(n, kv_heads, d // g, p, dtype=dtype, **kw) * (2.0 / (1 << value_bits))
    vz = torch.randn(n, kv_heads, d // g, p, dtype=dtype, **kw) - 1.0
    perm = torch.randperm(n, **kw).to(torch.int32)
    bt = perm[:batch * pages_per_seq].reshape(batch, pages_per_seq)
    lengths = torch.full((batch,), tokens, dtype=torch.int32, device=device)
    return dict(k_codes=kc, k_scale=ks, k_zero=kz, v_codes=vc, v_scale=vs, v_zero=vz, block_table=bt, lengths=lengths)


def pool_of(pool: dict) -> PoolTensors:
    """The six tensors of a :func:`random_pool` as the ops take them."""
    return PoolTensors(*(pool[name] for name in PoolTensors._fields))


def decode_args(pool: dict, q, res_k, res_v, res_lengths, key_bits: int, value_bits: int, group_size: int,
                sm_scale: float) -> tuple:
    """The positional arguments of the kernels' / the reference's ``paged_decode_attention`` over ``pool``."""
    return (q, pool["block_table"], pool["lengths"], *pool_of(pool), res_k, res_v, res_lengths, key_bits, value_bits,
            group_size, sm_scale)

"""The op API without transformers: what a serving engine calls.

A pool of pages shared by sequences of different lengths, a block table per sequence,
``quantize_and_write`` to store key/value groups, ``paged_decode_attention`` for one new
query token per sequence, and ``DecodeRunner`` (that op planned once for many steps). Runs on CPU
(torch reference) and on a GPU (Triton kernels):

    python examples/op_api.py [--bits 4] [--device cuda]

It prints the attention error against full-precision attention on the same keys and values
(random Gaussian data: a hard case for quantization, real keys and values do better) and the
bytes the pool and the window hold against an fp16 cache.
"""

from __future__ import annotations

import argparse
import math

import torch

from kivi_cache import ops


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", default="96,320,1000", help="tokens per sequence (any lengths)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.float16
    hq, hkv, d, g, p = 8, 2, 64, 32, 64  # query heads, KV heads, head_dim, group, page size
    kb = vb = args.bits
    lengths = [int(x) for x in args.lengths.split(",")]
    bsz = len(lengths)
    torch.manual_seed(0)

    # 1. the pool: NP pages, layout documented in kivi_cache.reference
    quant = [n // g * g for n in lengths]  # whole groups go to pages, the rest stays full precision
    pages_per_seq = [-(-q // p) for q in quant]
    n_pages = sum(pages_per_seq)
    pool = [
        torch.zeros(n_pages, hkv, p, d * kb // 8, dtype=torch.uint8, device=dev),  # k_codes
        torch.zeros(n_pages, hkv, p // g, d, dtype=dtype, device=dev),  # k_scale
        torch.zeros(n_pages, hkv, p // g, d, dtype=dtype, device=dev),  # k_zero
        torch.zeros(n_pages, hkv, d, p * vb // 8, dtype=torch.uint8, device=dev),  # v_codes: channel rows
        torch.zeros(n_pages, hkv, d // g, p, dtype=dtype, device=dev),  # v_scale (token-contiguous)
        torch.zeros(n_pages, hkv, d // g, p, dtype=dtype, device=dev),  # v_zero
    ]
    # 2. block tables: pages handed out in any order (here shuffled), -1 where unused
    order = torch.randperm(n_pages).tolist()
    width = max(pages_per_seq)
    block_table = torch.full((bsz, width), -1, dtype=torch.int32)
    for b, n in enumerate(pages_per_seq):
        block_table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    block_table = block_table.to(dev)

    # 3. some keys and values, and their storage: groups of G tokens through quantize_and_write
    keys = [torch.randn(hkv, n, d, device=dev, dtype=dtype) for n in lengths]
    values = [torch.randn(hkv, n, d, device=dev, dtype=dtype) for n in lengths]
    groups_k, groups_v, pages, slots = [], [], [], []
    for b, q in enumerate(quant):
        for t in range(0, q, g):
            groups_k.append(keys[b][:, t:t + g])
            groups_v.append(values[b][:, t:t + g])
            pages.append(int(block_table[b, t // p]))
            slots.append(t % p)
    ops.quantize_and_write(torch.stack(groups_k), torch.stack(groups_v),
                           torch.tensor(pages, dtype=torch.int32, device=dev),
                           torch.tensor(slots, dtype=torch.int32, device=dev), pool,
                           key_bits=kb, value_bits=vb, group_size=g)
    # the unquantized tail of each sequence: a full-precision window [B, Hkv, C, D]
    c = max(1, max(n - q for n, q in zip(lengths, quant, strict=True)))
    res_k = torch.zeros(bsz, hkv, c, d, device=dev, dtype=dtype)
    res_v = torch.zeros_like(res_k)
    for b, (n, q) in enumerate(zip(lengths, quant, strict=True)):
        res_k[b, :, :n - q] = keys[b][:, q:]
        res_v[b, :, :n - q] = values[b][:, q:]
    res_lengths = torch.tensor([n - q for n, q in zip(lengths, quant, strict=True)], dtype=torch.int32, device=dev)

    # 4. one decode step: a query token per sequence attends to its pages and its window
    q_tok = torch.randn(bsz, hq, d, device=dev, dtype=dtype)
    scale = 1 / math.sqrt(d)
    quant_lengths = torch.tensor(quant, dtype=torch.int32, device=dev)
    out = ops.paged_decode_attention(q_tok, block_table, quant_lengths, pool, res_k=res_k, res_v=res_v,
                                     res_lengths=res_lengths, key_bits=kb, value_bits=vb, group_size=g, sm_scale=scale)

    # 5. a serving loop plans once and runs every step (same pages; new queries and window lengths each step)
    run = ops.DecodeRunner(block_table, quant_lengths, pool, res_k=res_k, res_v=res_v, key_bits=kb, value_bits=vb,
                           group_size=g)
    same = all(torch.equal(run(q_tok, res_lengths, scale), out) for _ in range(3))

    # full-precision attention on the same keys and values, for comparison
    errs = []
    for b in range(bsz):
        k = keys[b].float().repeat_interleave(hq // hkv, 0)
        v = values[b].float().repeat_interleave(hq // hkv, 0)
        w = torch.softmax(torch.einsum("hd,htd->ht", q_tok[b].float(), k) * scale, -1)
        ref = torch.einsum("ht,htd->hd", w, v)
        errs.append(((out[b].float() - ref).norm() / ref.norm()).item())
    stored = sum(t.numel() * t.element_size() for t in pool) + 2 * res_k.numel() * res_k.element_size()
    fp16 = sum(2 * hkv * n * d * 2 for n in lengths)
    print(f"backend: {'triton' if dev.type == 'cuda' else 'torch reference'} on {dev}, int{kb}, lengths {lengths}")
    print("relative error vs full-precision attention per sequence: " + ", ".join(f"{e:.3f}" for e in errs))
    print(f"bytes held: {stored} (pool + window) vs {fp16} for an fp16 cache ({fp16 / stored:.2f}x less)")
    print(f"ops.DecodeRunner (planned once, run 3 times): same output as the op: {same}")
    return errs


if __name__ == "__main__":
    main()

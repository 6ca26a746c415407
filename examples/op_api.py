"""The op API without transformers: what a serving engine calls.

A pool of pages shared by sequences of different lengths, a block table per sequence,
``quantize_and_write`` to store key/value groups, ``paged_decode_attention`` for one new
query token per sequence, and ``DecodeRunner`` (that op planned once for many steps). Runs on CPU
(the torch path, ``kivi_cache.torch_ops``) and on a GPU (the Triton kernels):

    python examples/op_api.py [--bits 4] [--device cuda] [--lengths 96,320,1000]

It prints two errors of the attention output: against attention over the stored keys and values (dequantized:
the op computes exactly that, up to rounding) and against full-precision attention (the quantization's own
error; the data are random Gaussian keys and values, a hard case for quantization, while real models lose little,
see docs/quality.md), and the bytes the pool and the window hold against an fp16 cache.
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

    # attention over the same keys and values: as stored (pages dequantized, plus the window) and in full precision
    deq_k, deq_v = ops.dequantize_pages(block_table, quant_lengths, pool, key_bits=kb, value_bits=vb, group_size=g)

    def attend(q, k, v):  # q [Hq, D]; k, v [Hkv, T, D]: float32 attention, KV heads shared by hq // hkv queries
        k = k.float().repeat_interleave(hq // hkv, 0)
        v = v.float().repeat_interleave(hq // hkv, 0)
        w = torch.softmax(torch.einsum("hd,htd->ht", q.float(), k) * scale, -1)
        return torch.einsum("ht,htd->hd", w, v)

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()

    op_errs, errs = [], []
    for b, (n, q) in enumerate(zip(lengths, quant, strict=True)):
        stored_k = torch.cat([deq_k[b, :, :q], res_k[b, :, :n - q]], 1)
        stored_v = torch.cat([deq_v[b, :, :q], res_v[b, :, :n - q]], 1)
        op_errs.append(rel(out[b], attend(q_tok[b], stored_k, stored_v)))
        errs.append(rel(out[b], attend(q_tok[b], keys[b], values[b])))
    stored = sum(t.numel() * t.element_size() for t in pool) + 2 * res_k.numel() * res_k.element_size()
    fp16 = sum(2 * hkv * n * d * 2 for n in lengths)
    if dev.type == "cuda":
        err = ops.kernel_error()
        backend = "Triton kernels" if err is None else f"torch path (the Triton kernels do not load: {err})"
    else:
        backend = "torch path (kivi_cache.torch_ops)"
    print(f"{backend} on {dev}: int{kb} keys and values, groups of {g}, pages of {p} tokens, "
          f"{bsz} sequences of {', '.join(map(str, lengths))} tokens")
    print("relative error of the attention output, per sequence:")
    print("  against attention over the stored keys and values: " + ", ".join(f"{e:.1e}" for e in op_errs))
    print("  against full-precision attention (random data):    " + ", ".join(f"{e:.3f}" for e in errs))
    print(f"bytes held: {stored / 1024:.1f} KiB (pool + window) vs {fp16 / 1024:.1f} KiB for an fp16 cache "
          f"({fp16 / stored:.2f}x less)")
    print(f"ops.DecodeRunner (planned once, run 3 times): same output as the op: {same}")
    return errs


if __name__ == "__main__":
    main()

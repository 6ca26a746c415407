"""A few launches of the decode kernel (b=8, 32 query heads, head_dim 128, 32k) for Nsight Compute:
    ncu --clock-control none --kernel-name regex:_decode_split --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        python eval/ncu_decode.py --bits 4 --kv-heads 8 [--hot]

``--hot``: every block-table entry points at one page, so the history is read from L1/L2 and the profile shows
the kernel's own execution limits (stall reasons, pipes) without DRAM (``ab_decode.py --hot`` times the same).
"""

import argparse

import torch

from kivi_cache.kernels import api as KK

ap = argparse.ArgumentParser()
ap.add_argument("--bits", type=int, default=4, help="key and value bits (2 or 4)")
ap.add_argument("--kv-heads", type=int, default=8)
ap.add_argument("--hot", action="store_true", help="every block-table entry is page 0 (L1/L2-resident history)")
args = ap.parse_args()

bits, hkv = args.bits, args.kv_heads
b, hq, d, g, page, t_q = 8, 32, 128, 32, 64, 32640
np_ = b * (t_q // page)
dev = "cuda"
kc = torch.randint(0, 255, (np_, hkv, page, d * bits // 8), device=dev, dtype=torch.uint8)
ks = torch.rand(np_, hkv, page // g, d, device=dev, dtype=torch.float16) * 0.1
vc = kc.view(np_, hkv, d, page * bits // 8)  # value codes: channel rows packed along tokens (same bytes)
vs = torch.rand(np_, hkv, d // g, page, device=dev, dtype=torch.float16) * 0.1
bt = torch.randperm(np_, device=dev, dtype=torch.int32).reshape(b, -1)
if args.hot:
    bt = torch.zeros_like(bt)
lens = torch.full((b,), t_q, device=dev, dtype=torch.int32)
rk = torch.randn(b, hkv, 160, d, device=dev, dtype=torch.float16)
rl = torch.full((b,), 128, device=dev, dtype=torch.int32)
q = torch.randn(b, hq, d, device=dev, dtype=torch.float16)
for _ in range(6):
    KK.paged_decode_attention(q, bt, lens, kc, ks, ks, vc, vs, vs, rk, rk, rl, bits, bits, g, 0.088)
torch.cuda.synchronize()
print("done", dict(bits=bits, kv_heads=hkv, hot=args.hot))

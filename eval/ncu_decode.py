"""A few launches of the int4 decode kernel (b=8, 8 KV heads, 32k) for Nsight Compute:
    ncu --clock-control none --kernel-name regex:_decode_split --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        python eval/ncu_decode.py
"""

import sys

import torch

from kivi_cache import kernels as KK

bits = int(sys.argv[1]) if len(sys.argv) > 1 else 4
b, hkv, hq, d, g, page, t_q = 8, 8, 32, 128, 32, 64, 32640
np_ = b * (t_q // page)
dev = "cuda"
kc = torch.randint(0, 255, (np_, hkv, page, d * bits // 8), device=dev, dtype=torch.uint8)
ks = torch.rand(np_, hkv, page // g, d, device=dev, dtype=torch.float16) * 0.1
vc = kc.view(np_, hkv, d, page * bits // 8)  # value codes: channel rows packed along tokens (same bytes)
vs = torch.rand(np_, hkv, d // g, page, device=dev, dtype=torch.float16) * 0.1
bt = torch.randperm(np_, device=dev, dtype=torch.int32).reshape(b, -1)
lens = torch.full((b,), t_q, device=dev, dtype=torch.int32)
rk = torch.randn(b, hkv, 160, d, device=dev, dtype=torch.float16)
rl = torch.full((b,), 128, device=dev, dtype=torch.int32)
q = torch.randn(b, hq, d, device=dev, dtype=torch.float16)
for _ in range(6):
    KK.paged_decode_attention(q, bt, lens, kc, ks, ks, vc, vs, vs, rk, rk, rl, bits, bits, g, 0.088)
torch.cuda.synchronize()
print("done")

# head_dim 256 on the H200 (never timed before session 32's plan): the default one-warp, 64-token-step build spills in
# the paged loop under Triton 3.6 (4/4 g32 6, 2/2 g32 45, 4/2 g64 14 per step) and, at 4/4, its 43 KB of shared
# memory per program leave 5 warps per SM. eval/results/sass_warps_d256_s32.json (CPU builds, eval/sass_warps_scan.py):
# two-warp programs (DecodeTuning.warps=2) spill nowhere and keep 8 warps per SM at +38% (4/4), +40% (2/2), +30% (4/2)
# SASS per step summed over the warps; 32-token steps (DecodeTuning.step=32) do not spill at one warp either (4/4 3184
# SASS per 64 tokens against 2700). Same-process A/B, CUDA graphs; outputs compared with the default.
# Device command (no carry, ~5 minutes):  bash eval/d256_check.sh
# Verdict (session 35, eval/results/ab_d256_s35.json, ab_d256_b_s35.json): the default (one warp, 64-token steps) is
# fastest everywhere timed: 4/4 g32 8x8x32k 0.268 ms against 0.32-0.37 for s32/w2/w2s32; 2/2 g32 0.182 against
# 0.33-0.47; 4/2 g64 0.206 against 0.229 (w2), and 1x8x128k 0.111 against 0.119. The default stays.
. eval/device_env.sh
python3 -c "import triton; print('triton', triton.__version__)"
timeout 330 python3 eval/ab_decode.py --graph --head-dim 256 --q-heads 16 --rounds 3 \
    --tuning s32:step=32 --tuning w2:warps=2 --tuning w2s32:warps=2,step=32 \
    --shapes 8x8x32768,1x8x131072 --bits 4/4/32,2/2/32,4/2/64 \
    --out "$OUT/ab_d256.json" > "$OUT/ab_d256.log" 2>&1; echo "d256 ab rc $?"
grep -E " d256 " "$OUT/ab_d256.log"

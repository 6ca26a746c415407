# KIVI_DECODE_KSZ=1 (session 30, built on the CPU only): 2/4-bit keys' scale and zero words in one load per step.
# SASS per 64-token step (eval/candidates/README.md, session 30): head_dim 64 2/2 bits, Triton 3.6 923 -> 722 (no
# branch-wrapped copies), 3.9 718 -> 702; 4/2 g64 (the Int2PagedCache preset) 769 -> 717. Prediction: 2/2 bits at
# head_dim 64 under 3.6 ~20% faster (to about 3.9's 0.189 / 0.050 / 0.027 ms at 32x8x32k / 8x8x32k / 1x8x128k,
# eval/results/ab_d64_t39_s30.json); 4/2 g64 and 4/4 at head_dim 64 a few percent; head_dim 128 with 64-token groups
# 2-6% at 2-bit keys; head_dim 128 g32 unchanged. Outputs: bit-equal where the split count is the same (the register
# count differs, so the residency and the splits may too: then ~1e-3 relative).
# Device commands (no carry):  bash eval/ksz_check.sh ab    (~7 minutes: the A/Bs)
#                              bash eval/ksz_check.sh tests (~7 minutes: the GPU decode tests with KSZ on)
. eval/device_env.sh
python3 -c "import triton; print('triton', triton.__version__)"
if [ "${1:-ab}" = ab ]; then
    timeout 200 python3 eval/ab_decode.py --graph --head-dim 64 --rounds 3 --env ksz:KIVI_DECODE_KSZ=1 \
        --shapes 32x8x32768,8x8x32768,1x8x131072 --bits 2/2/32,4/2/64,4/4/32 \
        --out "$OUT/ab_ksz_d64.json" > "$OUT/ab_ksz_d64.log" 2>&1; echo "d64 ab rc $?"
    grep -E " d64 " "$OUT/ab_ksz_d64.log"
    timeout 200 python3 eval/ab_decode.py --graph --rounds 3 --env ksz:KIVI_DECODE_KSZ=1 \
        --shapes 32x8x32768,8x32x32768,1x8x131072 --bits 2/2/64,4/4/32 \
        --out "$OUT/ab_ksz_d128.json" > "$OUT/ab_ksz_d128.log" 2>&1; echo "d128 ab rc $?"
    grep -E "cur:|ksz:" "$OUT/ab_ksz_d128.log"
else
    KIVI_DECODE_KSZ=1 KIVI_TEST_GPU=1 timeout 420 python3 -m pytest -q tests/test_kernels.py -k decode \
        > "$OUT/gpu_tests_ksz_decode.log" 2>&1; echo "decode kernel tests (KSZ=1) rc $?"
    tail -3 "$OUT/gpu_tests_ksz_decode.log"
fi

# KSZ (kernels/attention.py _ksz): 2/4-bit keys' scale and zero words in one load per step. Default
# DecodeTuning.ksz=auto since session 31: on at head_dim 64, at 128 for fp16, and (session 32) for bf16 at 128 under
# Triton 3.6 only (those builds sit at the 255-register cap and spill a little with it: eval/results/
# sass_ksz_bf16_s31.json; timed 0.7-7.7% faster under 3.6, neutral under 3.9: ab_ksz_bf16_d128{,_t39}_s32.json); off at
# 256, where everything spills either way (sass_ksz_d256_s31.json). Session 31 measured the fp16 A/B (`ab`, Triton
# 3.6): head_dim 64 2/2 bits 24-27% faster, 4/2 g64 0-7%, 4/4 0-4%; head_dim 128 2/2 g64 6%, 4/4 g32 0.3-2%; slower
# nowhere (eval/results/ab_ksz_d{64,128}_s31.json).
# Device commands (no carry):  bash eval/ksz_check.sh ab    (~5 minutes: fp16 A/Bs, the default against KSZ=0)
#                              bash eval/ksz_check.sh bf16  (~5 minutes: bf16 A/Bs; at head_dim 128 KSZ=1 against
#                                                            the default, which was off there until session 32)
#                              bash eval/ksz_check.sh vhint64 (~4 minutes: with KSZ on, VHINT at head_dim 64 where
#                                  3.6 builds fewer instructions at the same residency (eval/results/
#                                  sass_vhint_d64_ksz_s31.json: 2/2 g32 722 -> 702, 153 -> 168 registers, 12 warps
#                                  per SM either way; 2/4 g32 783 -> 748; 4/2 g32 765 -> 739 only with a 168-register
#                                  cap, otherwise 238 registers, 8 warps); outputs bit-equal expected. Session 32:
#                                  `vh` won (ab_vhint64_ksz_s32.json), on by default since
#                              bash eval/ksz_check.sh s32 (carry [".t39"], ~9 minutes: session 32's A/Bs and tests)
#                              bash eval/ksz_check.sh tests (~4 minutes: the GPU decode tests, default settings)
. eval/device_env.sh
python3 -c "import triton; print('triton', triton.__version__)"
if [ "${1:-ab}" = ab ]; then
    timeout 200 python3 eval/ab_decode.py --graph --head-dim 64 --rounds 3 --tuning per_plane:ksz=0 \
        --shapes 32x8x32768,8x8x32768,1x8x131072 --bits 2/2/32,4/2/64,4/4/32 \
        --out "$OUT/ab_ksz_d64.json" > "$OUT/ab_ksz_d64.log" 2>&1; echo "d64 ab rc $?"
    grep -E " d64 " "$OUT/ab_ksz_d64.log"
    timeout 200 python3 eval/ab_decode.py --graph --rounds 3 --tuning per_plane:ksz=0 \
        --shapes 32x8x32768,8x32x32768,1x8x131072 --bits 2/2/64,4/4/32 \
        --out "$OUT/ab_ksz_d128.json" > "$OUT/ab_ksz_d128.log" 2>&1; echo "d128 ab rc $?"
    grep -E " d128 " "$OUT/ab_ksz_d128.log"
elif [ "$1" = bf16 ]; then
    timeout 150 python3 eval/ab_decode.py --graph --dtype bf16 --head-dim 64 --rounds 3 --tuning per_plane:ksz=0 \
        --shapes 32x8x32768,1x8x131072 --bits 2/2/32,4/4/32 \
        --out "$OUT/ab_ksz_bf16_d64.json" > "$OUT/ab_ksz_bf16_d64.log" 2>&1; echo "bf16 d64 ab rc $?"
    grep -E " d64 " "$OUT/ab_ksz_bf16_d64.log"
    timeout 250 python3 eval/ab_decode.py --graph --dtype bf16 --rounds 3 --tuning ksz:ksz=1 \
        --shapes 32x8x32768,8x32x32768,1x8x131072 --bits 2/2/32,2/2/64,4/4/32 \
        --out "$OUT/ab_ksz_bf16_d128.json" > "$OUT/ab_ksz_bf16_d128.log" 2>&1; echo "bf16 d128 ab rc $?"
    grep -E " d128 " "$OUT/ab_ksz_bf16_d128.log"
elif [ "$1" = vhint64 ]; then
    timeout 300 python3 eval/ab_decode.py --graph --head-dim 64 --rounds 3 --tuning vh:vhint=1 \
        --tuning vh168:vhint=1,maxnreg=168 \
        --shapes 32x8x32768,8x8x32768,1x8x131072 --bits 2/2/32,2/4/32,4/2/32 \
        --out "$OUT/ab_vhint64_ksz.json" > "$OUT/ab_vhint64_ksz.log" 2>&1; echo "vhint64 ab rc $?"
    grep -E " d64 " "$OUT/ab_vhint64_ksz.log"
elif [ "$1" = s32 ]; then
    # session 32: VHINT at head_dim 64 with 64-token groups (3.6: 2/2 and 4/2 g64 builds drop to 8 warps per SM with it),
    # the uncompiled model-level GPU tests (3.6, session 32's defaults), then (carry [".t39"]) the bf16 head_dim 128
    # KSZ A/B under Triton 3.9, where 2/2 g32 spills 4 registers per step
    timeout 110 python3 eval/ab_decode.py --graph --head-dim 64 --rounds 3 --tuning vh0:vhint=0 \
        --shapes 32x8x32768,1x8x131072 --bits 2/2/64,4/2/64 \
        --out "$OUT/ab_vhint64_g64.json" > "$OUT/ab_vhint64_g64.log" 2>&1; echo "vhint64 g64 ab rc $?"
    grep -E " d64 " "$OUT/ab_vhint64_g64.log"
    KIVI_TEST_GPU=1 timeout ${TTEST:-250} python3 -m pytest -q -p no:cacheprovider --durations=0 tests/test_gpu.py \
        -k "not compile" > "$OUT/gpu_tests_model.log" 2>&1; echo "model-level tests rc $?"
    grep -E "passed|failed|error" "$OUT/gpu_tests_model.log" | tail -3
    carried_triton || exit 1
    timeout 160 python3 eval/ab_decode.py --graph --dtype bf16 --rounds 3 \
        --tuning ksz:ksz=1 --shapes 32x8x32768,1x8x131072 --bits 2/2/32,2/2/64,4/4/32 \
        --out "$OUT/ab_ksz_bf16_d128_t39.json" > "$OUT/ab_ksz_bf16_d128_t39.log" 2>&1; echo "bf16 d128 t39 ab rc $?"
    grep -E " d128 " "$OUT/ab_ksz_bf16_d128_t39.log"
else
    KIVI_TEST_GPU=1 timeout 420 python3 -m pytest -q tests/test_api.py tests/test_quantize.py tests/test_dequant.py tests/test_decode*.py tests/test_prefix.py tests/test_sinks.py -k decode \
        > "$OUT/gpu_tests_decode.log" 2>&1; echo "decode kernel tests rc $?"
    tail -3 "$OUT/gpu_tests_decode.log"
fi

# Session 30: VHINT `auto` now on at head_dim 64 for 4/4 bits (session 29: 3-11% faster there under 3.6). Under the
# GPU image's Triton 3.6: the A/B of the new default against the hint off (bit-equal outputs expected: err 0), the
# op-check tests on CUDA tensors (tests/test_op_checks.py now builds them there under KIVI_TEST_GPU=1; session 29's
# 11 setup failures), then the GPU decode-kernel tests with the new default.
# Device command (no carry): bash eval/vhint_d64_check.sh   (~9 minutes)
. eval/device_env.sh
python3 -c "import triton; print('triton', triton.__version__)"
timeout 110 python3 eval/ab_decode.py --graph --head-dim 64 --rounds 3 --tuning nohint:vhint=0 \
    --shapes 32x8x32768,8x8x32768,1x8x131072 --bits 4/4/32 \
    --out "$OUT/ab_vhint_d64.json" > "$OUT/ab_vhint_d64.log" 2>&1; echo "ab rc $?"
grep -E " d64 |cur:|nohint:" "$OUT/ab_vhint_d64.log" | tail -12
KIVI_TEST_GPU=1 timeout 130 python3 -m pytest -q tests/test_op_checks.py \
    > "$OUT/gpu_tests_op_checks.log" 2>&1; echo "op-check tests rc $?"
tail -3 "$OUT/gpu_tests_op_checks.log"
KIVI_TEST_GPU=1 timeout 320 python3 -m pytest -q tests/test_api.py tests/test_quantize.py tests/test_dequant.py tests/test_decode*.py tests/test_prefix.py tests/test_sinks.py -k decode \
    > "$OUT/gpu_tests_decode.log" 2>&1; echo "decode kernel tests rc $?"
tail -3 "$OUT/gpu_tests_decode.log"

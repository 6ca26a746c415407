# Session 27's VHINT on the GPU image's Triton 3.6 (built and checked on the CPU only): first the A/B against the
# hint off (same outputs expected: the hint only declares an alignment; err must be 0), then the GPU kernel tests
# with it. Device command (no carry): bash eval/vhint_check.sh   (~8 minutes)
. eval/device_env.sh
python3 -c "import triton; print('triton', triton.__version__)"
timeout 200 python3 eval/ab_decode.py --graph --rounds 3 --tuning nohint:vhint=0 \
    --shapes 32x8x32768,8x32x32768,8x8x32768,1x8x131072 --bits 4/4/32,2/2/32,4/2/64 \
    --out "$OUT/ab_vhint.json" > "$OUT/ab_vhint.log" 2>&1; echo "ab rc $?"
grep -E "cur:|nohint:" "$OUT/ab_vhint.log" | tail -24
KIVI_TEST_GPU=1 timeout 330 python3 -m pytest -q tests/test_api.py tests/test_quantize.py tests/test_dequant.py tests/test_decode*.py tests/test_prefix.py tests/test_sinks.py tests/test_unpack_ptx.py \
    > "$OUT/gpu_tests_vhint_kernels.log" 2>&1; echo "kernel tests rc $?"
tail -3 "$OUT/gpu_tests_vhint_kernels.log"

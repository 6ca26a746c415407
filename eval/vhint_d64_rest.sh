# Session 30, second call of eval/vhint_d64_check.sh's checks (Triton 3.6): the op-check tests on CUDA with the index
# values checked (the first call's run lacked KIVI_CHECK_INDICES: a device assert failed all tests after the 3rd),
# then the GPU decode-kernel tests the first call's 320-s limit cut (from the 62nd of `-k decode` on).
# Device command: bash eval/vhint_d64_rest.sh   (~3 minutes)
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 100 python3 -m pytest -q tests/test_op_checks.py \
    > "$OUT/gpu_tests_op_checks.log" 2>&1; echo "op-check tests rc $?"
tail -3 "$OUT/gpu_tests_op_checks.log"
KIVI_TEST_GPU=1 python3 -m pytest --collect-only -q tests/test_api.py tests/test_quantize.py tests/test_dequant.py tests/test_decode*.py tests/test_prefix.py tests/test_sinks.py -k decode 2>/dev/null | grep "::" \
    | tail -n +${1:-62} > /tmp/decode_rest.txt
wc -l < /tmp/decode_rest.txt
KIVI_TEST_GPU=1 timeout 110 python3 -m pytest -q $(cat /tmp/decode_rest.txt) \
    > "$OUT/gpu_tests_decode_rest.log" 2>&1; echo "decode kernel tests (rest) rc $?"
tail -3 "$OUT/gpu_tests_decode_rest.log"

# Follow-up device call of the newest-Triton check (eval/newest_triton_check.sh runs out of its 10 minutes): the
# model-level GPU tests under 3.9, then the kernel tests from the SKIP-th on (`bash eval/newest_triton_rest.sh SKIP`;
# session 27 reached 84 of 164, ids as `pytest --collect-only -q` lists them). Session 27's version first timed 3.6
# with 3.9's ptxas (`ab_triton36_ptxas134_s27.json`: no gain; answered, so dropped). Needs .t39/triton39.tar.xz
# (eval/pack_triton.sh); carry [".t39"].
. eval/device_env.sh
carried_triton || exit 1
if [ -z "${NO_MODEL:-}" ]; then  # NO_MODEL=1: kernel tests only (session 30)
    KIVI_TEST_GPU=1 timeout 220 python3 -m pytest -q tests/test_gpu.py -k "not compile" \
        > "$OUT/gpu_tests_triton39_gpu.log" 2>&1; echo "gpu tests rc $?"
    tail -3 "$OUT/gpu_tests_triton39_gpu.log"
fi
KIVI_TEST_GPU=1 python3 -m pytest --collect-only -q tests/test_api.py tests/test_quantize.py tests/test_dequant.py tests/test_decode*.py tests/test_prefix.py tests/test_sinks.py tests/test_unpack_ptx.py 2>/dev/null \
    | grep "::" | tail -n +$((${1:-0} + 1)) > /tmp/rest_ids.txt
KIVI_TEST_GPU=1 timeout ${KTIME:-210} python3 -m pytest -q $(cat /tmp/rest_ids.txt) \
    > "$OUT/gpu_tests_triton39_kernels_rest.log" 2>&1; echo "kernel tests (rest) rc $?"
tail -3 "$OUT/gpu_tests_triton39_kernels_rest.log"

# Follow-up device call of the newest-Triton check (eval/newest_triton_check.sh runs out of its 10 minutes): (1) is
# the speed-up under Triton 3.9 its ptxas (CUDA 13.4) or its code generation? The same decode A/B under the image's
# Triton 3.6 with the carried ptxas (session 27: code generation); (2) the model-level GPU tests under 3.9; (3) the
# kernel tests from the SKIP-th on (`bash eval/newest_triton_rest.sh SKIP`; session 27 reached 84 of 164, ids as
# `pytest --collect-only -q` lists them). Needs .t39/triton39.tar.xz (eval/pack_triton.sh); carry [".t39"].
. eval/device_env.sh
ab="eval/ab_decode.py --graph --rounds 2 --shapes 32x8x32768,1x8x131072 --bits 4/4/32,2/2/32"
mkdir -p /tmp/t39 && tar -xJf .t39/triton39.tar.xz -C /tmp/t39 || exit 1
px=/tmp/t39/triton/backends/nvidia/bin/ptxas-blackwell
TRITON_PTXAS_PATH=$px TRITON_PTXAS_BLACKWELL_PATH=$px timeout 80 python3 $ab --out "$OUT/ab_triton36_ptxas134.json" \
    > "$OUT/ab_triton36_ptxas134.log" 2>&1; echo "ab 3.6 + ptxas 13.4 rc $?"
export PYTHONPATH=/tmp/t39:$PYTHONPATH TRITON_BACKENDS_IN_TREE=1
python3 -c "import triton; print('carried triton', triton.__version__, triton.__file__)" || exit 1
KIVI_TEST_GPU=1 timeout 220 python3 -m pytest -q tests/test_gpu.py -k "not compile" \
    > "$OUT/gpu_tests_triton39_gpu.log" 2>&1; echo "gpu tests rc $?"
tail -3 "$OUT/gpu_tests_triton39_gpu.log"
KIVI_TEST_GPU=1 python3 -m pytest --collect-only -q tests/test_kernels.py tests/test_unpack_ptx.py 2>/dev/null \
    | grep "::" | tail -n +$((${1:-0} + 1)) > /tmp/rest_ids.txt
KIVI_TEST_GPU=1 timeout 210 python3 -m pytest -q $(cat /tmp/rest_ids.txt) \
    > "$OUT/gpu_tests_triton39_kernels_rest.log" 2>&1; echo "kernel tests (rest) rc $?"
tail -3 "$OUT/gpu_tests_triton39_kernels_rest.log"

#!/usr/bin/env bash
# One device call after a kernel change (run tool, from the repository root; run with timeout_s 600): the GPU
# tests in two pieces with their own timeouts, T_KERNELS (240 s: the kernel tests took more than 180 s on the
# H200 in session 18) and T_REST (330 s: tests/test_gpu.py alone took 249-313 s with its compiles, sessions 17-18);
# 570 s in all. The quantize probe (QUANT=1, ~50 s) and an A/B of decode settings (AB=1, T_AB 150 s) are off by
# default: with either, lower the test timeouts or split the call. REST_EXTRA adds test files to the second piece
# (e.g. "tests/test_static.py tests/test_unpack_ptx.py", which CI runs on the CPU). Logs and JSON go to $OUT (the run tool brings
# them back). Usage:
#     bash eval/gpu_check.sh                                   the tests
#     T_KERNELS=170 T_REST=200 AB=1 bash eval/gpu_check.sh --bits 4/4/32,4/4/64     tests cut short, plus the A/B
# AB_ARGS go to eval/ab_decode.py (default: int4 g32 vs g64 at five shapes).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KIVI_TEST_GPU=1
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout "${T_KERNELS:-240}" python -m pytest -q tests/test_api.py tests/test_quantize.py tests/test_dequant.py \
    tests/test_decode.py tests/test_decode_plan.py tests/test_decode_merge.py tests/test_decode_split.py \
    tests/test_prefix.py tests/test_sinks.py > "$OUT/gpu_tests_kernels.log" 2>&1
echo "kernel tests rc=$? $(tail -1 "$OUT/gpu_tests_kernels.log")"
timeout "${T_REST:-330}" python -m pytest -q tests/test_gpu.py ${REST_EXTRA:-} > "$OUT/gpu_tests_rest.log" 2>&1
echo "test_gpu ${REST_EXTRA:-} rc=$? $(tail -1 "$OUT/gpu_tests_rest.log")"
if [ "${QUANT:-0}" != 0 ]; then
    timeout 50 python eval/quant_probe.py --out "$OUT/quant_probe.json" > "$OUT/quant_probe.log" 2>&1
    echo "quant_probe rc=$?"; tail -16 "$OUT/quant_probe.log"
fi
if [ "${AB:-0}" != 0 ]; then
    if [ $# -eq 0 ]; then
        set -- --bits 4/4/32,4/4/64 --shapes 32x8x32768,8x32x32768,32x32x32768,8x8x131072,1x8x131072
    fi
    timeout "${T_AB:-150}" python eval/ab_decode.py --graph "$@" --out "$OUT/ab.json" > "$OUT/ab.log" 2>&1
    echo "ab_decode rc=$?"; tail -20 "$OUT/ab.log"
fi

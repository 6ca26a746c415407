#!/usr/bin/env bash
# One device call after a kernel change (run tool, from the repository root; at most ~9.5 minutes: run with timeout_s 600;
# the default time limits add up to 570 s: T_KERNELS 170, T_REST 200, quant_probe 50, T_AB 150):
# the GPU tests in two pieces with their own timeouts, the quantize probe, and an A/B of decode settings.
# Logs and JSON go to $OUT (the run tool brings them back). Usage:
#     bash eval/gpu_check.sh [AB_ARGS...]     e.g. bash eval/gpu_check.sh --bits 4/4/32,4/4/64
# AB_ARGS go to eval/ab_decode.py (default: int4 g32 vs g64 at five shapes); AB=0 skips the A/B.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ln -sfn ../kernels kivi_cache/kernels
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KIVI_TEST_GPU=1
nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout "${T_KERNELS:-170}" python -m pytest -q tests/test_kernels.py > "$OUT/gpu_tests_kernels.log" 2>&1
echo "test_kernels rc=$? $(tail -1 "$OUT/gpu_tests_kernels.log")"
timeout "${T_REST:-200}" python -m pytest -q tests/test_gpu.py tests/test_unpack_ptx.py tests/test_static.py \
    > "$OUT/gpu_tests_rest.log" 2>&1
echo "test_gpu/unpack_ptx/static rc=$? $(tail -1 "$OUT/gpu_tests_rest.log")"
timeout 50 python eval/quant_probe.py --out "$OUT/quant_probe.json" > "$OUT/quant_probe.log" 2>&1
echo "quant_probe rc=$?"; tail -16 "$OUT/quant_probe.log"
if [ "${AB:-1}" != 0 ]; then
    if [ $# -eq 0 ]; then
        set -- --bits 4/4/32,4/4/64 --shapes 32x8x32768,8x32x32768,32x32x32768,8x8x131072,1x8x131072
    fi
    timeout "${T_AB:-150}" python eval/ab_decode.py --graph "$@" --out "$OUT/ab.json" > "$OUT/ab.log" 2>&1
    echo "ab_decode rc=$?"; tail -20 "$OUT/ab.log"
fi

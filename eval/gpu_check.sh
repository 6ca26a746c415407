#!/usr/bin/env bash
# The developer's GPU check: the test suite's GPU parts on a CUDA machine (KIVI_TEST_GPU=1: the kernel tests run the
# compiled Triton kernels instead of the interpreter), from the repository root. Two modes, each under 560 s, so
# that either fits a 600-second command:
#     bash eval/gpu_check.sh kernels   the kernel test files (tests/test_{api,quantize,dequant,decode*,prefix,sinks}.py)
#     bash eval/gpu_check.sh model     tests/test_gpu.py (generate, compiled decoding and batching through the kernels)
# A cold run compiles every kernel first, which takes most of the time of each mode.
# T (seconds, default 540) caps the pytest run; EXTRA adds test files to either mode. Logs go to $OUT
# (default /tmp/gpu_check): gpu_tests_<mode>.log. The exit status is pytest's (124 when T cut it short).
set -u
mode=${1:-}
case "$mode" in
    kernels) files="tests/test_api.py tests/test_quantize.py tests/test_dequant.py tests/test_decode.py
                    tests/test_decode_plan.py tests/test_decode_merge.py tests/test_decode_split.py tests/test_prefix.py
                    tests/test_sinks.py" ;;
    model) files="tests/test_gpu.py" ;;
    *) echo "usage: bash eval/gpu_check.sh kernels|model" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KIVI_TEST_GPU=1
[ -e kivi_cache/kernels ] || ln -s ../kernels kivi_cache/kernels  # a copy of the tree without the link
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "
import torch, triton, transformers, kivi_cache
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__,
      'transformers', transformers.__version__)
print('kernels:', kivi_cache.kernel_error() or 'loaded')"
log="$OUT/gpu_tests_$mode.log"
# shellcheck disable=SC2086  # the file lists split into arguments
timeout "${T:-540}" python -m pytest -q $files ${EXTRA:-} > "$log" 2>&1
rc=$?
echo "$mode: rc=$rc $(tail -1 "$log")"
exit $rc

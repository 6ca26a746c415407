#!/usr/bin/env bash
# Session 14's first device call (run tool, kind nvidia-h200, timeout_s 600, no .whl needed). Session 13 made the
# decode runner (kernels/ops.DecodeRunner), the window write by the decode kernel and (at <= 64 pairs) the in-kernel
# merge the defaults; the runner's GPU test timed out twice (compiles) before it could finish after its fix.
#   1. GPU tests of the runner and the merge, then generate against the reference and the window write (longer limit);
#   2. in-process A/B at 32k with more rounds (session 13: 1.03x and 1.05x with 4 and 3 rounds), and at 1k;
#   3. the flush probe (session 13: +10 ms per flush step).
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 300 python -m pytest -q tests/test_gpu.py \
    -k "runner or merge or window_write or inside_generate or synchronize" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
timeout 120 python eval/host_decode_probe.py --variants fp16,kivi --prompt 32768 --rounds 6 --steps 32 \
    --out "$OUT/host_variants_32k.json" 2>&1 | tail -10 | tr -d '\n ' | cut -c1-400; echo
timeout 70 python eval/host_decode_probe.py --variants fp16,kivi,kivi:000 --rounds 6 --steps 48 \
    --out "$OUT/host_variants_1k.json" 2>&1 | tail -14 | tr -d '\n ' | cut -c1-500; echo
timeout 40 python eval/host_decode_probe.py --flush-probe 96 --out "$OUT/flush_probe.json" 2>&1 | tail -2 | cut -c1-200

#!/usr/bin/env bash
# Session 14's second device call: (1) GPU tests of the in-kernel merge with many partials (its loop,
# KIVI_DECODE_MERGE_MAX), the runner with the shared workspace, generate against the reference; (2) in-process A/B at
# 32k: the default (merge kernel: 129 partials) against the in-kernel merge of all 129; (3) where a flush step's extra
# host time goes (cProfile and torch.profiler per step kind).
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 240 python -m pytest -q tests/test_gpu.py \
    -k "merge_matches or runner_equals or inside_generate" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
timeout 170 python eval/host_decode_probe.py --variants fp16,kivi,kivi+KIVI_DECODE_MERGE_MAX=256 --prompt 32768 \
    --rounds 8 --steps 32 --out "$OUT/host_variants_32k.json" 2>&1 | tail -12 | tr -d '\n ' | cut -c1-500; echo
timeout 100 python eval/host_decode_probe.py --flush-profile 70 --top 40 --out "$OUT/flush_profile.json" 2>&1 \
    | grep -v USDT | tail -40 | cut -c1-220

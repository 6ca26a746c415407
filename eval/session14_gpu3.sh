#!/usr/bin/env bash
# Session 14's third device call: (1) GPU tests after the block table's spare columns, the runner's two templates
# (with and without the token) and the merge default
# (MERGE_MAX 256): generate against the reference, the window write, no host sync, the merges, the runner;
# (2) the flush probe with the spare columns on and off in turn; (3) in-process A/B fp16 vs kivi at 32k and 1k.
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 250 python -m pytest -q tests/test_gpu.py \
    -k "merge_matches or runner_equals or inside_generate or window_write or synchronize" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
timeout 75 python eval/host_decode_probe.py --flush-probe 70 --out "$OUT/flush_probe.json" 2>&1 | tail -4 | cut -c1-200
timeout 110 python eval/host_decode_probe.py --variants fp16,kivi --prompt 32768 --rounds 6 --steps 32 \
    --out "$OUT/host_variants_32k.json" 2>&1 | tail -8 | tr -d '\n ' | cut -c1-300; echo
timeout 80 python eval/host_decode_probe.py --variants fp16,kivi --rounds 6 --steps 48 \
    --out "$OUT/host_variants_1k.json" 2>&1 | tail -8 | tr -d '\n ' | cut -c1-300; echo

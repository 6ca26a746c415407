#!/usr/bin/env bash
# Session 13, third device call (run tool, kind nvidia-h200, carry .whl, timeout_s 600), after making the window
# write by the decode op and (at small batches) the split kernel's own merge the defaults (call 2's in-process A/B):
#   1. GPU tests: the runner against the op, the merge, the window write, generate against the reference, no sync;
#   2. in-process A/B at 1k: fp16, kivi (defaults), kivi:000 (no write, no merge, no runner: session 12's path);
#   3. the eager batch-1 rows with the defaults (fp16, kivi-int4, quanto-int4; 1k + 256, 32k + 64; 3 repeats);
#   4. kivi-int4 at eager's 4k max batch (320, session 12: 33.5 ms a step, 9553 tok/s, peak 77.78 GiB): no regression.
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 130 python -m pytest -q tests/test_gpu.py \
    -k "runner or merge or window_write or inside_generate or step_logits or synchronize or cached_launches" \
    > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
timeout 90 python eval/host_decode_probe.py --variants fp16,kivi,kivi:000 --rounds 8 --steps 48 \
    --out "$OUT/host_variants_1k.json" 2>&1 | tail -14 | tr -d '\n ' | cut -c1-600; echo
timeout 190 python eval/bench_generate.py --models llama3-8b --cases short,long \
    --caches fp16,kivi-int4,quanto-int4 --repeats 3 --time-budget 180 \
    --out "$OUT/bench_generate_b1eager.json" 2>&1 | grep -v "it/s\|run/s" | grep "llama3-8b\|rows" | tail -8
timeout 130 python eval/bench_generate.py --models llama3-8b --caches kivi-int4 --cases maxbatch --batch-prompts 4096 \
    --maxbatch-at llama3-8b:kivi-int4:4096:320 --repeats 2 --time-budget 120 \
    --out "$OUT/bench_generate_mb4k.json" 2>&1 | grep -v "it/s\|run/s" | grep "llama3-8b\|rows" | tail -4

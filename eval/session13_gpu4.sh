#!/usr/bin/env bash
# Session 13, fourth device call (run tool, kind nvidia-h200, carry .whl, timeout_s 500). Call 3's A/B was void (the
# probe's `kivi` variant kept the settings of the variant before it; fixed) and its host ran in slow phases. Here:
#   1. GPU tests of the runner and the merge (call 3's test run timed out before them);
#   2. in-process A/B: 1k (fp16, kivi = defaults, kivi:111, kivi:000) and 32k (fp16, kivi, kivi:000);
#   3. the eager batch-1 rows with the defaults (fp16, kivi-int4, quanto-int4; 1k + 256, 32k + 64; 3 repeats).
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 60 python -m pytest -q tests/test_gpu.py -k "runner or merge" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
timeout 80 python eval/host_decode_probe.py --variants fp16,kivi,kivi:111,kivi:000 --rounds 6 --steps 48 \
    --out "$OUT/host_variants_1k.json" 2>&1 | tail -18 | tr -d '\n ' | cut -c1-700; echo
timeout 75 python eval/host_decode_probe.py --variants fp16,kivi,kivi:000 --prompt 32768 --rounds 3 --steps 32 \
    --out "$OUT/host_variants_32k.json" 2>&1 | tail -14 | tr -d '\n ' | cut -c1-600; echo
timeout 170 python eval/bench_generate.py --models llama3-8b --cases short,long \
    --caches fp16,kivi-int4,quanto-int4 --repeats 3 --time-budget 150 \
    --out "$OUT/bench_generate_b1eager.json" 2>&1 | grep -v "it/s\|run/s" | grep "llama3-8b\|rows" | tail -8

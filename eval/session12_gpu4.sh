#!/usr/bin/env bash
# Session 12, fourth device call (run tool, kind nvidia-h200, carry .whl, timeout_s 540): after the flush's quantize
# launch went through the direct launcher and lost its two copies:
#   1. GPU tests: the quantize kernel against the reference, the launcher, generate with the kernels;
#   2. the flush probe once (flush steps against the others);
#   3. the eager batch-1 rows again (fp16, kivi-int4, quanto-int4; 1k + 256, 32k + 64; 3 repeats).
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 100 python -m pytest -q tests/test_kernels.py -k "quant" > "$OUT/gpu_tests_quant.log" 2>&1
echo "quant tests rc=$? $(tail -1 "$OUT/gpu_tests_quant.log")"
KIVI_TEST_GPU=1 timeout 150 python -m pytest -q tests/test_gpu.py -k "cached_launches or inside_generate" \
    > "$OUT/gpu_tests_gen.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests_gen.log")"
timeout 40 python eval/host_decode_probe.py --flush-probe 96 --out "$OUT/flush_probe.json" 2>&1 | tail -2 | cut -c1-200
timeout 200 python eval/bench_generate.py --models llama3-8b --cases short,long \
    --caches fp16,kivi-int4,quanto-int4 --repeats 3 --time-budget 190 --out "$OUT/bench_generate_b1eager.json" \
    2>&1 | grep -v "it/s\|run/s" | grep "llama3-8b\|rows" | tail -8

#!/usr/bin/env bash
# Session 13's first device call (run tool, kind nvidia-h200, carry .whl, timeout_s 600; ~8 minutes). Session 12
# ended with two host-side changes not yet run on a GPU (CPU-tested): a decode step's flush keeps the device block
# table and lengths (in place: a new page column, lengths + G) instead of uploading them again, and the window-length
# table's rows are padded to 16 bytes. This call:
#   1. GPU tests: generate with the kernels against the reference, no host sync, the launcher, the quantize kernel;
#   2. the flush probe (session 12: a flush step cost +13-16 ms) and the decode op's host time;
#   3. the eager batch-1 rows again (fp16, kivi-int4, quanto-int4; 1k + 256, 32k + 64; 3 repeats).
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 170 python -m pytest -q tests/test_gpu.py tests/test_kernels.py \
    -k "inside_generate or synchronize or cached_launches or step_logits or quant" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
timeout 40 python eval/host_decode_probe.py --flush-probe 96 --out "$OUT/flush_probe.json" 2>&1 | tail -2 | cut -c1-200
timeout 40 python eval/host_decode_probe.py --op-only --out "$OUT/op_host.json" 2>&1 | tail -1 | cut -c1-220
timeout 200 python eval/bench_generate.py --models llama3-8b --cases short,long \
    --caches fp16,kivi-int4,quanto-int4 --repeats 3 --time-budget 190 --out "$OUT/bench_generate_b1eager.json" \
    2>&1 | grep "llama3-8b  \|rows" | tail -8

#!/usr/bin/env bash
# Session 13, second device call (run tool, kind nvidia-h200, carry .whl, timeout_s 600). New since the first call:
# ops.DecodeRunner / kernels.DecodeRunner (the decode op planned once per block table, then direct launches of the
# first call's argument list with only the changing pointers replaced; the layer keeps one per pool).
#   1. GPU tests: the runner against the op (bit-equal, merge on/off, token on/off), generate with the kernels
#      against the reference, the window write by the kernel, no host sync;
#   2. in-process A/B of (write, merge, runner) at 1k and 32k, fp16 DynamicCache in the same rounds;
#   3. the eager batch-1 rows (fp16, kivi-int4, quanto-int4; 1k + 256, 32k + 64; 3 repeats) with write and merge on.
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 150 python -m pytest -q tests/test_gpu.py \
    -k "runner or inside_generate or step_logits or window_write or synchronize" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
timeout 110 python eval/host_decode_probe.py --variants fp16,kivi:000,kivi:001,kivi:111,kivi:101 --rounds 8 \
    --steps 48 --out "$OUT/host_variants_1k.json" 2>&1 | tail -28 | tr -d '\n ' | cut -c1-900; echo
timeout 100 python eval/host_decode_probe.py --variants fp16,kivi:000,kivi:111 --prompt 32768 --rounds 4 \
    --steps 32 --out "$OUT/host_variants_32k.json" 2>&1 | tail -14 | tr -d '\n ' | cut -c1-600; echo
KIVI_DECODE_FUSE_WRITE=1 KIVI_DECODE_FUSE_MERGE=1 timeout 200 python eval/bench_generate.py --models llama3-8b \
    --cases short,long --caches fp16,kivi-int4,quanto-int4 --repeats 3 --time-budget 190 \
    --out "$OUT/bench_generate_b1eager.json" 2>&1 | grep -v "it/s\|run/s" | grep "llama3-8b\|rows" | tail -8

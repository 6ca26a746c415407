#!/usr/bin/env bash
# Session 13's first device call (run tool, kind nvidia-h200, carry .whl, timeout_s 600; ~9 minutes). Session 12
# ended with changes not yet run on a GPU (CPU-tested): a decode step's flush keeps the device block table and
# lengths (in place) instead of uploading them again; the window-length table's rows padded to 16 bytes; the decode
# hot path's Python trimmed; and, opt-in (KIVI_DECODE_FUSE_WRITE=1), the split kernel writing the step's token into
# the window itself (no two copies per layer). This call:
#   1. GPU tests: generate with the kernels against the reference, no host sync, the launcher, the quantize kernel,
#      the decode kernel's new-token write (kernel against reference, and in the model against the copies);
#   2. host_decode_probe with KIVI_DECODE_FUSE_WRITE 0/1/0/1 in alternating processes (synced decode steps at 1k);
#   3. the flush probe;
#   4. the eager batch-1 rows again (fp16, kivi-int4, quanto-int4; 1k + 256, 32k + 64; 3 repeats), with what is left.
# If 1 passes and FUSE_WRITE=1 is faster in 2: make it the default (kivi_cache/layer.py FUSE_WINDOW_WRITE).
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 200 python -m pytest -q tests/test_gpu.py tests/test_kernels.py \
    -k "inside_generate or synchronize or cached_launches or step_logits or quant or new_token or window_write" \
    > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
for f in 0 1 0 1; do
    KIVI_DECODE_FUSE_WRITE=$f timeout 60 python eval/host_decode_probe.py --rounds 2 --steps 48 --no-profile \
        --out "$OUT/host_fuse$f.$RANDOM.json" 2>&1 | grep -A10 '^{$' | tr -d '\n ' | sed "s/^/fuse=$f /"; echo
done
timeout 40 python eval/host_decode_probe.py --flush-probe 96 --out "$OUT/flush_probe.json" 2>&1 | tail -2 | cut -c1-200
timeout 170 python eval/bench_generate.py --models llama3-8b --cases short,long \
    --caches fp16,kivi-int4,quanto-int4 --repeats 3 --time-budget 160 --out "$OUT/bench_generate_b1eager.json" \
    2>&1 | grep "llama3-8b  \|rows" | tail -8

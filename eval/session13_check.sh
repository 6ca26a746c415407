#!/usr/bin/env bash
# Session 13's first device call (run tool, kind nvidia-h200, timeout_s 600; ~8.5 minutes). Session 12 ended with
# changes not yet run on a GPU (CPU-tested; the GPU build of the kernel checked with ptxas): a decode step's flush
# keeps the device block table and lengths (in place) instead of uploading them again; the window-length table's
# rows padded to 16 bytes; the decode hot path's Python trimmed; and, opt-in, two launches fewer per layer:
# KIVI_DECODE_FUSE_WRITE=1 (the split kernel stores the step's token into the window: no two copies) and
# KIVI_DECODE_FUSE_MERGE=1 (the last program of each (sequence, KV head) merges the partials: no merge kernel, up
# to 16 partials). This call:
#   1. GPU tests: generate with the kernels against the reference, no host sync, the launcher, the quantize kernel,
#      the new-token write (kernel against reference; in the model against the copies, bit-equal) and the in-kernel
#      merge (20 calls in a row at 4 shapes against the merge kernel);
#   2. host_decode_probe (synced decode steps at 1k, fp16 vs kivi-int4) with (FUSE_WRITE, FUSE_MERGE) = 00, 11, 10,
#      01, 00, 11 in separate processes;
#   3. the flush probe.
# Then: if 1 passes and 11 is faster, time the op with the merge where it applies (batch 1, 1k-4k contexts; without
# --graph, since the merge is off while a CUDA graph is captured):
#   python eval/ab_decode.py --env merge:KIVI_DECODE_FUSE_MERGE=1 --shapes 1x8x1024,1x8x4096,1x32x2048 --bits 4/4/32
# and make the faster settings the defaults (kivi_cache/layer.py
# FUSE_WINDOW_WRITE; kernels/attention.py _DecodePlan merge_meta); then the eager batch-1 rows
# (`--cases short,long --caches fp16,kivi-int4,quanto-int4 --repeats 3`, carry .whl).
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 230 python -m pytest -q tests/test_gpu.py tests/test_kernels.py \
    -k "inside_generate or synchronize or cached_launches or step_logits or quant or new_token or window_write or merge" \
    > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
for wm in 00 11 10 01 00 11; do
    KIVI_DECODE_FUSE_WRITE=${wm:0:1} KIVI_DECODE_FUSE_MERGE=${wm:1:1} timeout 45 python eval/host_decode_probe.py \
        --rounds 1 --steps 48 --no-profile --out "$OUT/host_wm$wm.$RANDOM.json" 2>&1 | grep -A10 '^{$' \
        | tr -d '\n ' | sed "s/^/write,merge=$wm /"; echo
done
timeout 40 python eval/host_decode_probe.py --flush-probe 96 --out "$OUT/flush_probe.json" 2>&1 | tail -2 | cut -c1-200

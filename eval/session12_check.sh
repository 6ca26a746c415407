#!/usr/bin/env bash
# Session 11's open GPU questions in one device call (run tool, kind nvidia-h200, timeout_s 600; ~9 minutes):
#   1. the direct-launch path (kernels._util.Launcher, opt-in KIVI_FAST_LAUNCH=1): its GPU bit-equality test, then the
#      decode op's host time with it off and on, alternating processes;
#   2. the eager batch-1 step with it on (eval/host_decode_probe.py: forward decode steps, fp16 vs kivi-int4);
#   3. the static cache at eager's max batch (4k x 320) now that its pool is sized exactly, against eager, one run.
# Logs and JSON go to $OUT. If 1 passes and "on" is faster, make FAST_LAUNCH default on (kernels/_util.py) and run
# `bash eval/gpu_check.sh` with it.
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 90 python -m pytest -q tests/test_gpu.py -k cached_launches > "$OUT/gpu_tests_launch.log" 2>&1
echo "launcher test rc=$? $(tail -1 "$OUT/gpu_tests_launch.log")"
for s in 0 1 0 1; do
    KIVI_FAST_LAUNCH=$s timeout 45 python eval/host_decode_probe.py --op-only --out "$OUT/op_host_fast$s.$RANDOM.json" \
        2>&1 | tail -1 | sed "s/^/fast=$s /" | cut -c1-220
done
KIVI_FAST_LAUNCH=1 timeout 90 python eval/host_decode_probe.py --rounds 2 --steps 32 \
    --out "$OUT/host_decode_probe_fast.json" > "$OUT/host_decode_probe_fast.log" 2>&1
echo "host probe rc=$?"; grep -A16 '^{$' "$OUT/host_decode_probe_fast.log" | head -18
timeout 270 python eval/bench_generate.py --models llama3-8b --cases maxbatch --batch-prompts 4096 \
    --caches kivi-int4,kivi-int4-static --maxbatch-at kivi-int4:4096:320 --maxbatch-at kivi-int4-static:4096:320 \
    --time-budget 260 --out "$OUT/bench_generate_static_mb.json" 2>&1 | tail -6

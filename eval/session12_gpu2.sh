#!/usr/bin/env bash
# Session 12, second device call (run tool, kind nvidia-h200, carry .whl, timeout_s 600): after the direct launches
# became the default (pointers passed as addresses) and the decode step's window length became a view of a shared
# table (no in-place add) and the window writes narrow + copy_:
#   1. GPU tests: the launcher's bit-equality, generate with the kernels against the reference, no host sync;
#   2. the decode op's host time (two processes);
#   3. host_decode_probe: fp16 vs kivi-int4 forward decode steps, alternating rounds;
#   4. the eager batch-1 rows of bench_generate (fp16, kivi-int4, quanto-int4; 1k + 256 and 32k + 64; 3 repeats).
. eval/device_env.sh
KIVI_TEST_GPU=1 timeout 120 python -m pytest -q tests/test_gpu.py \
    -k "cached_launches or inside_generate or synchronize or step_logits" > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
for i in 1 2; do
    timeout 45 python eval/host_decode_probe.py --op-only --out "$OUT/op_host_$i.json" 2>&1 | tail -1 | cut -c1-220
done
timeout 100 python eval/host_decode_probe.py --rounds 3 --steps 32 --out "$OUT/host_decode_probe.json" \
    > "$OUT/host_decode_probe.log" 2>&1
echo "host probe rc=$?"; grep -A16 '^{$' "$OUT/host_decode_probe.log" | head -18
timeout 300 python eval/bench_generate.py --models llama3-8b --cases short,long \
    --caches fp16,kivi-int4,quanto-int4 --repeats 3 --time-budget 290 --out "$OUT/bench_generate_b1eager.json" \
    2>&1 | grep -v "it/s\|run/s" | tail -14

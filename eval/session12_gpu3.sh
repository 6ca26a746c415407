#!/usr/bin/env bash
# Session 12, third device call (run tool, kind nvidia-h200, timeout_s 600; ~9 minutes):
#   1. the flush steps' host cost (eval/host_decode_probe.py --flush-probe), uploads through pinned memory (default)
#      and from pageable memory (KIVI_UPLOAD=pageable, an experiment knob removed after this run), alternating;
#   2. the compiled batch-1 pair at 1k (fp16 StaticCache vs StaticQuantizedPagedCache, 2 repeats);
#   3. the static cache at eager's max batch (4k x 320; eager measured in session12_check.sh), with what time is left.
. eval/device_env.sh
for mode in pinned pageable pinned pageable; do
    KIVI_UPLOAD=$mode timeout 40 python eval/host_decode_probe.py --flush-probe 96 \
        --out "$OUT/flush_probe_$mode.$RANDOM.json" 2>&1 | tail -2 | sed "s/^/$mode /" | cut -c1-200
done
timeout 200 python eval/bench_generate.py --models llama3-8b --cases short --caches fp16-static,kivi-int4-static \
    --repeats 2 --time-budget 190 --out "$OUT/bench_generate_compiled1k.json" 2>&1 | grep -v "it/s\|run/s" | tail -5
timeout 300 python eval/bench_generate.py --models llama3-8b --cases maxbatch --batch-prompts 4096 \
    --caches kivi-int4-static --maxbatch-at kivi-int4-static:4096:320 --time-budget 290 \
    --out "$OUT/bench_generate_static_mb.json" 2>&1 | grep -v "it/s\|run/s" | tail -5

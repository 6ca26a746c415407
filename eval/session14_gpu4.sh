#!/usr/bin/env bash
# Session 14's fourth device call (no .whl needed): the session's final code (block table spare columns, the
# runner's two templates, the in-kernel merge of up to 256 partials, the shared workspace), measured:
#   1. in-process A/B fp16 vs kivi at 32k, 10 rounds (the host's slow phases make single rounds useless);
#   2. the eager batch-1 generate rows (fp16, kivi-int4; 1k + 256, 32k + 64; 3 repeats).
. eval/device_env.sh
timeout 170 python eval/host_decode_probe.py --variants fp16,kivi --prompt 32768 --rounds 10 --steps 24 \
    --out "$OUT/host_variants_32k.json" 2>&1 | tail -8 | tr -d '\n ' | cut -c1-300; echo
timeout 230 python eval/bench_generate.py --models llama3-8b --cases short,long --caches fp16,kivi-int4 \
    --repeats 3 --time-budget 220 --out "$OUT/bench_generate_b1eager.json" 2>&1 | grep -v "it/s\|run/s" \
    | grep "llama3-8b\|rows" | tail -8

# Session 38: the three device items left by session 37 (eval/NOTES.md, "Session 37", "Next session"), in one call
# (~8 minutes of the 10-minute limit; each step has its own timeout so a hang costs only that step).
# Device command (no carry):  bash eval/next_device.sh
#   1. clock: the L2-resident (hot32) and DRAM decode timings again, with back-to-back bursts under the SM clock
#      and power sampler (ab_decode --burst-ms): is the 7-22% gap clock or memory?
#   2. ncu: stall reasons and pipes of the 2- and 4-bit decode kernels, L2-resident against DRAM, 32 KV heads.
#   3. ksz256: DecodeTuning.ksz=1 at head_dim 256 for 4/2 g64 and 4/4 g32 (on by default only at 64 and 128).
# Results under $OUT: ab_hot_clock.{json,log}, ncu_kv32_b{2,4}{,_hot}.txt, ab_ksz_d256.{json,log}.
. eval/device_env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
steps=${1:-clock,ncu,ksz256}
if [[ ,$steps, == *,clock,* ]]; then
    timeout 150 python3 eval/ab_decode.py --graph --hot 32 --burst-ms 1500 --rounds 2 --shapes 8x32x32768 \
        --bits 4/4/32,2/2/32 --out "$OUT/ab_hot_clock.json" > "$OUT/ab_hot_clock.log" 2>&1; echo "clock rc $?"
    tail -12 "$OUT/ab_hot_clock.log"
fi
if [[ ,$steps, == *,ncu,* ]]; then
    for cfg in "2 --hot" "2" "4 --hot" "4"; do
        set -- $cfg
        timeout 70 ncu --clock-control none --kernel-name regex:_decode_split --launch-skip 3 --launch-count 1 \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
            --section Occupancy --print-details all python3 eval/ncu_decode.py --bits "$1" --kv-heads 32 ${2:-} \
            > "$OUT/ncu_kv32_b$1${2:+_hot}.txt" 2>&1; echo "ncu bits $1 ${2:-dram} rc $?"
    done
    grep -hE "^  ncu|Duration|DRAM Throughput|Issue Slots Busy|No Eligible|Stall" "$OUT"/ncu_kv32_*.txt | head -40
fi
if [[ ,$steps, == *,ksz256,* ]]; then
    timeout 170 python3 eval/ab_decode.py --graph --head-dim 256 --q-heads 16 --rounds 3 --tuning ksz1:ksz=1 \
        --shapes 8x8x32768 --bits 4/2/64,4/4/32 --out "$OUT/ab_ksz_d256.json" > "$OUT/ab_ksz_d256.log" 2>&1
    echo "ksz256 rc $?"; tail -8 "$OUT/ab_ksz_d256.log"
fi

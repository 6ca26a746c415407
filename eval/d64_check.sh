# head_dim 64 (SmolLM2, Llama-3.2-1B shapes). Session 29 (Triton 3.6): A/B of the then-default VHINT (off at head_dim 64)
# against the hint forced on, and against a 168-register cap with the hint on: the hint 3-11% faster at int4 (since
# session 30 `auto` turns it on there for 4/4 bits; the 3.6 half now compares that default with the same variants).
# Then, if .t39 is carried (eval/pack_triton.sh; carry [".t39"]), the same shapes under Triton 3.9 against a
# 168-register cap (session 30: the cap mixed; 2/2 bits 21-27% faster than under 3.6). SKIP36=1 runs the 3.9 half
# alone, T39 its limit. Device command: bash eval/d64_check.sh   (~4 minutes without .t39, ~8 with)
. eval/device_env.sh
SHAPES=32x8x32768,8x8x32768,1x8x131072
[ -n "${SKIP36:-}" ] || timeout 170 python3 eval/ab_decode.py --graph --head-dim 64 --shapes $SHAPES --bits 4/4/32,2/2/32 \
    --tuning hint:vhint=1 --tuning hint168:vhint=1,maxnreg=168 \
    --out "$OUT/ab_d64_t36.json" > "$OUT/ab_d64_t36.log" 2>&1; echo "3.6 rc $?"
[ -n "${SKIP36:-}" ] || grep -E " d64 " "$OUT/ab_d64_t36.log"  # SKIP36=1: the 3.9 half alone (session 30)
[ -f .t39/triton39.tar.xz ] || exit 0
carried_triton || exit 1
timeout ${T39:-230} python3 eval/ab_decode.py --graph --head-dim 64 --shapes $SHAPES --bits 4/4/32,2/2/32 \
    --tuning r168:maxnreg=168 \
    --out "$OUT/ab_d64_t39.json" > "$OUT/ab_d64_t39.log" 2>&1; echo "3.9 rc $?"
grep -E " d64 " "$OUT/ab_d64_t39.log"

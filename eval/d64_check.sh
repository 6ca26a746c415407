# head_dim 64 (SmolLM2, Llama-3.2-1B shapes), never timed: under the image's Triton 3.6 the `auto` VHINT keeps the hint
# off there (168 registers, 12 warps per SM; hinted 187, 8 warps: sass_vhint_s27.json). A/B of the default against
# the hint forced on, and against a 168-register cap with the hint on. Then, if .t39 is carried (eval/pack_triton.sh;
# carry [".t39"]), the same under Triton 3.9 (187 registers with or without the hint; a 168 cap gives 12 warps with
# 3 loop spills, SASS only). Device command: bash eval/d64_check.sh   (~4 minutes without .t39, ~8 with)
. eval/device_env.sh
SHAPES=32x8x32768,8x8x32768,1x8x131072
[ -n "${SKIP36:-}" ] || timeout 170 python3 eval/ab_decode.py --graph --head-dim 64 --shapes $SHAPES --bits 4/4/32,2/2/32 \
    --env hint:KIVI_DECODE_VHINT=1 --env hint168:KIVI_DECODE_VHINT=1,KIVI_DECODE_MAXNREG=168 \
    --out "$OUT/ab_d64_t36.json" > "$OUT/ab_d64_t36.log" 2>&1; echo "3.6 rc $?"
[ -n "${SKIP36:-}" ] || grep -E " d64 " "$OUT/ab_d64_t36.log"  # SKIP36=1: the 3.9 half alone (session 30)
[ -f .t39/triton39.tar.xz ] || exit 0
carried_triton || exit 1
timeout ${T39:-230} python3 eval/ab_decode.py --graph --head-dim 64 --shapes $SHAPES --bits 4/4/32,2/2/32 \
    --env r168:KIVI_DECODE_MAXNREG=168 \
    --out "$OUT/ab_d64_t39.json" > "$OUT/ab_d64_t39.log" 2>&1; echo "3.9 rc $?"
grep -E " d64 " "$OUT/ab_d64_t39.log"

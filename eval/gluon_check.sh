# The Gluon decode kernel's first GPU call (eval/gluon/README.md; built and emulated on the CPU in session 28, never
# run): correctness of every case against the reference and the existing kernel, then the A/B at the shapes
# (CUDA graphs, same splits, both merged by decode_reduce, empty residual window for both). Triton 3.6 (the image).
# Device command (no carry): bash eval/gluon_check.sh   (~6-8 minutes by the CPU estimate)
. eval/device_env.sh
timeout 240 python3 eval/gluon/check.py > "$OUT/gluon_check.log" 2>&1; echo "check rc $?"
tail -25 "$OUT/gluon_check.log"
timeout 320 python3 eval/gluon/ab_gluon.py --out "$OUT/ab_gluon.json" > "$OUT/ab_gluon.log" 2>&1; echo "ab rc $?"
tail -30 "$OUT/ab_gluon.log"

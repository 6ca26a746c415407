# The kernels under the newest Triton on the GPU (issue 3: "run under triton 3.6.0 (the GPU image) and the newest
# triton"). The GPU image has Triton 3.6; a newer wheel (~286 MB) exceeds the device tool's 64 MiB carry, so it
# travels trimmed: `eval/pack_triton.sh` (here) writes `.t39/triton39.tar.xz` (the nvidia backend only, libtriton.so
# stripped of its static symbol table, no profiler/cupti/AMD files; ~57 MB). Device command (carry [".t39"]):
#     bash eval/newest_triton_check.sh
# Writes under $OUT: ab_triton36.{json,log} (decode A/B under the image's Triton, the baseline), ab_triton39.*
# (the same under the carried one), gpu_tests_triton39_kernels.log, gpu_tests_triton39_gpu.log.
. eval/device_env.sh
ab="eval/ab_decode.py --graph --rounds 2 --shapes 32x8x32768,1x8x131072 --bits 4/4/32,2/2/32"
carried_triton || exit 1
timeout 110 python3 $ab --out "$OUT/ab_triton39.json" > "$OUT/ab_triton39.log" 2>&1; echo "ab 3.9 rc $?"
KIVI_TEST_GPU=1 timeout 300 python3 -m pytest -q tests/test_api.py tests/test_quantize.py tests/test_dequant.py tests/test_decode*.py tests/test_prefix.py tests/test_sinks.py tests/test_unpack_ptx.py \
    > "$OUT/gpu_tests_triton39_kernels.log" 2>&1; echo "kernel tests rc $?"
tail -3 "$OUT/gpu_tests_triton39_kernels.log"
# the model-level GPU tests that do not go through torch.compile (torch 2.11's inductor is built against Triton 3.6)
KIVI_TEST_GPU=1 timeout 110 python3 -m pytest -q tests/test_gpu.py -k "not compile" \
    > "$OUT/gpu_tests_triton39_gpu.log" 2>&1; echo "gpu tests rc $?"
tail -3 "$OUT/gpu_tests_triton39_gpu.log"
# the baseline last (the tests matter more if time runs out): the same A/B under the image's Triton
export PYTHONPATH=${PYTHONPATH#/tmp/t39:}; unset TRITON_BACKENDS_IN_TREE
python3 -c "import triton; print('image triton', triton.__version__)"
timeout 80 python3 $ab --out "$OUT/ab_triton36.json" > "$OUT/ab_triton36.log" 2>&1; echo "ab 3.6 rc $?"

# Packs a Triton wheel for the GPU machine's 64 MiB carry limit: `bash eval/pack_triton.sh [VERSION]` (default 3.9.0)
# writes .t39/triton39.tar.xz (git-ignored through .git/info/exclude). Kept: the Python package, the nvidia backend
# (cuobjdump, nvdisasm, libdevice, headers; ptxas-blackwell, the CUDA 13 ptxas that Triton 3.9 runs for sm_90 and up,
# with `ptxas` (CUDA 12.9, for older GPUs) replaced by a link to it), libtriton.so with `strip --strip-unneeded` (its dynamic symbols
# stay: checked by building every sm_90 variant of tests/test_sass.py with a stripped 3.9 on the CPU). Dropped: the
# AMD backend (and its entry point), cupti, the proton profiler library, test libraries.
# Unpack on the device with `tar -xJf .t39/triton39.tar.xz -C DIR`, put DIR first on PYTHONPATH and set
# TRITON_BACKENDS_IN_TREE=1 (eval/newest_triton_check.sh). About 3 minutes here (xz -9).
set -euo pipefail
version=${1:-3.9.0}
cd "$(dirname "$0")/.."
work=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$work" "triton==$version"
(cd "$work" && unzip -q triton-*.whl && rm triton-*.whl)
t=$work/triton
rm -rf "$t/backends/amd" "$t"/backends/nvidia/lib/cupti* \
    "$t/_C/libproton.so" "$t/instrumentation" "$t/FileCheck" "$t/plugins/libTritonPluginsTestLib.so"
strip --strip-unneeded "$t/_C/libtriton.so"
ln -sfn ptxas-blackwell "$t/backends/nvidia/bin/ptxas"
sed -i '/^amd = /d' "$work"/triton-*.dist-info/entry_points.txt
mkdir -p .t39
grep -qx "/.t39/" .git/info/exclude 2>/dev/null || echo "/.t39/" >> .git/info/exclude
(cd "$work" && tar -cf - triton triton-*.dist-info) | xz -T0 -9 > .t39/triton39.tar.xz
rm -rf "$work"
ls -la .t39/triton39.tar.xz

# Sourced by a device command (`. eval/device_env.sh && python eval/...`), from the repository root on the device machine: $OUT, the
# kivi_cache/kernels link, PYTHONPATH (plus the quanto wheel's /tmp/site when .whl/ was carried), unbuffered
# output; prints the GPU's name.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
    export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name --format=csv,noheader

# carried_triton: unpack the Triton that .t39/triton39.tar.xz carries (eval/pack_triton.sh) and put it first on the path,
# with its backends read from its own folder (not from the image's 3.6 entry points)
carried_triton() {
    mkdir -p /tmp/t39 && tar -xJf .t39/triton39.tar.xz -C /tmp/t39 || return 1
    export PYTHONPATH=/tmp/t39:$PYTHONPATH TRITON_BACKENDS_IN_TREE=1
    python3 -c "import triton; print('carried triton', triton.__version__, triton.__file__)"
}

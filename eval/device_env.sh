# Sourced by a device command (`. eval/device_env.sh && python eval/...`), from the repository root on the device machine: $OUT, the
# kivi_cache/kernels link, PYTHONPATH (plus the quanto wheel's /tmp/site when .whl/ was carried), unbuffered
# output; prints the GPU's name.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ln -sfn ../kernels kivi_cache/kernels
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
    export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name --format=csv,noheader

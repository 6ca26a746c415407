"""Host (Python) time of the cache's bookkeeping at a large batch, no GPU needed: one-token decode steps of
one layer (``update`` + ``commit`` + device state; the quantize op stubbed so only the host work is timed)
and the block-table build at a flush. CPU tensors of a tiny head (1 head x 32 channels): what is measured is
the per-sequence Python work, which does not depend on the tensor sizes.

    python eval/host_probe.py [--batch 892] [--out eval/results/host_probe.json]
With ``PYTHONPATH`` at another checkout it times that version (session 6 compared 56062ab, its start).
"""

import argparse
import json
import platform
import statistics
import time

import torch

import kivi_cache
import kivi_cache.layer as L
from kivi_cache import Int4PagedCache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=892)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default="eval/results/host_probe.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    L.ops.quantize_and_write = lambda *a, **k: None  # host work only
    b = args.batch
    # preallocated (num_pages: also what older versions of the library take), so no growth is timed
    cache = Int4PagedCache(num_pages=b * -(-(args.prompt + args.steps) // 64))
    k = torch.randn(b, 1, args.prompt, 32)
    cache.update(k, k, 0)
    layer = cache.layers[0]
    layer.commit(layer.pending)
    one = torch.randn(b, 1, 1, 32)
    steps, flushes = [], []
    for _ in range(args.steps):
        q0 = layer.paged_lens[0]
        t0 = time.perf_counter()
        cache.update(one, one, 0)
        layer.commit(layer.pending)
        layer._device_state()
        (flushes if layer.paged_lens[0] != q0 else steps).append(time.perf_counter() - t0)
    builds = []
    for _ in range(20):
        layer._device_tables = None
        t0 = time.perf_counter()
        layer._device_state()
        builds.append(time.perf_counter() - t0)
    res = dict(batch=b, prompt=args.prompt, pages_per_sequence=len(layer.tables[0]),
               step_us_median=statistics.median(steps) * 1e6, step_us_max=max(steps) * 1e6,
               flush_step_ms=[round(x * 1e3, 3) for x in flushes],
               block_table_build_ms_median=statistics.median(builds) * 1e3,
               machine=dict(platform=platform.platform(), processor=platform.processor(), torch=torch.__version__,
                            python=platform.python_version(), kivi_cache=kivi_cache.__version__, threads=1))
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

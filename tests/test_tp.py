"""Tensor parallelism (transformers' ``tp_plan="auto"``): two ``torchrun`` processes on the CPU (gloo) each hold half
of a tiny GQA Llama's KV heads; every cache (``Int8PagedCache``, ``Int4PagedCache``, ``StaticQuantizedPagedCache``)
and continuous batching on int4 pages give the tokens of one process, and each rank's cache holds half the bytes.
The ranks run tests/tp_worker.py. (Continuous batching on transformers >= 5.24 only.)"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from models import tiny_llama_d64

import kivi_cache

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "tp_worker.py")


def _run(args, tmp_path, name):
    out = tmp_path / f"{name}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    proc = subprocess.run([sys.executable, *args, "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def test_two_ranks_give_one_process_tokens_with_half_the_bytes(tmp_path):
    model = tiny_llama_d64()  # 4 query heads, 2 KV heads: one KV head per rank
    model.save_pretrained(tmp_path / "model")
    one = _run([WORKER, str(tmp_path / "model")], tmp_path, "one")
    two = _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", WORKER, str(tmp_path / "model")], tmp_path,
               "two")
    assert one["world_size"] == 1 and two["world_size"] == 2
    engine = kivi_cache.cb.unsupported_reason() is None  # continuous batching on quantized pages: transformers >= 5.24
    for name in ("dynamic", "int8", "int4", "static", *(("cb_fp", "cb_int4") if engine else ())):
        assert two[name] == one[name], f"{name}: tokens differ under tensor parallelism"
    if engine:
        assert one["cb_int4"] == one["int4"]
    for name in ("int8", "int4", "static"):
        assert (one[f"{name}_kv_heads"], two[f"{name}_kv_heads"]) == (2, 1)
        assert two[f"{name}_live_bytes"] * 2 == one[f"{name}_live_bytes"], name

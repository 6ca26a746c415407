"""benchmarks/tp.py on a tiny Llama, fp32 on the CPU: once in this process (one rank, the model whole) and once under
``torch.distributed.run`` with two ranks (gloo; transformers' tensor parallelism, one KV head per rank). Every cache
has a row per shape; the two ranks generate the tokens of the single process, and each rank's cache holds half of
its bytes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_scripts import BENCH, load_script

S = load_script("tp")
ROOT = BENCH.parent
CACHES = ["fp16", "fp16-static", "kivi-int4", "kivi-int4-static"]
SHAPES = ["1x64", "2x160"]  # 160 + 8 tokens: 128 of them leave the 128-token window and are quantized


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    one, two = tmp / "one.json", tmp / "two.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("WORLD_SIZE", None)
    # two ranks, in the background while the single process runs here (--standalone: a free rendezvous port)
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(BENCH / "tp.py"), "--quick", "--commit", "abc1234", "--out", str(two)],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        saved = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ}
        try:
            rec = S.main(["--quick", "--commit", "abc1234", "--out", str(one)])
        finally:
            os.environ.update(saved)
        stdout, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stdout[-4000:]
    return rec, json.loads(one.read_text()), json.loads(two.read_text()), stdout


def _rows(data):
    return {(r["shape"], r["cache"]): r for r in data["rows"]}


def test_a_row_for_every_cache_and_shape(runs):
    rec, one, two, stdout = runs
    assert rec["rows"] == one["rows"]
    for data, world in ((one, 1), (two, 2)):
        assert data["benchmark"] == "tp" and data["commit"] == "abc1234" and data["world_size"] == world
        assert data["complete"] and data["settings"]["shapes"] == SHAPES and data["model_shapes"]["kv_heads"] == 2
        assert data["kv_heads_per_rank"] == 2 // world and len(data["weight_bytes_per_rank"]) == world
        rows = _rows(data)
        assert sorted(rows) == sorted((s, c) for s in SHAPES for c in CACHES)
        for r in rows.values():
            assert r["status"] == "ok" and r["error"] is None, r
            assert r["world_size"] == world and r["new"] == 8 and r["repeats"] == 2 and r["decode_steps"] == 6
            assert r["decode_tok_s"] > 0 and r["step_ms"] > 0 and r["prefill_s"] > 0
            assert len(r["step_ms_per_rank"]) == len(r["kv_bytes_per_rank"]) == world
            assert r["ranks_agree"] and r["tokens_stable"] and len(r["first_tokens"]) == 8
            assert r["first_tokens"] == r["tokens_by_seq"][0] and len(r["tokens_by_seq"]) == r["batch"]
            assert r["peak_bytes"] is None and not r["compiled"]  # CPU: no CUDA memory, the static caches eager
    from transformers import LlamaForCausalLM

    built = hasattr(LlamaForCausalLM, "prepare_distribute_model")  # else (transformers < 5.24) loaded from disk
    sharded = "build: random weights on every rank" if built else "disk: save_pretrained by rank 0"
    assert sharded in two["load"] and "q_proj" in " ".join(two["tp_plan"])
    from kivi_cache.compat import CACHE_KEYWORD_SINCE, transformers_version

    if built and transformers_version() >= CACHE_KEYWORD_SINCE:  # the sharded weights: half per rank (the norms
        # and the rotary buffers whole on each); 5.17's parameters report their full sizes, so there only the KV
        # bytes above are checked
        whole = one["weight_bytes_per_rank"][0]
        assert all(0.5 * whole < w < 0.51 * whole for w in two["weight_bytes_per_rank"])
    assert "tok/s" in stdout and "first tokens" in stdout and "one-GPU file and a TP file" in stdout


def test_two_ranks_give_one_process_tokens_with_half_the_kv_bytes(runs):
    _, one, two, _ = runs
    a, b = _rows(one), _rows(two)
    for key, r1 in a.items():
        r2 = b[key]
        assert r2["tokens_by_seq"] == r1["tokens_by_seq"], f"{key}: tokens differ under tensor parallelism"
        assert r2["first_tokens"] == r1["first_tokens"]
        assert r2["kv_bytes_per_rank"][0] == r2["kv_bytes_per_rank"][1], key
        assert 2 * r2["kv_bytes"] == r1["kv_bytes"], key  # fp16 and quantized caches alike
    # the quantized caches did quantize at 2x160 (tokens past the window), and hold less than fp16
    for cache in ("kivi-int4", "kivi-int4-static"):
        assert a[("2x160", cache)]["quantized_tokens"] > 0
        assert b[("2x160", cache)]["kv_bytes"] < b[("2x160", "fp16")]["kv_bytes"]


def test_options_and_names(tmp_path):
    assert S.parse_shapes("1x1024, 32X32768") == [(1, 1024), (32, 32768)]
    for bad in ("1y3", "0x5", ""):
        with pytest.raises(SystemExit):
            S.parse_shapes(bad)
    args = S.parse_args([])
    assert args.model == "llama3-8b" and args.new_tokens == 64 and args.caches == CACHES
    assert args.shape_list == [(1, 1024), (32, 1024), (1, 32768), (32, 32768)]
    with pytest.raises(SystemExit):
        S.parse_args(["--caches", "fp16,int3"])
    name = S.result_path(S.parse_args([]), {"machine": {"gpu": "NVIDIA H100 80GB HBM3"}}, 2).name
    assert name.startswith("tp_h100x2_") and name.endswith(".json") and "quick" not in name
    assert S.result_path(S.parse_args(["--out", str(tmp_path / "x.json")]), {}, 1) == tmp_path / "x.json"
    # KV predicted per rank: fp16 exactly, the quantized caches about a quarter of it (plus the window)
    shapes = dict(layers=32, kv_heads=8, head_dim=128, kv_bytes_per_token_fp=2 * 32 * 8 * 128 * 2)
    fp = S.kv_predicted("fp16", shapes, 32, 32768, 2)
    assert fp == 32 * 32768 * 131072 / 2
    assert 0.25 * fp < S.kv_predicted("kivi-int4", shapes, 32, 32768, 2) < 0.35 * fp
    assert Path(S.__file__).name == "tp.py"

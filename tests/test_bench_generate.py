"""eval/bench_generate.py: a --quick run on the CPU writes a row per requested cache and case."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "eval" / "bench_generate.py"
CACHES = ["fp16", "kivi-int4", "quanto-int4"]  # quanto: measured, or skipped with the ImportError text
CASES = ["short", "long", "ctx", "maxbatch"]


def _run(out, *extra, timeout=300):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out),
           "--caches", ",".join(CACHES), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _number(x):
    return isinstance(x, (int, float)) and x == x and x not in (float("inf"), float("-inf"))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_generate.json"
    proc = _run(out, "--profile")
    return out, json.loads(out.read_text()), proc.stdout


def test_rows_for_every_cache_and_case(quick_run):
    _, data, stdout = quick_run
    rows = data["rows"]
    for cache in CACHES:
        for case in CASES:
            mine = [r for r in rows if r["cache"] == cache and r["case"] == case]
            assert mine, f"no row for {cache} / {case}"
            for r in mine:
                assert r["status"] in ("ok", "error", "skipped")
                if r["status"] != "ok":
                    assert isinstance(r["error"], str) and r["error"], r
                    continue
                assert _number(r["kv_bytes_per_token"]) and r["kv_bytes_per_token"] > 0
                assert _number(r["kv_bytes_per_token_theory"])
                if case != "ctx":
                    assert _number(r["decode_step_ms"]) and _number(r["prefill_s"]), r
                    assert _number(r["step_ms_timer"]) and r["step_ms_timer"] > 0, r
                    # (t_N - t_1) / (N - 1) of a tiny CPU model can come out <= 0 on a loaded machine
                    assert r["decode_step_ms"] <= 0 or (_number(r["decode_tok_s"]) and r["decode_tok_s"] > 0), r
    # the caches that need nothing extra do run
    for cache in ("fp16", "kivi-int4"):
        assert all(r["status"] == "ok" for r in rows if r["cache"] == cache), [r for r in rows if r["cache"] == cache]
    quanto = [r for r in rows if r["cache"] == "quanto-int4"]
    if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.quanto") is None:
        assert all(r["status"] == "skipped" and "quanto" in r["error"].lower() for r in quanto)
    # max batch: the CPU has no budget, so the search stops at the cap
    mb = [r for r in rows if r["case"] == "maxbatch" and r["status"] == "ok"]
    assert mb and all(r["batch"] == 4 and r["capped"] and r["search"] for r in mb)
    assert all(r["prefill_chunk"] == 16 for r in mb)  # chunked prefill: 64 tokens per forward over 4 sequences
    # settings, environment, table
    meta = data["meta"]
    for key in ("torch", "transformers", "triton", "device", "quanto"):
        assert key in meta
    assert data["models"]["tiny"]["layers"] == 2
    assert "prompt+new" in stdout and "tok/s" in stdout
    kivi_long = [r for r in rows if r["cache"] == "kivi-int4" and r["case"] == "long"][0]
    assert kivi_long["kv_report"]["quantized_tokens"] > 0
    assert data["memory_arithmetic"]
    # profile table
    prof = data["profile"][0]
    assert prof["model"] == "tiny" and prof["top"] and "error" not in prof
    assert any(Path(p).suffix == ".png" and Path(p).exists() for p in data.get("plots", []))


def test_resume_reruns_only_missing_rows(quick_run, tmp_path):
    out, data, _ = quick_run
    data = json.loads(out.read_text())
    target = next(r for r in data["rows"] if r["case"] == "short" and r["cache"] == "kivi-int4")
    target.update(status="skipped", skip_reason="time budget", error="time budget (test)")
    for k in ("decode_tok_s", "t_N_s"):
        target.pop(k, None)
    path = tmp_path / "resume.json"
    path.write_text(json.dumps(data))
    _run(path, "--resume", "--cases", "short", "--no-plot")
    new = json.loads(path.read_text())
    assert len(new["rows"]) == len(data["rows"])
    row = next(r for r in new["rows"] if r["case"] == "short" and r["cache"] == "kivi-int4")
    assert row["status"] == "ok" and row["decode_tok_s"] > 0


def test_find_max_batch():
    spec = importlib.util.spec_from_file_location("bench_generate", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for true_max in (1, 2, 7, 37, 100, 513):
        for start, tol in ((1, 0.0), (true_max, 0.0), (max(1, true_max * 9 // 10), 0.04), (true_max * 2, 0.04)):
            tried = []

            def fits(b, tried=tried, true_max=true_max):
                tried.append(b)
                return b <= true_max

            lo, hi = mod.find_max_batch(fits, start, 4096, tol)
            assert lo <= true_max and (hi is None or hi > true_max)
            assert true_max - lo <= max(1, tol * true_max) if tol else lo == true_max
            assert len(tried) <= 4 * (true_max.bit_length() + 2)
    lo, hi = mod.find_max_batch(lambda b: True, 1, 16, 0.0)
    assert (lo, hi) == (16, None)
    lo, hi = mod.find_max_batch(lambda b: False, 8, 16, 0.0)
    assert lo == 0


def _load():
    spec = importlib.util.spec_from_file_location("bench_generate_mod", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_max_batch_search_against_a_memory_model(monkeypatch, tmp_path):
    """The GPU path of the search, with a fake generate whose peak memory grows linearly in the batch."""
    import time
    from types import SimpleNamespace

    import torch

    mod = _load()
    gib, mib = 1 << 30, 1 << 20
    budget, weights, per_seq = 80 * gib, 14 * gib, 150 * mib
    true_max = (budget - weights) // per_seq
    calls = []

    def fake_run(ctx, cache, b, p, new, keep_cache=False, chunked=False):
        assert chunked  # max-batch runs prefill in chunks
        calls.append((b, new))
        peak = weights + b * per_seq
        if peak > budget:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        res = dict(t=0.5 + 0.02 * b + 0.03 * new, peak=peak, ttft=0.5 + 0.02 * b, step_timer=0.03, generated=new,
                   prefill_chunk=None)
        if keep_cache:
            res["cache_stats"] = dict(kv_bytes_per_token=1.0)
        return res

    monkeypatch.setattr(mod, "run_generate", fake_run)
    args = mod.parse_args(["--batch-new", "64", "--trial-new", "16", "--time-budget", "1000"])
    base = dict(model="m", case="maxbatch", cache="fp16", batch=None, prompt=1024, new=64)
    runner = mod.Runner(args, SimpleNamespace(cuda=True), {"available": True}, str(tmp_path / "x.json"))
    row = mod.one_max_batch(runner, dict(budget_bytes=budget), base, "fp16", 1024, budget)
    assert row["status"] == "ok", row
    assert true_max * (1 - args.batch_tol) - 1 <= row["batch"] <= true_max < row["batch_oom"]
    assert calls[:2] == [(64, 16), (128, 16)]  # probes: a full 65536-token prefill forward each
    big = [b for b, n in calls if b > 128 and n == 16]
    assert len(big) <= 4, calls
    assert calls[-1] == (row["batch"], 64)  # the measurement at the batch found
    assert abs(row["decode_step_ms"] - 30.0) < 1e-6 and row["decode_tok_s"] > 0
    # too little time: the search stops early with the best batch so far, or the row is skipped
    calls.clear()
    runner.model_deadline = time.perf_counter() + 2.0
    row = mod.one_max_batch(runner, dict(budget_bytes=budget), base, "fp16", 1024, budget)
    assert row["search_stopped_early"] and row["batch"] == 128
    assert all(b <= 128 for b, _ in calls)


def test_static_caches_run(tmp_path):
    """The compiled-decoding rows (opt-in caches) run end to end (on CPU generate does not compile)."""
    out = tmp_path / "static.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out), "--no-plot",
           "--caches", "fp16-static,kivi-int4-static", "--cases", "short,long"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["cache"], r["case"]) for r in rows} == {(c, k) for c in ("fp16-static", "kivi-int4-static")
                                                       for k in ("short", "long")}
    assert all(r["status"] == "ok" and r["decode_step_ms"] == r["decode_step_ms"] for r in rows), rows

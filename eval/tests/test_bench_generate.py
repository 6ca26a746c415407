"""eval/bench_generate.py: a --quick run on the CPU writes a row per requested cache and case."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from eval_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
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
    # trials generate --batch-new tokens by default: the search's trial at the batch found is the measurement
    assert all(r["measured_in_search"] and r["trial_new"] == r["new"] == 6 and r["t_trial_s"] is None for r in mb)
    assert all(r["t_N_s"] == [r["search"][-1]["t"]] for r in mb if r["search"][-1]["batch"] == 4)
    # the best rate among fitting trials (at least the rate at the batch found: that trial is one of them)
    assert all(r["best_fit_tok_s"] >= r["decode_tok_s"] * (1 - 1e-9) and r["best_fit_batch"] <= 4 for r in mb)
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


def test_best_fit_rate_takes_the_fastest_fitting_trial():
    mod = _load()
    trials = [dict(batch=96, ok=True, new=64, step_timer=0.1199), dict(batch=112, ok=True, new=64, step_timer=0.1279),
              dict(batch=120, ok=True, new=64, step_timer=0.2049), dict(batch=124, ok=False, new=64),
              dict(batch=200, ok=True, new=16, step_timer=0.1)]  # other token count: not comparable
    r = mod.best_fit_rate(trials, 64)
    assert r["best_fit_batch"] == 112 and abs(r["best_fit_tok_s"] - 112 / 0.1279) < 1e-9
    assert mod.best_fit_rate([], 64) == {}


def test_find_max_batch():
    mod = _load()
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
    # known outcomes (a resumed search): never asked again, nor batches they decide (fits are monotone)
    tried = []
    lo, hi = mod.find_max_batch(lambda b: tried.append(b) or b <= 100, 40, 4096, 0.04,
                                known={40: True, 44: True, 52: True, 90: True, 130: False})
    assert lo <= 100 < hi and 100 - lo <= 4 and tried and all(90 < b < 130 for b in tried), tried
    lo, hi = mod.find_max_batch(lambda b: True, 1, 16, 0.0)
    assert (lo, hi) == (16, None)
    lo, hi = mod.find_max_batch(lambda b: False, 8, 16, 0.0)
    assert lo == 0


def _load():
    return load_script("bench_generate")


def test_max_batch_search_against_a_memory_model(monkeypatch, tmp_path):
    """The GPU path of the search, with a fake generate whose peak memory grows linearly in the batch."""
    import time
    from types import SimpleNamespace

    mod = _load()
    gib, mib = 1 << 30, 1 << 20
    budget, weights, per_seq = 80 * gib, 14 * gib, 150 * mib
    true_max = (budget - weights) // per_seq
    calls = []
    fake_run = _fake_gpu_generate(calls, budget, weights, per_seq)

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


def _fake_gpu_generate(calls, budget, weights, per_seq, t_per_seq=0.02):
    """A generate whose peak memory grows linearly in the batch and that OOMs above the budget."""
    import torch

    def fake_run(ctx, cache, b, p, new, keep_cache=False, chunked=False):
        assert chunked  # max-batch runs prefill in chunks
        calls.append((b, new))
        peak = weights + b * per_seq
        if peak > budget:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")
        res = dict(t=0.5 + t_per_seq * b + 0.03 * new, peak=peak, ttft=0.5 + t_per_seq * b, step_timer=0.03,
                   generated=new, prefill_chunk=None)
        if keep_cache:
            res["cache_stats"] = dict(kv_bytes_per_token=1.0)
        return res

    return fake_run


def test_max_batch_search_resumes_from_recorded_trials(monkeypatch, tmp_path):
    """--resume: a search cut short (probes and three fits, no OOM yet) continues from its recorded trials
    (none is run again, their peaks feed the prediction) and ends with the measurement; --maxbatch-at measures
    at a given batch without a search."""
    from types import SimpleNamespace

    import torch

    mod = _load()
    gib, mib = 1 << 30, 1 << 20
    budget, weights, per_seq = 80 * gib, 14 * gib, 150 * mib
    true_max = (budget - weights) // per_seq  # 450
    calls = []
    monkeypatch.setattr(mod, "run_generate", _fake_gpu_generate(calls, budget, weights, per_seq))
    args = mod.parse_args(["--batch-new", "64", "--trial-new", "16", "--time-budget", "1000"])
    base = dict(model="m", case="maxbatch", cache="fp16", batch=None, prompt=1024, new=64, budget_bytes=budget)
    runner = mod.Runner(args, SimpleNamespace(cuda=True, device=torch.device("cuda")), {"available": True},
                        str(tmp_path / "x.json"))

    def entry(b, t=None, ok=True):
        if not ok:
            return dict(batch=b, new=16, ok=False, error="OOM: fake", oom=True)
        return dict(batch=b, new=16, ok=True, t=t or 9.0 + b / 1000, peak=weights + b * per_seq, ttft=1.0,
                    step_timer=0.03)

    # a stopped search: its recorded t values (9 + b / 1000) tell reused trials from new ones (0.98 + b / 50)
    recorded = [entry(64), entry(128), entry(380), entry(395), entry(425)]
    row = mod.one_max_batch(runner, dict(budget_bytes=budget), base, "fp16", 1024, budget,
                            prior=dict(search=recorded, source="old.json", started="yesterday"))
    assert row["status"] == "ok", row
    assert true_max * (1 - args.batch_tol) - 1 <= row["batch"] <= true_max < row["batch_oom"]
    assert not {b for b, n in calls if n == 16} & {64, 128, 380, 395, 425}, calls  # nothing recorded rerun
    assert all(b > 425 for b, n in calls if n == 16) and 1 <= len([c for c in calls if c[1] == 16]) <= 3, calls
    assert calls[-1] == (row["batch"], 64)
    assert row["resumed"]["reused_fits"] == [64, 128, 380, 395, 425] and row["resumed"]["source"] == "old.json"
    assert [e["batch"] for e in row["search"] if e.get("reused")] == [64, 128, 380, 395, 425]
    assert row["predicted_from"] == [64, 425] and abs(row["predicted_batch"] - true_max * 0.98 - 27) < 30
    assert row["memory_model"]["bytes_per_seq"] == per_seq  # from the recorded probes

    # the bracket is recorded already (a fit and an OOM within the tolerance): no trial, warm-up + measurement
    calls.clear()
    recorded = [entry(64), entry(128), entry(440), entry(452, ok=False)]
    row = mod.one_max_batch(runner, dict(budget_bytes=budget), base, "fp16", 1024, budget,
                            prior=dict(search=recorded, source="old.json"))
    assert row["status"] == "ok" and (row["batch"], row["batch_oom"]) == (440, 452), row
    assert calls == [(64, 2), (440, 64)], calls  # warm-up at the probe batch, then the measurement
    assert row["t_trial_s"] == 9.44 and row["resumed"]["reused_ooms"] == [452]

    # --maxbatch-at: no search at all
    calls.clear()
    row = mod.one_max_batch(runner, dict(budget_bytes=budget), base, "fp16", 1024, budget, given=300)
    assert row["status"] == "ok" and row["batch"] == 300 and row["batch_given"] and not row["search"], row
    assert calls == [(64, 2), (300, 64)], calls
    assert row["decode_step_ms_tN"] is None and row["decode_tok_s"] > 0
    row = mod.one_max_batch(runner, dict(budget_bytes=budget), base, "fp16", 1024, budget, given=true_max + 5)
    assert row["status"] == "skipped" and row["skip_reason"] == "given batch OOM" and row["oom"], row

    # trials recorded under other settings are not reused
    runner.pending["k"] = dict(search=recorded, budget_bytes=budget)
    runner.pending_src["k"] = dict(file="old.json", settings=dict(prefill_tokens=4096), device="cuda:0")
    prior, note = runner.prior_search("k", budget)
    assert prior is None and "prefill_tokens" in note
    runner.pending_src["k"]["settings"]["prefill_tokens"] = args.prefill_tokens
    assert runner.prior_search("k", budget)[0]["search"] == recorded
    # a kivi row's trials from a run that sized pools by another rule (no prealloc_rule recorded) are not reused
    runner.pending["k"] = dict(search=recorded, budget_bytes=budget, cache="kivi-int4")
    prior, note = runner.prior_search("k", budget)
    assert prior is None and "prealloc_rule" in note
    runner.pending_src["k"]["settings"]["prealloc_rule"] = mod.PREALLOC_RULE
    assert runner.prior_search("k", budget)[0]["search"] == recorded


def test_resume_continues_max_batch_rows_end_to_end(monkeypatch, tmp_path):
    """main(--resume --resume-from --maxbatch-at) on the CPU (tiny model): recorded trials are not rerun,
    rows of caches outside the run stay in the JSON, a given batch is measured without a search."""
    mod = _load()
    real = mod.run_generate
    calls = []

    def counting(ctx, cache, b, p, new, keep_cache=False, chunked=False, **kw):
        if chunked:
            calls.append((cache, b, new))
        return real(ctx, cache, b, p, new, keep_cache=keep_cache, chunked=chunked, **kw)

    monkeypatch.setattr(mod, "run_generate", counting)

    def fit(b, t):
        return dict(batch=b, new=3, ok=True, t=t, peak=None, ttft=0.01, step_timer=0.001)

    def mb_row(cache, status, search=None, **kw):
        return dict(model="tiny", case="maxbatch", cache=cache, batch=None, prompt=48, new=6, status=status,
                    skip_reason="time budget", error="time budget (test)", search=search, **kw)

    settings = dict(prefill_tokens=64, no_prealloc=False, no_expandable=False, quanto_group=64, quanto_residual=128,
                    prealloc_rule=mod.PREALLOC_RULE)
    meta = dict(started="earlier", device="cpu")
    oom4 = dict(batch=4, new=3, ok=False, error="OOM: fake", oom=True)
    out = tmp_path / "out.json"
    out.write_text(json.dumps(dict(meta=meta, settings=settings, models={}, rows=[
        mb_row("kivi-int4", "skipped", [fit(1, 11.0), fit(2, 12.0), oom4]),
        mb_row("fp16", "skipped"),  # not started here; its search is in the other file
        mb_row("quanto-int2", "skipped", [fit(1, 5.0)]),  # not in this run: kept as it is
    ])))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(meta=meta, settings=settings, models={}, rows=[
        mb_row("fp16", "skipped", [fit(1, 41.0), fit(2, 42.0), fit(4, 44.0)])])))
    mod.main(["--quick", "--device", "cpu", "--no-plot", "--cases", "maxbatch", "--caches",
              "fp16,kivi-int4,kivi-kv2", "--resume", "--resume-from", str(other), "--out", str(out), "--trial-new", "3",
              "--maxbatch-at", "kivi-kv2:48:2"])
    rows = {r["cache"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"fp16", "kivi-int4", "kivi-kv2", "quanto-int2"}
    assert rows["quanto-int2"]["status"] == "skipped" and rows["quanto-int2"]["search"][0]["t"] == 5.0
    # kivi-int4: fits at 1, 2 and the OOM at 4 reused (the CPU never runs out of memory): only 3 is tried
    k4 = rows["kivi-int4"]
    assert k4["status"] == "ok" and (k4["batch"], k4["batch_oom"]) == (3, 4), k4
    assert [c for c in calls if c[0] == "kivi-int4"] == [("kivi-int4", 3, 3), ("kivi-int4", 3, 6)], calls
    assert k4["resumed"]["reused_fits"] == [1, 2] and k4["resumed"]["reused_ooms"] == [4]
    # fp16: the whole search recorded (up to the cap) in the --resume-from file: warm-up and measurement only
    f16 = rows["fp16"]
    assert f16["status"] == "ok" and f16["batch"] == 4 and f16["t_trial_s"] == 44.0, f16
    assert [c for c in calls if c[0] == "fp16"] == [("fp16", 1, 2), ("fp16", 4, 6)], calls
    assert f16["resumed"]["source"] == str(other)
    # kivi-kv2: --maxbatch-at, no search
    k2 = rows["kivi-kv2"]
    assert k2["status"] == "ok" and k2["batch"] == 2 and k2["batch_given"] and not k2["search"], k2
    assert [c for c in calls if c[0] == "kivi-kv2"] == [("kivi-kv2", 1, 2), ("kivi-kv2", 2, 6)], calls


def test_resume_measures_again_kivi_rows_of_an_older_pool_rule(monkeypatch, tmp_path):
    """A finished kivi max-batch row of a run whose pools were sized by another rule (no prealloc_rule recorded) is
    searched and measured again; a finished fp16 row of the same file is kept as it is."""
    mod = _load()
    real = mod.run_generate
    calls = []

    def counting(ctx, cache, b, p, new, keep_cache=False, chunked=False, **kw):
        calls.append((cache, chunked))
        return real(ctx, cache, b, p, new, keep_cache=keep_cache, chunked=chunked, **kw)

    monkeypatch.setattr(mod, "run_generate", counting)
    old = dict(model="tiny", case="maxbatch", prompt=48, new=6, status="ok", batch=7, search=[])
    src = tmp_path / "old.json"
    src.write_text(json.dumps(dict(meta=dict(started="s3", device="cpu"), models={},
                                   settings=dict(prefill_tokens=64, no_prealloc=False),
                                   rows=[dict(old, cache="fp16"), dict(old, cache="kivi-int4")])))
    out = tmp_path / "out.json"
    mod.main(["--quick", "--device", "cpu", "--no-plot", "--cases", "maxbatch", "--caches", "fp16,kivi-int4",
              "--resume-from", str(src), "--out", str(out), "--maxbatch-at", "kivi-int4:48:3"])
    rows = {r["cache"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["fp16"]["batch"] == 7 and ("fp16", True) not in calls, calls  # kept: no max-batch generate
    assert rows["kivi-int4"]["status"] == "ok" and rows["kivi-int4"]["batch"] == 3 and ("kivi-int4", True) in calls


def test_step_timer_reads_allocator_counters_once_at_the_first_token():
    """The allocator-retry count of a max-batch row is the difference between the first token's counters and
    those after generate (a budget-bound measurement shows as retries); the timed steps do not pay for
    ``torch.cuda.memory_stats`` each."""
    mod = _load()

    class FakeDev:
        n = 0

        def sync(self):
            pass

        def alloc_counters(self):
            self.n += 1
            return {"num_alloc_retries": self.n * self.n, "num_device_alloc": self.n, "num_device_free": 0}

    timer = mod.StepTimer(FakeDev())
    ids = mod.torch.zeros(2, 3, dtype=mod.torch.long)
    for _ in range(4):
        assert not timer(ids, None).any()
    assert len(timer.times) == 4
    assert timer.dev.n == 1
    assert timer.first_counters["num_alloc_retries"] == 1


def test_peak_probe_runs_batches_with_a_chunked_prefill(tmp_path):
    """eval/peak_probe.py at a max-batch configuration (CACHE:BATCH entries, the max-batch rows' chunked
    prefill), CPU smoke run on the tiny model."""
    out = tmp_path / "probe.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, str(ROOT / "eval" / "peak_probe.py"), "--device", "cpu", "--model", "tiny",
                    "--prompt", "96", "--new", "3", "--order", "fp16:2,kivi-int4:3", "--chunked",
                    "--prefill-tokens", "64", "--out", str(out)], check=True, env=env, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["cache"], r["batch"]) for r in rows] == [("fp16", 2), ("kivi-int4", 3)]
    # 64 tokens per forward: chunks of 32 tokens at batch 2, 16 at batch 3; fp16's every chunk goes through SDPA
    # (3 chunks x 2 layers), kivi's first chunk only (later chunks attend over the stored prompt: the prefix path)
    assert [r["prefill_chunk"] for r in rows] == [32, 16] and [r["prefill_sdpa_calls"] for r in rows] == [6, 2], rows
    # the cache's own bytes, for the peak arithmetic: fp16 holds 2 sequences x 98 tokens (96 + 3 new, the last never
    # fed back) x 2 layers x K and V x 2 heads x 32 channels in float32 (CPU); int4's 98 tokens all sit in its window,
    # allocated for sinks + residual + group = 4 + 128 + 32 tokens per sequence (no page yet)
    fp16_kv = rows[0]["kv_allocated_GiB"] * 2**30
    assert fp16_kv == 2 * 98 * 2 * 2 * 2 * 32 * 4, rows
    assert rows[1]["kv_allocated_GiB"] * 2**30 == 3 * 164 * 2 * 2 * 2 * 32 * 4, rows


def test_bench_generate_refuses_to_time_the_reference_on_a_gpu(monkeypatch):
    """Where the Triton kernels cannot load, a GPU run stops (``--allow-fallback`` to time the torch path anyway)
    instead of timing the reference as if it were the kernels."""
    import kivi_cache
    from kivi_cache import ops

    monkeypatch.setattr(ops, "_kernels", None)
    monkeypatch.setattr(ops, "_kernel_error", "ImportError: cannot import name 'kernels' from 'kivi_cache'")
    monkeypatch.setattr(ops, "_warned", set())
    bench_generate = load_script("bench_generate")

    class FakeDev:  # only what main reads before the check
        def __init__(self, device):
            self.cuda = True

    monkeypatch.setattr(bench_generate, "Dev", FakeDev)
    try:
        with pytest.raises(SystemExit, match="Triton kernels do not load on this GPU .*--allow-fallback"):
            bench_generate.main(["--quick", "--device", "cpu", "--out", os.devnull])
    finally:
        kivi_cache.set_backend("auto")

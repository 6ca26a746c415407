"""benchmarks/generate.py: --quick runs on the CPU (a tiny random Llama), the max-batch search against a memory
model, resuming from recorded rows and trials, the table and the plots."""

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from bench_scripts import BENCH, load_script

gm = importlib.import_module("generate_models")  # benchmarks/ is on sys.path through bench_scripts
S = importlib.import_module("generate_search")
ROOT = BENCH.parent
SCRIPT = BENCH / "generate.py"
CACHES = ["fp16", "kivi-int4", "quanto-int4"]  # quanto: measured, or skipped with the ImportError text
CASES = ["short", "long", "ctx", "maxbatch"]
GIB, MIB = 1 << 30, 1 << 20


@pytest.fixture(scope="module")
def G():
    return load_script("generate")


def _run(out, *extra, timeout=300):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _number(x):
    return isinstance(x, (int, float)) and x == x and x not in (float("inf"), float("-inf"))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "generate.json"
    proc = _run(out, "--caches", ",".join(CACHES), "--profile", "--commit", "abc1234")
    return out, json.loads(out.read_text()), proc.stdout


def test_rows_for_every_cache_and_case(quick_run):
    out, data, stdout = quick_run
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
    # provenance, settings, table
    assert data["benchmark"] == "generate" and data["commit"] == "abc1234" and "generate.py" in data["command"]
    for key in ("torch", "transformers", "triton", "python"):
        assert data["machine"][key], key
    assert data["device"] == "cpu" and "quanto" in data and data["settings"]["caches"] == CACHES
    assert data["models"]["tiny"]["layers"] == 2
    assert "prompt+new" in stdout and "tok/s" in stdout
    kivi_long = [r for r in rows if r["cache"] == "kivi-int4" and r["case"] == "long"][0]
    assert kivi_long["kv_report"]["quantized_tokens"] > 0
    assert data["memory_arithmetic"]
    # profile table
    prof = data["profile"][0]
    assert prof["model"] == "tiny" and prof["top"] and "error" not in prof
    # the plots beside the JSON
    assert [Path(p).name for p in data["plots"]] == ["generate_throughput.png", "generate_memory.png"]
    assert all(Path(p).parent == out.parent and Path(p).stat().st_size > 0 for p in data["plots"])


def test_resume_reruns_only_missing_rows(G, quick_run, tmp_path):
    out, _, _ = quick_run
    data = json.loads(out.read_text())
    target = next(r for r in data["rows"] if r["case"] == "short" and r["cache"] == "kivi-int4")
    target.update(status="skipped", skip_reason="time budget", error="time budget (test)")
    for k in ("decode_tok_s", "t_N_s"):
        target.pop(k, None)
    path = tmp_path / "resume.json"
    path.write_text(json.dumps(data))
    G.main(["--quick", "--device", "cpu", "--out", str(path), "--caches", ",".join(CACHES), "--resume",
            "--cases", "short", "--no-plot"])
    new = json.loads(path.read_text())
    assert len(new["rows"]) == len(data["rows"])
    row = next(r for r in new["rows"] if r["case"] == "short" and r["cache"] == "kivi-int4")
    assert row["status"] == "ok" and row["decode_tok_s"] > 0
    assert new["resumed_files"] == [str(path.resolve())]


def test_merge_joins_result_files(G, quick_run, tmp_path, capsys, monkeypatch):
    """--merge: the rows of several files (per key the finished row), their provenance under sources, the table and
    the plots; nothing is run."""
    _, data, _ = quick_run
    first = dict(data, rows=[r for r in data["rows"] if r["case"] != "maxbatch"])
    unfinished = dict(first["rows"][0], status="skipped", skip_reason="time budget", error="time budget")
    second = dict(data, commit="def5678", settings=dict(data["settings"], caches=["kivi-kv2"]),
                  rows=[r for r in data["rows"] if r["case"] == "maxbatch"] + [unfinished])
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, rec in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(rec))
    out = tmp_path / "merged.json"
    argv = ["--merge", *map(str, paths), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    rec = G.main(argv)
    assert json.loads(out.read_text())["rows"] == rec["rows"] and len(rec["rows"]) == len(data["rows"])
    assert rec["rows"][0]["status"] == first["rows"][0]["status"]  # the finished row, not the later unfinished one
    assert [s["commit"] for s in rec["sources"]] == ["abc1234", "def5678"] and "--merge" in rec["command"]
    assert rec["settings"]["caches"] == [*CACHES, "kivi-kv2"]
    assert [Path(p).name for p in rec["plots"]] == ["merged_throughput.png", "merged_memory.png"]
    assert "prompt+new" in capsys.readouterr().out


def test_quick_output_is_named_by_the_harness_and_ignored_by_git(G):
    """--quick writes benchmarks/results/generate_<gpu>_<date>_quick.json (and PNGs beside it), which git ignores;
    a full run's name is not ignored."""
    import harness

    args = G.parse_args(["--quick"])
    rec = dict(machine={"gpu": None})
    path = harness.out_path("generate", args, rec)
    assert path.parent == harness.RESULTS
    assert path.name.startswith("generate_cpu_") and path.name.endswith("_quick.json")
    full = harness.out_path("generate", G.parse_args([]), dict(machine={"gpu": "NVIDIA H100 80GB HBM3"}))
    assert full.name.startswith("generate_h100_") and not full.name.endswith("_quick.json")
    if not (ROOT / ".git").exists():
        return
    stem = str(path.with_suffix(""))
    quick = [path, str(path) + ".tmp", stem + "_throughput.png", stem + "_memory.png"]

    def ignored(p):
        return subprocess.run(["git", "check-ignore", "-q", "--no-index", str(p)], cwd=ROOT).returncode == 0

    assert [p for p in quick if not ignored(p)] == []
    assert not ignored(full)


def test_readme_preset(G):
    args = G.parse_args(["--preset", "readme"])
    assert args.models == ["llama3-8b"] and args.cases == ["short", "maxbatch"] and args.batch_prompts == [4096]
    assert args.caches[:3] == ["fp16", "kivi-int4", "kivi-int2"] and (args.prompt, args.new) == (1024, 256)
    assert args.caches[3:] == (["quanto-int4", "quanto-int2"] if G.quanto_installed() else [])
    assert args.time_budget == 300 and args.budget_gb == 80 and args.repeats == 2
    assert G.parse_args(["--preset", "readme", "--caches", "fp16", "--time-budget", "500"]).caches == ["fp16"]
    quick = G.parse_args(["--preset", "readme", "--quick"])  # the preset's caches and cases, the tiny model
    assert quick.models == ["tiny"] and quick.cases == ["short", "maxbatch"] and quick.batch_prompts == [48]


def test_best_fit_rate_takes_the_fastest_fitting_trial():
    trials = [dict(batch=96, ok=True, new=64, step_timer=0.1199), dict(batch=112, ok=True, new=64, step_timer=0.1279),
              dict(batch=120, ok=True, new=64, step_timer=0.2049), dict(batch=124, ok=False, new=64),
              dict(batch=200, ok=True, new=16, step_timer=0.1)]  # other token count: not comparable
    r = S.best_fit_rate(trials, 64)
    assert r["best_fit_batch"] == 112 and abs(r["best_fit_tok_s"] - 112 / 0.1279) < 1e-9
    assert S.best_fit_rate([], 64) == {}


def test_find_max_batch():
    for true_max in (1, 2, 7, 37, 100, 513):
        for start, tol in ((1, 0.0), (true_max, 0.0), (max(1, true_max * 9 // 10), 0.04), (true_max * 2, 0.04)):
            tried = []

            def fits(b, tried=tried, true_max=true_max):
                tried.append(b)
                return b <= true_max

            lo, hi = S.find_max_batch(fits, start, 4096, tol)
            assert lo <= true_max and (hi is None or hi > true_max)
            assert true_max - lo <= max(1, tol * true_max) if tol else lo == true_max
            assert len(tried) <= 4 * (true_max.bit_length() + 2)
    # known outcomes (a resumed search): never asked again, nor batches they decide (fits are monotone)
    tried = []
    lo, hi = S.find_max_batch(lambda b: tried.append(b) or b <= 100, 40, 4096, 0.04,
                              known={40: True, 44: True, 52: True, 90: True, 130: False})
    assert lo <= 100 < hi and 100 - lo <= 4 and tried and all(90 < b < 130 for b in tried), tried
    assert S.find_max_batch(lambda b: True, 1, 16, 0.0) == (16, None)
    assert S.find_max_batch(lambda b: False, 8, 16, 0.0)[0] == 0


def _fake_gpu_generate(calls, budget, weights, per_seq, t_per_seq=0.02):
    """A generate whose peak memory grows linearly in the batch and that OOMs above the budget."""

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


def test_max_batch_search_against_a_memory_model(G, monkeypatch, tmp_path):
    """The GPU path of the search, with a fake generate whose peak memory grows linearly in the batch."""
    budget, weights, per_seq = 80 * GIB, 14 * GIB, 150 * MIB
    true_max = (budget - weights) // per_seq
    calls = []
    monkeypatch.setattr(gm, "run_generate", _fake_gpu_generate(calls, budget, weights, per_seq))
    args = G.parse_args(["--batch-new", "64", "--trial-new", "16", "--time-budget", "1000"])
    base = dict(model="m", case="maxbatch", cache="fp16", batch=None, prompt=1024, new=64)
    runner = G.Runner(args, SimpleNamespace(cuda=True), {"available": True}, tmp_path / "x.json")
    row = S.one_max_batch(runner, dict(budget_bytes=budget), base, "fp16", 1024, budget)
    assert row["status"] == "ok", row
    assert true_max * (1 - args.batch_tol) - 1 <= row["batch"] <= true_max < row["batch_oom"]
    assert calls[:2] == [(64, 16), (128, 16)]  # probes: a full 65536-token prefill forward each
    big = [b for b, n in calls if b > 128 and n == 16]
    assert len(big) <= 4, calls
    assert calls[-1] == (row["batch"], 64)  # the measurement at the batch found
    assert abs(row["decode_step_ms"] - 30.0) < 1e-6 and row["decode_tok_s"] > 0
    # too little time: the search stops early with the best batch so far, a row that --resume continues
    calls.clear()
    runner.model_deadline = time.perf_counter() + 2.0
    row = S.one_max_batch(runner, dict(budget_bytes=budget), base, "fp16", 1024, budget)
    assert row["search_stopped_early"] and row["batch"] == 128
    assert all(b <= 128 for b, _ in calls)
    done = dict(row, status="ok")
    assert 2 < G.row_rank(done, False) < 3 and G.row_rank(dict(done, search_stopped_early=None), False) == 3


def test_max_batch_search_resumes_from_recorded_trials(G, monkeypatch, tmp_path):
    """--resume: a search cut short (probes and three fits, no OOM yet) continues from its recorded trials
    (none is run again, their peaks feed the prediction) and ends with the measurement; --maxbatch-at measures
    at a given batch without a search."""
    budget, weights, per_seq = 80 * GIB, 14 * GIB, 150 * MIB
    true_max = (budget - weights) // per_seq  # 450
    calls = []
    monkeypatch.setattr(gm, "run_generate", _fake_gpu_generate(calls, budget, weights, per_seq))
    args = G.parse_args(["--batch-new", "64", "--trial-new", "16", "--time-budget", "1000"])
    base = dict(model="m", case="maxbatch", cache="fp16", batch=None, prompt=1024, new=64, budget_bytes=budget)
    runner = G.Runner(args, SimpleNamespace(cuda=True, device=torch.device("cuda")), {"available": True},
                      tmp_path / "x.json")

    def entry(b, t=None, ok=True):
        if not ok:
            return dict(batch=b, new=16, ok=False, error="OOM: fake", oom=True)
        return dict(batch=b, new=16, ok=True, t=t or 9.0 + b / 1000, peak=weights + b * per_seq, ttft=1.0,
                    step_timer=0.03)

    # a stopped search: its recorded t values (9 + b / 1000) tell reused trials from new ones (0.98 + b / 50)
    recorded = [entry(64), entry(128), entry(380), entry(395), entry(425)]
    row = S.one_max_batch(runner, dict(budget_bytes=budget), base, "fp16", 1024, budget,
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
    row = S.one_max_batch(runner, dict(budget_bytes=budget), base, "fp16", 1024, budget,
                          prior=dict(search=recorded, source="old.json"))
    assert row["status"] == "ok" and (row["batch"], row["batch_oom"]) == (440, 452), row
    assert calls == [(64, 2), (440, 64)], calls  # warm-up at the probe batch, then the measurement
    assert row["t_trial_s"] == 9.44 and row["resumed"]["reused_ooms"] == [452]

    # --maxbatch-at: no search at all
    calls.clear()
    row = S.one_max_batch(runner, dict(budget_bytes=budget), base, "fp16", 1024, budget, given=300)
    assert row["status"] == "ok" and row["batch"] == 300 and row["batch_given"] and not row["search"], row
    assert calls == [(64, 2), (300, 64)], calls
    assert row["decode_step_ms_tN"] is None and row["decode_tok_s"] > 0
    row = S.one_max_batch(runner, dict(budget_bytes=budget), base, "fp16", 1024, budget, given=true_max + 5)
    assert row["status"] == "skipped" and row["skip_reason"] == "given batch OOM" and row["oom"], row

    # trials recorded under other settings are not reused
    runner.pending["k"] = dict(search=recorded, budget_bytes=budget)
    runner.pending_src["k"] = dict(file="old.json", settings=dict(prefill_tokens=4096), device="cuda:0")
    prior, note = runner.prior_search("k", budget)
    assert prior is None and "prefill_tokens" in note
    runner.pending_src["k"]["settings"]["prefill_tokens"] = args.prefill_tokens
    assert runner.prior_search("k", budget)[0]["search"] == recorded
    runner.pending_src["k"]["device"] = "cpu"
    prior, note = runner.prior_search("k", budget)
    assert prior is None and "device" in note


def test_resume_continues_max_batch_rows_end_to_end(G, monkeypatch, tmp_path):
    """main(--resume --resume-from --maxbatch-at) on the CPU (tiny model): recorded trials are not rerun,
    rows of caches outside the run stay in the JSON, a given batch is measured without a search."""
    real = gm.run_generate
    calls = []

    def counting(ctx, cache, b, p, new, keep_cache=False, chunked=False, **kw):
        if chunked:
            calls.append((cache, b, new))
        return real(ctx, cache, b, p, new, keep_cache=keep_cache, chunked=chunked, **kw)

    monkeypatch.setattr(gm, "run_generate", counting)

    def fit(b, t):
        return dict(batch=b, new=3, ok=True, t=t, peak=None, ttft=0.01, step_timer=0.001)

    def mb_row(cache, status, search=None, **kw):
        return dict(model="tiny", case="maxbatch", cache=cache, batch=None, prompt=48, new=6, status=status,
                    skip_reason="time budget", error="time budget (test)", search=search, **kw)

    settings = dict(prefill_tokens=64, no_prealloc=False, no_expandable=False, quanto_group=64, quanto_residual=128)
    oom4 = dict(batch=4, new=3, ok=False, error="OOM: fake", oom=True)
    out = tmp_path / "out.json"
    out.write_text(json.dumps(dict(date="earlier", device="cpu", settings=settings, models={}, rows=[
        mb_row("kivi-int4", "skipped", [fit(1, 11.0), fit(2, 12.0), oom4]),
        mb_row("fp16", "skipped"),  # not started here; its search is in the other file
        mb_row("quanto-int2", "skipped", [fit(1, 5.0)]),  # not in this run: kept as it is
    ])))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(date="earlier", device="cpu", settings=settings, models={}, rows=[
        mb_row("fp16", "skipped", [fit(1, 41.0), fit(2, 42.0), fit(4, 44.0)])])))
    G.main(["--quick", "--device", "cpu", "--no-plot", "--cases", "maxbatch", "--caches", "fp16,kivi-int4,kivi-kv2",
            "--resume", "--resume-from", str(other), "--out", str(out), "--trial-new", "3",
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
    assert f16["resumed"]["source"] == str(other.resolve())
    # kivi-kv2: --maxbatch-at, no search
    k2 = rows["kivi-kv2"]
    assert k2["status"] == "ok" and k2["batch"] == 2 and k2["batch_given"] and not k2["search"], k2
    assert [c for c in calls if c[0] == "kivi-kv2"] == [("kivi-kv2", 1, 2), ("kivi-kv2", 2, 6)], calls


def test_static_caches_run(G, tmp_path):
    """The compiled-decoding rows (opt-in caches) run end to end (on the CPU generate does not compile)."""
    out = tmp_path / "static.json"
    G.main(["--quick", "--device", "cpu", "--out", str(out), "--no-plot", "--caches", "fp16-static,kivi-int4-static",
            "--cases", "short,long"])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["cache"], r["case"]) for r in rows} == {(c, k) for c in ("fp16-static", "kivi-int4-static")
                                                       for k in ("short", "long")}
    assert all(r["status"] == "ok" and r["decode_step_ms"] == r["decode_step_ms"] for r in rows), rows


def test_step_timer_reads_allocator_counters_once_at_the_first_token():
    """The allocator-retry count of a max-batch row is the difference between the first token's counters and
    those after generate (a budget-bound measurement shows as retries); the timed steps do not pay for
    ``torch.cuda.memory_stats`` each."""

    class FakeDev:
        n = 0

        def sync(self):
            pass

        def alloc_counters(self):
            self.n += 1
            return {"num_alloc_retries": self.n * self.n, "num_device_alloc": self.n, "num_device_free": 0}

    timer = gm.StepTimer(FakeDev())
    ids = torch.zeros(2, 3, dtype=torch.long)
    for _ in range(4):
        assert not timer(ids, None).any()
    assert len(timer.times) == 4
    assert timer.dev.n == 1
    assert timer.first_counters["num_alloc_retries"] == 1


def test_plot_draws_throughput_and_memory(G, tmp_path):
    """plot(): the two PNGs from a result dict alone (batch-1 rows at two context lengths, max-batch rows with their
    search trials, one of them stopped by the time budget)."""
    def row(case, cache, batch, prompt, new, tok_s, peak, **kw):
        return dict(model="m", case=case, cache=cache, batch=batch, prompt=prompt, new=new, status="ok",
                    decode_tok_s=tok_s, peak_bytes=peak * GIB, **kw)

    trials = [dict(batch=16, ok=True, step_timer=0.03), dict(batch=300, ok=True, step_timer=0.04),
              dict(batch=330, ok=False)]
    rec = dict(benchmark="generate", settings=dict(models=["m"], caches=["fp16", "kivi-int4"]),
               models=dict(m=dict(weight_bytes=15 * GIB)), rows=[
                   row("short", "fp16", 1, 1024, 256, 38.0, 15.2), row("short", "kivi-int4", 1, 1024, 256, 35.0, 15.1),
                   row("long", "fp16", 1, 32768, 64, 30.0, 22.6), row("long", "kivi-int4", 1, 32768, 64, 31.0, 19.9),
                   row("maxbatch", "fp16", 109, 4096, 64, 940.0, 79.0, budget_bytes=80 * GIB,
                       search=[dict(batch=16, ok=True, step_timer=0.05)]),
                   row("maxbatch", "kivi-int4", 300, 4096, 64, 7500.0, 77.0, budget_bytes=80 * GIB, search=trials,
                       search_stopped_early="time budget")])
    files = G.plot(rec, tmp_path / "g")
    assert [f.name for f in files] == ["g_throughput.png", "g_memory.png"]
    assert all(f.stat().st_size > 10_000 for f in files)
    import generate_report

    assert generate_report.throughput_points(rec, "m", "kivi-int4", 4096) == [(16, 16 / 0.03), (300, 7500.0)]
    assert G.plot(dict(rows=[]), tmp_path / "empty") == []


def test_refuses_to_time_the_reference_on_a_gpu(G, monkeypatch):
    """Where the Triton kernels cannot load, a GPU run stops (``--allow-fallback`` to time the torch path anyway)
    instead of timing the reference as if it were the kernels."""
    import kivi_cache
    from kivi_cache import ops

    monkeypatch.setattr(ops, "_kernels", None)
    monkeypatch.setattr(ops, "_kernel_error", "ImportError: cannot import name 'kernels' from 'kivi_cache'")
    monkeypatch.setattr(ops, "_warned", set())

    class FakeDev:  # only what main reads before the check
        def __init__(self, device):
            self.cuda = True

    monkeypatch.setattr(gm, "Dev", FakeDev)
    try:
        with pytest.raises(SystemExit, match="Triton kernels do not load on this GPU .*--allow-fallback"):
            G.main(["--quick", "--device", "cpu", "--out", os.devnull])
    finally:
        kivi_cache.set_backend("auto")

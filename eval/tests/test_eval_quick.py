"""``--quick`` smoke runs of the eval scripts write ``eval/results/*_quick.*`` by default (git-ignored), never
over the recorded results; an explicit ``--out`` (``--plot``) is kept. Only the argument parsing runs here."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from eval_scripts import EVAL, load_script

ROOT = EVAL.parent
RESULTS = EVAL / "results"


def _load(name, argv, monkeypatch):
    """The script imported with ``sys.argv`` set (bench_kernels reads ``--quick`` at import)."""
    monkeypatch.setattr(sys, "argv", [str(EVAL / f"{name}.py"), *argv])
    return load_script(name)


@pytest.fixture(scope="module")
def bench_kernels():
    return load_script("bench_kernels")


@pytest.fixture(scope="module")
def bench_generate():
    return load_script("bench_generate")


@pytest.fixture(scope="module")
def perplexity():
    return load_script("perplexity")


@pytest.fixture(scope="module")
def needle():
    return load_script("needle")


def _ignored(path) -> bool:
    out = subprocess.run(["git", "check-ignore", "-q", "--no-index", str(path)], cwd=ROOT, capture_output=True)
    return out.returncode == 0


@pytest.fixture(scope="module")
def git_checkout():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")


def test_bench_kernels(bench_kernels, tmp_path):
    args = bench_kernels.parse_args(["--quick"])
    assert Path(args.out) == RESULTS / "bench_kernels_quick.json"
    assert os.path.splitext(args.out)[0] + ".png" == str(RESULTS / "bench_kernels_quick.png")  # main's PNG rule
    assert Path(bench_kernels.parse_args([]).out) == RESULTS / "bench_kernels.json"
    out = str(tmp_path / "k.json")
    assert bench_kernels.parse_args(["--quick", "--out", out]).out == out


def test_bench_kernels_quick_flag_still_read_at_import(monkeypatch):
    """The interpreter switch reads sys.argv when the module is imported (before triton.jit runs)."""
    assert _load("bench_kernels", ["--quick"], monkeypatch).QUICK is True
    assert _load("bench_kernels", [], monkeypatch).QUICK is False


def test_bench_generate(bench_generate, tmp_path):
    args = bench_generate.parse_args(["--quick"])
    assert Path(args.out) == RESULTS / "bench_generate_quick.json"
    assert Path(bench_generate.parse_args([]).out) == RESULTS / "bench_generate.json"
    out = str(tmp_path / "g.json")
    assert bench_generate.parse_args(["--quick", "--out", out]).out == out


def test_perplexity(perplexity, tmp_path):
    args = perplexity.parse_args(["--quick"])
    assert (Path(args.out), Path(args.plot)) == (RESULTS / "perplexity_smollm2_quick.json",
                                                 RESULTS / "perplexity_vs_bytes_quick.png")
    args = perplexity.parse_args([])
    assert (Path(args.out), Path(args.plot)) == (RESULTS / "perplexity_smollm2.json",
                                                 RESULTS / "perplexity_vs_bytes.png")
    out, plot = str(tmp_path / "p.json"), str(tmp_path / "p.png")
    args = perplexity.parse_args(["--quick", "--out", out, "--plot", plot])
    assert (args.out, args.plot) == (out, plot)
    args = perplexity.parse_args(["--quick", "--out", out])  # the plot not given: still not the recorded one
    assert (args.out, Path(args.plot)) == (out, RESULTS / "perplexity_vs_bytes_quick.png")


def test_needle(needle, tmp_path):
    paths = needle.output_paths(needle.parse_args(["--quick"]))
    assert paths == (RESULTS / "needle_smollm2_quick.json", RESULTS / "needle_heatmap_quick.png")
    paths = needle.output_paths(needle.parse_args(["--quick", "--prefill-chunk", "256"]))
    assert paths == (RESULTS / "needle_smollm2_chunk256_quick.json", RESULTS / "needle_heatmap_chunk256_quick.png")
    assert needle.output_paths(needle.parse_args([])) == (RESULTS / "needle_smollm2.json",
                                                          RESULTS / "needle_heatmap.png")
    out = tmp_path / "n.json"
    assert needle.output_paths(needle.parse_args(["--quick", "--out", str(out)])) == (out, tmp_path / "n.png")
    plot = tmp_path / "h.png"
    assert needle.output_paths(needle.parse_args(["--quick", "--out", str(out), "--plot", str(plot)])) == (out, plot)
    args = needle.parse_args(["--quick"])
    assert (args.lengths, args.depths) == ("512", "0,100")


def test_quick_outputs_are_git_ignored(git_checkout, bench_kernels, bench_generate, perplexity, needle):
    ka = bench_kernels.parse_args(["--quick"])
    ga = bench_generate.parse_args(["--quick"])
    pa = perplexity.parse_args(["--quick"])
    stem = os.path.splitext(ga.out)[0]
    quick = [ka.out, os.path.splitext(ka.out)[0] + ".png", ga.out, ga.out + ".tmp", stem + "_throughput.png",
             stem + "_memory.png", pa.out, pa.plot, *needle.output_paths(needle.parse_args(["--quick"]))]
    assert [p for p in quick if not _ignored(p)] == []
    recorded = [bench_kernels.parse_args([]).out, bench_generate.parse_args([]).out, perplexity.parse_args([]).out,
                *needle.output_paths(needle.parse_args([]))]
    assert [p for p in recorded if _ignored(p)] == []


def test_bench_sliding_quick_run(tmp_path):
    """The sliding-window benchmark end to end on a tiny model: the windowed kernel matches the reference, and every
    cache generates the same greedy tokens (window 40, prompt 120)."""
    from eval import bench_sliding

    res = bench_sliding.main(["--quick", "--out", str(tmp_path / "s.json")])
    assert all(row["rel_err_window"] < 1e-2 for row in res["kernels"])
    rows = {row["cache"]: row for row in res["generate"]}
    assert rows["kivi-int4"]["sliding_layers"] == 2 and rows["kivi-int4-fallback"]["sliding_layers"] == 0
    assert all(row["agree_with_fp16"] == 6 for row in rows.values())


def test_bench_sinks_quick_run(tmp_path):
    """The learned-sinks benchmark end to end on a tiny GPT-OSS: the kernel with sink logits matches the reference,
    the served cache holds a sliding layer, and every cache generates the eager model's greedy tokens; the static
    part's caches too (transformers' StaticCache under "kivi" among them), the ring holding fewer pages."""
    from eval import bench_sinks

    res = bench_sinks.main(["--quick", "--parts", "kernels,generate,static", "--out", str(tmp_path / "s.json")])
    assert all(row["rel_err_sinks"] < 1e-2 for row in res["kernels"])
    rows = {row["cache"]: row for row in res["generate"]}
    assert rows["kivi-int4"]["sliding_layers"] == 1 and rows["eager-int4-fallback"]["sliding_layers"] == 0
    assert all(row["agree_with_eager_dynamic"] == 6 for row in rows.values())
    # the static part: the ring holds fewer pages than the fixed pages of max_cache_len, same tokens throughout
    static = {row["cache"]: row for row in res["static"]}
    assert static["kivi-static-int4"]["pages_in_use"] < static["kivi-static-int4-no-ring"]["pages_in_use"]
    assert all(row["agree_with_hf_static"] == 6 for row in static.values())


def test_cpu_step_runs_every_cache_and_names_a_bad_one(smollm2, tmp_path, capsys):
    """eval/cpu_step.py (the README's CPU table): a short run of DynamicCache, ours and the reference, the backend
    back to "auto" afterwards; an unknown cache name is an error naming --caches and the allowed names."""
    import json

    import kivi_cache

    cpu_step = load_script("cpu_step")
    with pytest.raises(SystemExit):
        cpu_step.main(["--caches", "dynamic,fp8"])
    assert "--caches: unknown ['fp8']; allowed: ('dynamic'" in capsys.readouterr().err
    out = tmp_path / "step.json"
    res = cpu_step.main(["--prompts", "40", "--steps", "2", "--rounds", "1", "--caches",
                         "dynamic,kivi_int4,kivi_int4_reference", "--out", str(out)], loaded=smollm2)
    assert kivi_cache.get_backend() == "auto"
    row = json.loads(out.read_text())["prompts"]["40"]
    assert set(row["median_ms"]) == {"dynamic", "kivi_int4", "kivi_int4_reference"}
    assert all(v > 0 for v in row["median_ms"].values()) and row["vs_dynamic"]["dynamic"] == 1.0
    assert res["threads"] >= 1

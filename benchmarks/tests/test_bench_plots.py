"""benchmarks/plots.py: draws a decode result (a quick run's) through decode.py's plot(); picks the newest result of
each benchmark and GPU; names a file without a plot."""

import json

import pytest
from bench_scripts import load_script

P = load_script("plots")


def test_draws_a_quick_decode_result(tmp_path):
    result = tmp_path / "decode_cpu_2026-01-01_quick.json"
    load_script("decode").main(["--quick", "--shapes", "1x2x192", "--bits", "4/4/32", "--out", str(result)])
    written = P.main([str(result)])
    assert written == [tmp_path / "decode_cpu_2026-01-01_quick.png"]
    assert written[0].stat().st_size > 10_000 and written[0].read_bytes()[:4] == b"\x89PNG"


def _result(path, benchmark, date, gpu="NVIDIA H100 80GB HBM3", quick=False):
    path.write_text(json.dumps(dict(benchmark=benchmark, date=date, machine=dict(gpu=gpu), quick=quick, rows=[])))
    return path


def test_newest_result_of_each_benchmark_and_gpu(tmp_path):
    old = _result(tmp_path / "decode_h100_2026-01-01.json", "decode", "2026-01-01T10:00:00+00:00")
    new = _result(tmp_path / "decode_h100_2026-02-01.json", "decode", "2026-02-01T10:00:00+00:00")
    h200 = _result(tmp_path / "decode_h200_2026-01-15.json", "decode", "2026-01-15T10:00:00+00:00", "NVIDIA H200")
    _result(tmp_path / "decode_cpu_2026-03-01_quick.json", "decode", "2026-03-01T10:00:00+00:00", None, True)
    (tmp_path / "not_a_result.json").write_text("[1, 2]")
    got = P.newest(tmp_path)
    assert new in got and h200 in got and old not in got and len(got) == 2


def test_a_result_without_a_plot_is_named(tmp_path):
    f = _result(tmp_path / "cpu_step_cpu_2026-01-01.json", "cpu_step", "2026-01-01", None)
    with pytest.raises(SystemExit, match="benchmark 'cpu_step' has no plot"):
        P.main([str(f)])
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(SystemExit, match="not a benchmark result"):
        P.main([str(other)])
    assert P.main(["--results", str(tmp_path)]) == []  # the default: results without a plot are left out

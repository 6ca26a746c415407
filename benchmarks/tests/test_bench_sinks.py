"""benchmarks/sinks.py on a tiny GPT-OSS, CPU and Triton's interpreter: the kernel with sink logits matches the
reference, the served cache holds a sliding layer, every cache generates the eager model's greedy tokens; the static
part's caches too (transformers' StaticCache under "kivi" among them), the ring holding fewer pages."""

import json

import pytest
from bench_scripts import load_script

K = load_script("sinks")


def test_quick_run(tmp_path):
    out = tmp_path / "sinks.json"
    K.main(["--quick", "--parts", "kernels,generate,static", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "sinks" and saved["complete"] and saved["machine"]["torch"]
    kernels = [r for r in saved["rows"] if r["part"] == "kernels"]
    assert [(r["batch"], r["window"]) for r in kernels] == [(1, "full"), (2, "full"), (1, 40), (2, 40)]
    assert all(r["rel_err"] < 1e-2 and r["ms_int4_sinks"] > 0 for r in kernels)
    rows = {r["cache"]: r for r in saved["rows"] if r["part"] == "generate"}
    assert rows["kivi-int4"]["sliding_layers"] == 1 and rows["eager-int4-fallback"]["sliding_layers"] == 0
    assert all(r["agree"] == 6 for r in rows.values())
    static = {r["cache"]: r for r in saved["rows"] if r["part"] == "static"}
    assert static["kivi-static-int4"]["pages_in_use"] < static["kivi-static-int4-no-ring"]["pages_in_use"]
    assert all(r["agree"] == 6 and r["max_cache_len"] == 400 for r in static.values())


def test_bad_parts_name_the_allowed_ones(capsys):
    with pytest.raises(SystemExit):
        K.parse_args(["--parts", "static,memory"])
    assert "--parts: unknown ['memory'] (parts: ('kernels', 'generate', 'static'))" in capsys.readouterr().err

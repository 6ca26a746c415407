"""benchmarks/sliding.py on a tiny model (window 40, prompt 120), CPU and Triton's interpreter: the windowed kernel
matches the reference, every cache generates the same greedy tokens, the served cache holds its sliding layers."""

import json
import sys

import pytest
from bench_scripts import load_script

S = load_script("sliding")


def test_quick_run(tmp_path, monkeypatch):
    out = tmp_path / "sliding.json"
    monkeypatch.setattr(sys, "argv", ["benchmarks/sliding.py", "--quick", "--commit", "abc1234", "--out", str(out)])
    S.main()
    saved = json.loads(out.read_text())
    for key in ("benchmark", "date", "command", "commit", "machine", "settings", "rows"):
        assert key in saved, key
    assert saved["benchmark"] == "sliding" and saved["commit"] == "abc1234" and saved["complete"]
    kernels = [r for r in saved["rows"] if r["part"] == "kernels"]
    assert [r["batch"] for r in kernels] == [1, 2]
    for r in kernels:
        assert r["rel_err"] < 1e-2 and r["window"] == 40
        assert all(r[f"ms_{k}"] > 0 for k in ("window", "full", "fallback", "fp16_window"))
    rows = {r["cache"]: r for r in saved["rows"] if r["part"] == "generate"}
    assert set(rows) == {"fp16-DynamicCache", "kivi-int4", "kivi-int4-fallback"}
    assert rows["kivi-int4"]["sliding_layers"] == 2 and rows["kivi-int4-fallback"]["sliding_layers"] == 0
    assert all(r["agree"] == 6 and r["step_ms"] > 0 for r in rows.values())


@pytest.mark.parametrize("argv,message", [
    (["--parts", "kernels,decode"], "--parts: unknown ['decode']"),
    (["--window", "500", "--context", "400"], "--window 500: must be positive and below --context 400"),
    (["--prompts", "1k"], "--prompts: '1k' is not a comma list of integers"),
])
def test_bad_options_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit):
        S.parse_args(argv)
    assert message in capsys.readouterr().err

"""benchmarks/quantize.py on the CPU under Triton's interpreter: the quick run writes a result file with its
provenance and the three operations' rows, each checked against the reference in the run; bad options stop with a
message naming them."""

import json
import sys

import pytest
from bench_scripts import load_script

Q = load_script("quantize")


def test_quick_run_writes_provenance_and_checked_rows(tmp_path, monkeypatch):
    out = tmp_path / "quantize.json"
    monkeypatch.setattr(sys, "argv", ["benchmarks/quantize.py", "--quick", "--bits", "4/4/32", "--commit", "abc1234",
                                      "--out", str(out)])
    rec = Q.main()
    saved = json.loads(out.read_text())
    for key in ("benchmark", "date", "command", "commit", "machine", "settings", "copy_bandwidth_TBps", "rows"):
        assert key in saved, key
    assert saved["benchmark"] == "quantize" and saved["commit"] == "abc1234" and saved["complete"]
    assert "quantize.py --quick" in saved["command"]
    rows = saved["rows"]
    assert [r["op"] for r in rows] == ["flush (quantize_and_write)", "prefill (quantize_and_write)",
                                       "append_and_flush"]
    assert not Q.failed(rec)
    for r in rows:
        assert r["check"] == "ok" and r["max_code_step"] <= 1 and r["code_match"] > 0.999, r
        assert r["max_scale_diff"] == 0 and r["max_window_diff"] == 0
        assert r["ms"] > 0 and r["bytes"] > 0 and r["TBps"] > 0
    flush, prefill, step = rows
    assert (flush["groups"], prefill["groups"], step["groups"]) == (1, 2, 1)  # batch 1, prefill 64 tokens, group 32


def test_quick_run_with_clipped_keys(tmp_path, monkeypatch):
    """``--clip none,keys``: each operation once per setting, the clipped rows checked against the clipped
    reference."""
    out = tmp_path / "quantize.json"
    monkeypatch.setattr(sys, "argv", ["benchmarks/quantize.py", "--quick", "--bits", "4/2/64", "--clip", "none,keys",
                                      "--commit", "abc1234", "--out", str(out)])
    rec = Q.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["clip"], r["op"].split()[0]) for r in rows] == [(c, op) for c in ("none", "keys")
                                                               for op in ("flush", "prefill", "append_and_flush")]
    assert not Q.failed(rec) and all(r["check"] == "ok" for r in rows)


def test_compare_flags_a_wrong_code():
    import torch

    pool = [torch.zeros(2, 1, 64, 32, dtype=torch.uint8), torch.ones(2, 1, 2, 64, dtype=torch.float16),
            torch.zeros(2, 1, 2, 64, dtype=torch.float16), torch.zeros(2, 1, 64, 32, dtype=torch.uint8),
            torch.ones(2, 1, 2, 64, dtype=torch.float16), torch.zeros(2, 1, 2, 64, dtype=torch.float16)]
    same = Q.compare(pool, [t.clone() for t in pool], (4, 4, 32))
    assert same["check"] == "ok" and same["code_match"] == 1.0
    bad = [t.clone() for t in pool]
    bad[0][0, 0, 0, 0] = 0x22  # two codes two steps off
    got = Q.compare(bad, pool, (4, 4, 32))
    assert got["check"] == "FAIL" and got["max_code_step"] == 2


@pytest.mark.parametrize("argv,message", [
    (["--bits", "4/4/x"], "--bits: '4/4/x' is not KEY_BITS/VALUE_BITS/GROUP_SIZE"),
    (["--bits", "4/5/32"], "--bits 4/5/32: value_bits=5 is not supported"),
    (["--batches", "1,two"], "--batches: '1,two' is not a list of integers"),
    (["--prefill", "48"], "--prefill 48: not a whole number of groups of 32"),
    (["--clip", "none,all"], "--clip: a comma list of none, keys, values and both, got 'none,all'"),
])
def test_bad_options_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit):
        Q.parse_args(["--quick", *argv])
    assert message in capsys.readouterr().err

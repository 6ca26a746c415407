"""benchmarks/decode.py on the CPU under Triton's interpreter: the quick run writes a result file with its provenance
and rows checked against the reference; bad options stop with a message naming them."""

import json
import sys

import pytest
from bench_scripts import load_script

D = load_script("decode")


def test_quick_run_writes_provenance_and_checked_rows(tmp_path, monkeypatch):
    out = tmp_path / "decode.json"
    monkeypatch.setattr(sys, "argv", ["benchmarks/decode.py", "--quick", "--commit", "abc1234", "--out", str(out)])
    rec = D.main()
    saved = json.loads(out.read_text())
    for key in ("benchmark", "date", "command", "commit", "machine", "settings", "copy_bandwidth_TBps", "rows"):
        assert key in saved, key
    assert saved["benchmark"] == "decode" and saved["commit"] == "abc1234" and saved["complete"] and saved["quick"]
    assert "decode.py --quick" in saved["command"]
    for key in ("python", "torch", "triton", "transformers"):
        assert saved["machine"][key], key
    rows = saved["rows"]
    shapes = {(r["batch"], r["kv_heads"], r["context"]) for r in rows}
    assert shapes == set(D.parse_shapes(D.QUICK_SHAPES))
    assert [r["impl"] for r in rows[:4]] == [D.FP16, "k4v4g32", "k2v2g32", "k4v2g64"]
    assert not D.failed(rec) and not any("error" in r for r in rows)
    for r in rows:
        assert r["ms"] > 0 and r["bytes"] > 0 and r["TBps"] > 0 and len(r["ms_reps"]) == 1
        assert r["q_heads"] == 4 * r["kv_heads"]
        if r["impl"] != D.FP16:
            assert r["rel_err"] < 1e-2 and r["check"] == "ok"  # the kernel against the reference, in the run
            assert r["quantized_tokens"] + r["window"] == r["context"]
            fp16 = next(x for x in rows if x["impl"] == D.FP16 and x["context"] == r["context"]
                        and x["batch"] == r["batch"])
            assert r["speedup"] == pytest.approx(fp16["ms"] / r["ms"])
            assert r["bytes"] < fp16["bytes"]


def test_pool_bytes_counts_codes_scales_window_queries_and_table():
    # 1 sequence, 1 KV head, 64 quantized tokens, head_dim 64, group 32, 4/4 bits, a 32-token window, 4 query heads
    got = D.pool_bytes(1, 1, 64, 64, 32, 4, 4, 32, 4, 1)
    codes = 64 * 64 * 8 // 8
    scales = (64 // 32) * 64 * 4 + 64 * (64 // 32) * 4
    assert got == codes + scales + 2 * 32 * 64 * 2 + 4 * 64 * 4 + 4


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "1x2"], "--shapes: '1x2' is not BATCHxKV_HEADSxCONTEXT"),
    (["--shapes", "1x2x64"], "the context must exceed the window"),
    (["--bits", "4/4"], "--bits: '4/4' is not KEY_BITS/VALUE_BITS/GROUP_SIZE"),
    (["--bits", "3/4/32"], "--bits 3/4/32: key_bits=3 is not supported"),
    (["--bits", "4/4/48"], "--bits 4/4/48: group_size=48 must be a power of two"),
])
def test_bad_options_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit):
        D.parse_args(["--quick", *argv])
    assert message in capsys.readouterr().err


def test_a_full_run_needs_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit, match="no CUDA device: use --quick"):
        D.parse_args([])

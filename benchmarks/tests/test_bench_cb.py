"""benchmarks/cb.py on a tiny Llama (6 requests, prompts 40-120, 8 new tokens, 64 blocks of 64 tokens), CPU:
transformers' continuous-batching engine serves every request with its fp16 cache and with kivi_cache's int4 one,
and each row holds the throughput, time to first token, requests in flight and the cache's capacity."""

import json
import sys

import pytest
from bench_scripts import load_script

import kivi_cache

S = load_script("cb")
# the benchmark drives transformers' engine of >= 5.24 (its ContinuousBatchingConfig and the quantized pages)
pytestmark = pytest.mark.skipif(kivi_cache.cb.unsupported_reason() is not None,
                                reason=str(kivi_cache.cb.unsupported_reason()))


def test_quick_run(tmp_path, monkeypatch):
    out = tmp_path / "cb.json"
    monkeypatch.setattr(sys, "argv", ["benchmarks/cb.py", "--quick", "--cases", "sdpa,int4", "--repeats", "2",
                                      "--commit", "abc1234", "--out", str(out)])
    S.main()
    saved = json.loads(out.read_text())
    for key in ("benchmark", "date", "command", "commit", "machine", "settings", "rows", "model"):
        assert key in saved, key
    assert saved["benchmark"] == "cb" and saved["commit"] == "abc1234" and saved["complete"]
    rows = {r["case"]: r for r in saved["rows"]}
    assert list(rows) == ["sdpa", "int4"]
    for r in rows.values():
        assert "error" not in r, r.get("error")
        assert r["runs"] == 2 and [x["repeat"] for x in r["run_list"]] == [0, 1]
        assert r["generated_tokens"] == 6 * 8 and r["tok_s"] > 0 and r["req_s"] > 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"]
        assert 1 <= r["max_in_flight"] <= 6 and 1 <= r["max_admitted"] <= 6
        assert r["num_blocks"] > 0 and r["capacity_tokens"] == r["num_blocks"] * 64
        assert r["capacity_ref"] == "sdpa" and r["capacity_vs_fp16"] > 0
    assert rows["sdpa"]["cache_class"] == "PagedAttentionCache" and rows["sdpa"]["capacity_vs_fp16"] == 1.0
    assert rows["int4"]["cache_class"] != "PagedAttentionCache"


def test_a_failing_case_is_a_row_and_the_others_run(tmp_path, monkeypatch):
    """A case that raises leaves a row with its error; the model is handed back to the next case unchanged."""
    real = S.set_case

    def failing(model, case):
        if case == "eager":
            raise RuntimeError("no such attention (test)")
        real(model, case)

    monkeypatch.setattr(S, "set_case", failing)
    out = tmp_path / "cb.json"
    rec = S.main(["--quick", "--cases", "eager,sdpa", "--out", str(out)])
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["eager"]["error"] == "RuntimeError: no such attention (test)" and rows["eager"]["runs"] == 0
    assert "error" not in rows["sdpa"] and rows["sdpa"]["attn"] == "sdpa" and rec["complete"]
    # a spent time budget starts no case: every row says so
    rec = S.main(["--quick", "--cases", "sdpa", "--time-budget", "0", "--out", str(out)])
    assert rec["rows"][0]["error"] == "not run: time budget" and rec["stopped_early"] and not rec["complete"]


def test_nearest_rank_quantile():
    assert S.pct([5, 1, 4, 2, 3], 0.5) == 3 and S.pct([5, 1, 4, 2, 3], 0.9) == 5 and S.pct([], 0.9) is None


@pytest.mark.parametrize("argv,message", [
    (["--cases", "sdpa,int3"], "--cases: unknown ['int3']"),
    (["--min-prompt", "100", "--max-prompt", "50"], "--max-prompt 50 is below --min-prompt 100"),
    (["--max-memory-percent", "1.5"], "--max-memory-percent 1.5: must be in (0, 1]"),
])
def test_bad_options_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit):
        S.parse_args(argv)
    assert message in capsys.readouterr().err

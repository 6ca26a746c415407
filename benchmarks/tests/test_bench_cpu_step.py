"""benchmarks/cpu_step.py: a short run of DynamicCache, ours and the reference on SmolLM2 (the conftest fixture),
the backend and the attention implementation as they were afterwards; an unknown cache name is an error naming
--caches and the allowed names."""

import json

import pytest
from bench_scripts import load_script

C = load_script("cpu_step")


def test_bad_cache_names_the_allowed_ones(capsys):
    with pytest.raises(SystemExit):
        C.parse_args(["--caches", "dynamic,fp8"])
    assert "--caches: unknown ['fp8']; allowed: ('dynamic'" in capsys.readouterr().err


@pytest.mark.slow
def test_runs_every_cache(smollm2, tmp_path):
    import kivi_cache

    out = tmp_path / "step.json"
    attn = smollm2[0].config._attn_implementation
    rec = C.main(["--prompts", "40", "--steps", "2", "--rounds", "1", "--caches",
                  "dynamic,kivi_int4,kivi_int4_reference,quanto_int4", "--attn", "eager", "--out", str(out)],
                 loaded=smollm2)
    assert kivi_cache.get_backend() == "auto" and smollm2[0].config._attn_implementation == attn
    saved = json.loads(out.read_text())
    assert saved["benchmark"] == "cpu_step" and saved["machine"]["gpu"] is None and saved["threads"] >= 1
    rows = {r["cache"]: r for r in saved["rows"]}
    assert set(rows) == {"dynamic", "kivi_int4", "kivi_int4_reference", "quanto_int4"}
    timed = [rows[c] for c in ("dynamic", "kivi_int4", "kivi_int4_reference")]
    assert all(r["prompt"] == 40 and r["ms"] > 0 and len(r["round_ms"]) == 1 for r in timed)
    assert rows["dynamic"]["vs_dynamic"] == 1.0
    if "quanto_int4" in saved["skipped"]:  # optimum-quanto not installed: recorded with the reason
        assert "optimum-quanto" in rows["quanto_int4"]["skipped"]
    assert rec["rows"] == saved["rows"]

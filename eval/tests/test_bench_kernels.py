"""eval/bench_kernels.py on the CPU interpreter: one small shape, rows with times, bytes, errors; the
CUDA-graph columns are filled for the kernels under the threshold (here timed with the CPU timer)."""

import math

import torch
from eval_scripts import EVAL, load_script


def _load():
    return load_script("bench_kernels")


def test_bench_config_row_with_graph_columns_below_threshold():
    mod = _load()
    dev = torch.device("cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    b, hkv, ctx, hq, d, res, g, p = 1, 2, 256, 4, 64, 32, 32, 64
    t_quant = (ctx - res) // g * g
    row = {}
    calls = []

    def fake_graph_timer(fn):
        calls.append(fn)
        return 1.0

    mod.bench_config(row, b, hkv, ctx, hq, d, res, g, p, 1 / math.sqrt(d), t_quant, ctx - t_quant,
                     2 * b * hkv * ctx * d * 2, dev, gen, mod.timer(dev), 1e11, 1, True,
                     tm_graph=fake_graph_timer, graph_below=float("inf"))
    for name in ("int4", "int2", "int2_k4v2g64", "int4_g64"):
        assert row[f"{name}_rel_err"] < 1e-2
        assert row[f"{name}_bytes"] > 0 and row[f"{name}_ms"] > 0
        assert row[f"{name}_graph_speedup"] == 1.0
    assert len(calls) == 6  # SDPA, four decode configurations, quantize+write
    row2 = {}
    mod.bench_config(row2, b, hkv, ctx, hq, d, res, g, p, 1 / math.sqrt(d), t_quant, ctx - t_quant,
                     2 * b * hkv * ctx * d * 2, dev, gen, mod.timer(dev), 1e11, 1, True,
                     tm_graph=fake_graph_timer, graph_below=0.0)
    assert not [k for k in row2 if k.endswith("_graph_ms")]


def test_graph_gap_probe_quick_run(monkeypatch, tmp_path):
    """eval/graph_gap.py on the CPU interpreter: both kernels timed by the eager burst, JSON written."""
    out = tmp_path / "gap.json"
    monkeypatch.setattr("sys.argv", [str(EVAL / "graph_gap.py"), "--quick", "--calls", "1", "--out", str(out)])
    mod = load_script("graph_gap")
    res = mod.main()
    assert set(res["rows"]) == {"fp16_sdpa", "kivi"}
    assert all(r["eager_burst"]["ms"] > 0 for r in res["rows"].values())
    assert out.exists()

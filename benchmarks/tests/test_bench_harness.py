"""benchmarks/harness.py: provenance, naming, tables and the alternating timer (on the CPU)."""

import json

import torch
from bench_scripts import load_script

H = load_script("harness")


def test_record_holds_machine_versions_commit_and_command(tmp_path):
    import argparse

    args = H.add_common_args(argparse.ArgumentParser()).parse_args(["--commit", "abc1234", "--quick"])
    rec = H.record("decode", args, torch.device("cpu"), shapes=[1, 2])
    for key in ("benchmark", "date", "command", "commit", "machine", "settings", "rows"):
        assert key in rec, key
    assert rec["commit"] == "abc1234" and rec["quick"] is True and rec["shapes"] == [1, 2]
    for key in ("python", "torch", "triton", "transformers"):
        assert rec["machine"][key], key
    path = H.out_path("decode", args, rec)
    assert path.name.startswith("decode_cpu_") and path.name.endswith("_quick.json")
    H.save(tmp_path / "r.json", rec)
    assert json.loads((tmp_path / "r.json").read_text())["commit"] == "abc1234"


def test_gpu_tag_names_the_card():
    assert H.gpu_tag({"gpu": "NVIDIA H100 80GB HBM3"}) == "h100"
    assert H.gpu_tag({"gpu": "NVIDIA H200"}) == "h200"
    assert H.gpu_tag({"gpu": None}) == "cpu"


def test_table_formats_and_marks_missing_values():
    text = H.table([{"a": 1.23456, "b": None}, {"a": 10.0, "b": "x"}], [("a", "ms", ".2f"), ("b", "note", "")])
    lines = text.splitlines()
    assert lines[0].split() == ["ms", "note"]
    assert lines[1].split() == ["1.23", "-"] and lines[2].split() == ["10.00", "x"]


def test_time_alternating_times_every_function_in_turns():
    order = []
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    out = H.time_alternating(fns, torch.device("cpu"), reps=4)
    assert set(out) == {"a", "b"} and all(len(v) == 4 and all(x >= 0 for x in v) for v in out.values())
    assert order[2:] == ["a", "b", "b", "a", "a", "b", "b", "a"]  # after one warm-up call each, reversed every other

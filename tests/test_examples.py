"""examples/op_api.py (the op API without transformers) runs and its numbers make sense."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import op_api  # noqa: E402


@pytest.mark.parametrize("bits,bound", [(8, 0.02), (4, 0.2)])
def test_op_api_example(bits, bound, capsys):
    errs = op_api.main(["--bits", str(bits), "--device", "cpu", "--lengths", "40,200"])
    assert len(errs) == 2 and max(errs) < bound
    out = capsys.readouterr().out
    assert "x less" in out and "same output as the op: True" in out

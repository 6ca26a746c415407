"""The scripts of benchmarks/ as modules, for the tests (they are scripts run as ``python benchmarks/X.py``, which
puts benchmarks/ first on sys.path, so they import the harness as ``harness``)."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


def load_script(name: str):
    """benchmarks/<name>.py executed as a fresh module ``<name>_bench`` (not put in sys.modules)."""
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

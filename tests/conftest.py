import os

# The Triton interpreter must be on before any @triton.jit function is
# decorated, i.e. before kivi_cache.kernels is imported. On a GPU machine set
# KIVI_TEST_GPU=1 to run the same kernel tests on the device instead.
if os.environ.get("KIVI_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)

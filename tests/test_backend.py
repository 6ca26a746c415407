"""Backend choice: where the Triton kernels cannot load, a GPU run says so (a warning once, ``kernel_error()``), a
forced ``"triton"`` backend raises, and the benchmark refuses to time the reference as if it were the kernels."""

import warnings

import pytest

import kivi_cache
from kivi_cache import chunked, ops, reference


def test_kernels_load_here_and_kernel_error_is_none():
    assert kivi_cache.kernel_error() is None
    assert ops._impl("cuda") is ops._kernels is not None


@pytest.fixture
def broken_kernels(monkeypatch):
    monkeypatch.setattr(ops, "_kernels", None)
    monkeypatch.setattr(ops, "_kernel_error", "ImportError: cannot import name 'kernels' from 'kivi_cache'")
    monkeypatch.setattr(ops, "_warned", False)
    yield
    kivi_cache.set_backend("auto")


def test_unloadable_kernels_warn_once_on_cuda_and_say_why(broken_kernels):
    assert "cannot import name 'kernels'" in kivi_cache.kernel_error()
    with pytest.warns(RuntimeWarning, match="Triton kernels unavailable .*cannot import name 'kernels'"):
        assert ops._impl("cuda") is chunked
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops._impl("cuda") is chunked  # once
        assert ops._impl("cpu") is chunked
    kivi_cache.set_backend("torch")  # the oracle, forced
    assert ops._impl("cuda") is ops._impl("cpu") is reference
    kivi_cache.set_backend("triton")
    with pytest.raises(RuntimeError, match="backend 'triton' requested but the kernels cannot load"):
        ops._impl("cuda")


def test_bench_generate_refuses_to_time_the_reference_on_a_gpu(broken_kernels, monkeypatch):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval"))
    import bench_generate

    class FakeDev:  # only what main reads before the check
        def __init__(self, device):
            self.cuda = True

    monkeypatch.setattr(bench_generate, "Dev", FakeDev)
    with pytest.raises(SystemExit, match="Triton kernels do not load on this GPU .*--allow-fallback"):
        bench_generate.main(["--quick", "--device", "cpu", "--out", os.devnull])

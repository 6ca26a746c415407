"""Backend choice: where the Triton kernels cannot load, a GPU run says so (a warning once, ``kernel_error()``), a
forced ``"triton"`` backend raises; a configuration the kernels do not cover goes to the torch path, chosen before
the call. (benchmarks/tests/test_bench_generate.py: the benchmark refuses to time the reference as if it were the
kernels.)"""

import warnings

import pytest

import kivi_cache
from kivi_cache import ops, reference, torch_ops


def test_kernels_load_here_and_kernel_error_is_none():
    assert kivi_cache.kernel_error() is None
    assert ops._impl("cuda") is ops._kernels is not None


@pytest.fixture
def broken_kernels(monkeypatch):
    monkeypatch.setattr(ops, "_kernels", None)
    monkeypatch.setattr(ops, "_kernel_error", "ImportError: cannot import name 'kernels' from 'kivi_cache'")
    monkeypatch.setattr(ops, "_warned", set())
    yield
    kivi_cache.set_backend("auto")


def test_unloadable_kernels_warn_once_on_cuda_and_say_why(broken_kernels):
    assert "cannot import name 'kernels'" in kivi_cache.kernel_error()
    with pytest.warns(RuntimeWarning, match="Triton kernels unavailable .*cannot import name 'kernels'"):
        assert ops._impl("cuda") is torch_ops
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops._impl("cuda") is torch_ops  # once
        assert ops._impl("cpu") is torch_ops
    kivi_cache.set_backend("torch")  # the oracle, forced
    assert ops._impl("cuda") is ops._impl("cpu") is reference
    kivi_cache.set_backend("triton")
    with pytest.raises(RuntimeError, match="backend 'triton' requested but the kernels cannot load"):
        ops._impl("cuda")


def _pool(d: int, p: int = 64, bits: int = 4, g: int = 32):
    """A pool's tensors with the shapes the ops read the configuration from (head_dim, page size)."""
    import torch

    return (torch.empty(2, 1, p, d * bits // 8, dtype=torch.uint8), torch.empty(2, 1, p // g, d),
            torch.empty(2, 1, p // g, d), torch.empty(2, 1, d, p * bits // 8, dtype=torch.uint8),
            torch.empty(2, 1, d // g, p), torch.empty(2, 1, d // g, p))


def test_the_backend_is_chosen_up_front_by_what_the_kernels_cover(monkeypatch):
    """``"auto"`` on CUDA tensors: the kernels where :func:`kernel_limits` says they cover the configuration, else the
    torch path with one warning naming the reason; ``"triton"`` leaves the configuration to the kernels (which raise
    the same reason)."""
    from kivi_cache.kernels import checks

    monkeypatch.setattr(ops, "_warned", set())
    monkeypatch.setattr(ops, "_limits", {})
    monkeypatch.setattr(ops._kernels, "interpreting", lambda: False)  # as on a GPU: its tile limit applies
    assert ops._impl("cuda", "paged_decode_attention", _pool(128), 4, 4, 32) is ops._kernels
    with pytest.warns(RuntimeWarning, match="does not cover this configuration .*head_dim=96"):
        assert ops._impl("cuda", "paged_decode_attention", _pool(96), 4, 4, 32) is torch_ops
    with pytest.warns(RuntimeWarning, match="page_size divisible by 32"):
        assert ops._impl("cuda", "dequantize_pages", _pool(128, p=16, g=16), 4, 4, 16) is torch_ops
    # the decode kernel's own limits: 8-token value groups are too narrow for its value sub-tiles
    assert checks.kernel_limits("dequantize_pages", 64, 4, 4, 8, 64) is None
    assert "sub-tiles" in checks.kernel_limits("paged_decode_attention", 64, 4, 4, 8, 64)
    kivi_cache.set_backend("triton")
    try:
        assert ops._impl("cuda", "paged_decode_attention", _pool(96), 4, 4, 32) is ops._kernels
    finally:
        kivi_cache.set_backend("auto")

"""kernels/api.py, the op API: the kernels load, each op is the reference's twin in its signature, a head_dim the
kernels do not support is refused, and every kernel is launched with the floating-point fusion it was tuned with.
Builders and tolerances: kernel_cases.py."""

from __future__ import annotations

import pytest
import test_dequant as TDq  # the ops' own tests, run again under a launch spy: test_every_kernel_states_fp_fusion
import test_quantize as TQ
import torch
from kernel_cases import DEV, decode_case, make_pool, run_decode

from kivi_cache import reference as R
from kivi_cache.kernels import api as K
from kivi_cache.kernels import decode as KD


def test_available():
    assert K.available()


def test_kernels_take_the_references_arguments():
    """kernels/api.py: each public function is the twin of the reference's, "same signature ... a few extra
    keyword-only tuning arguments": the reference's parameters, in its order, of the same kind and default, and the
    extra ones keyword-only (a call written against the reference runs on the kernels)."""
    import inspect

    for name in ("quantize_and_write", "append_and_flush", "dequantize_pages", "paged_decode_attention",
                 "paged_prefix_attention"):
        kern = inspect.signature(getattr(K, name)).parameters
        ref = inspect.signature(getattr(R, name)).parameters
        assert [n for n in kern if n in ref] == list(ref), name
        for n, p in ref.items():
            assert (kern[n].kind, kern[n].default) == (p.kind, p.default), (name, n)
        assert all(p.kind == p.KEYWORD_ONLY for n, p in kern.items() if n not in ref), name


def test_head_dim_rejected():
    d = 96
    pool = make_pool(2, 1, 32, d, 32, 4, 4, torch.float16)
    q = torch.randn(1, 1, d, device=DEV, dtype=torch.float16)
    res = torch.randn(1, 1, 4, d, device=DEV, dtype=torch.float16)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    one = torch.ones(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="head_dim"):
        K.paged_decode_attention(q, bt, one * 32, *pool, res, res, one, 4, 4, 32, 0.1)
    kv = torch.randn(1, 1, 32, d, device=DEV, dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim"):
        K.quantize_and_write(kv, kv, one, one * 0, *pool, 4, 4, 32)


class _LaunchSpy:
    """A kernel whose launches record their ``enable_fp_fusion`` option, then run the real kernel."""

    def __init__(self, fn, seen: list, name: str):
        self.fn, self.seen, self.name = fn, seen, name

    @property
    def params(self):
        return self.fn.params

    def __getitem__(self, grid):
        launch = self.fn[grid]

        def call(*args, **kwargs):
            self.seen.append((self.name, kwargs.get("enable_fp_fusion")))
            return launch(*args, **kwargs)

        return call


def test_every_kernel_states_fp_fusion(monkeypatch):
    """Each kernel is launched with ``enable_fp_fusion=True`` (kernels._util.FP_FUSION): the setting the kernels were
    tuned with, which Triton 3.9 warns about when left to its default and turns off by default from 3.10."""
    from kivi_cache.kernels import dequant as Dq
    from kivi_cache.kernels import quantize as Q

    seen: list = []
    for mod, name in ((KD, "_SPLIT"), (KD, "_REDUCE"), (Q, "_QUANT"), (Q, "_APPEND")):
        launcher = getattr(mod, name)
        monkeypatch.setattr(launcher, "fn", _LaunchSpy(launcher.fn, seen, name))
    monkeypatch.setattr(Dq, "_dequant_kernel", _LaunchSpy(Dq._dequant_kernel, seen, "_dequant_kernel"))
    TQ.test_quantize_and_write(4, 4, torch.float32)
    TQ.test_append_and_flush(4, 4, torch.float16, 40)
    TDq.test_dequantize_pages(4, 4)
    run_decode(decode_case(2, 2, 2, 64, 64, 32, 4, 4, torch.float16, [96, 160], [5, 17]), "fp fusion", merge=False)
    assert {n for n, _ in seen} == {"_SPLIT", "_REDUCE", "_QUANT", "_APPEND", "_dequant_kernel"}, seen
    assert all(v is True for _, v in seen), seen

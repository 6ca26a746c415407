"""The host work of an eager decode step (batch 1 is host-bound on a GPU: launches cost more than the GPU work):
besides its one paged-attention call per layer, the cache must dispatch no more tensor operations than transformers'
DynamicCache with sdpa does for the same step (each is a kernel launch, ~5 us of host time, on a GPU)."""

from collections import Counter

import pytest
import torch
from models import tiny_llama, window_written_by_copies
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

import kivi_cache.layer as L
from kivi_cache import Int4PagedCache, cache_kwargs

# operations that only make views or read metadata: no kernel launch
VIEWS = {"view", "_unsafe_view", "t", "transpose", "select", "slice", "unsqueeze", "squeeze", "alias", "expand",
         "lift_fresh", "as_strided", "permute", "unbind", "split", "detach"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _decode_step_ops(model, cache, prompt):
    with torch.no_grad():
        out = model(prompt, **cache_kwargs(model, cache), use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        n = prompt.shape[1]
        model(tok, **cache_kwargs(model, cache), use_cache=True, cache_position=torch.tensor([n]))
        with _Count() as counter:
            model(tok, **cache_kwargs(model, cache), use_cache=True, cache_position=torch.tensor([n + 1]))
    return counter.ops


@pytest.mark.parametrize("fuse", [False, True])
def test_an_eager_decode_step_dispatches_no_more_tensor_ops_than_the_dynamic_cache(monkeypatch, fuse):
    layers = 3
    model = tiny_llama(layers=layers)
    prompt = torch.randint(0, 100, (1, 300), generator=torch.Generator().manual_seed(0))
    fp16 = _decode_step_ops(model, DynamicCache(), prompt)
    calls = []

    class Runner:  # stands in for the decode op's runner (on a GPU: the Triton kernels, two launches per call)
        def __init__(self, block_table, lengths, *pool, res_k, res_v, sliding_window=None, **kwargs):
            self.block_table, self.lengths, self.res_k = block_table, lengths, res_k
            self.sliding_window = sliding_window

        def __call__(self, q, *args, **kwargs):
            calls.append(q.shape)
            return q.new_zeros(q.shape)

    monkeypatch.setattr(L.ops, "DecodeRunner", Runner)
    with window_written_by_copies(active=not fuse):  # fuse: the op writes the window itself
        ours = _decode_step_ops(model, Int4PagedCache(), prompt)
    ours["new_zeros"] -= layers  # the stand-in's own outputs in the counted step
    assert len(calls) == 2 * layers  # the two decode steps (the first one is not counted)
    # per layer ours: the token's key and value into the window (2 copies; none when the op writes them) and no
    # length update (a view of a constant table); DynamicCache: 2 concatenations and the sdpa call. Nothing more may
    # creep in.
    assert sum(ours.values()) <= sum(fp16.values()), (+ours - fp16, +fp16 - ours)
    assert ours["copy_"] == (0 if fuse else 2 * layers) and ours["add_"] == 0 and ours["new_zeros"] == 0, ours

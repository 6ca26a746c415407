"""The residual window's rule (kivi_cache.window), on ints and on tensors alike."""

import itertools

import torch

from kivi_cache.window import capacity, window_append


def test_window_rule_on_ints_and_tensors():
    """Every (r, s, n) reachable from an empty window: sinks fill first, the window keeps between R and R + G - 1
    tokens beyond its sinks once it is longer, flushes whole groups, and tensors give the ints' answers."""
    for sink, resid, group in [(0, 0, 16), (4, 16, 16), (2, 128, 32), (3, 5, 8)]:
        rule = dict(sink_length=sink, residual_length=resid, group_size=group)
        cases = []
        for n_steps in itertools.product([1, 3, 17, 40], repeat=3):
            r = s = q = 0
            for n in n_steps:
                s2, c = window_append(r, s, n, **rule)
                cases.append((r, s, n, s2, c))
                assert s2 == min(sink, s + n) and c % group == 0 and c >= 0
                r, s, q = r + n - c, s2, q + c
                assert r - s < resid + group  # never a whole group beyond R left behind
                if q:
                    assert r - s >= resid  # once something is quantized, R newest tokens stay
                assert r <= capacity(sink, resid, group) or n > 1  # one token at a time fits the window
        r, s, n, s2, c = (torch.tensor(col) for col in zip(*cases, strict=True))
        ts, tc = window_append(r, s, n, **rule)
        assert torch.equal(ts, s2) and torch.equal(tc, c)

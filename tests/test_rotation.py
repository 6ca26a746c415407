"""Rotated keys and values (``QuantConfig.rotate``): the Hadamard matrix is orthogonal and symmetric (also block-wise
for head_dims that are not powers of two), attention through a rotated cache is the unrotated attention (8 bits:
the same tokens as full precision; materialized history in the model's basis), rotation spreads an outlier channel
so that per-token value groups quantize it with less error. Continuous batching with rotation: tests/test_cb.py."""

import pytest
import torch
from models import tiny_llama_d64
from transformers import DynamicCache

import kivi_cache
from kivi_cache import QuantConfig, QuantizedPagedCache, cache_kwargs, quant
from kivi_cache.rotation import hadamard


@pytest.mark.parametrize("d", [8, 64, 96, 128, 80])
def test_hadamard_is_symmetric_and_orthogonal(d):
    h = hadamard(d, torch.float64, "cpu")
    assert torch.allclose(h, h.T) and torch.allclose(h @ h, torch.eye(d, dtype=torch.float64), atol=1e-12)
    block = d & -d
    assert h[:block, :block].abs().min() == pytest.approx(block ** -0.5)  # a full Hadamard block: every entry +-1/sqrt
    if block < d:
        assert h[:block, block:].abs().max() == 0


@pytest.mark.parametrize("d", [4, 12, 36])
def test_head_dims_with_small_blocks_are_refused(d):
    with pytest.raises(ValueError, match="rotate needs a head_dim divisible by 8"):
        QuantConfig(key_bits=8, value_bits=8, group_size=4, rotate="keys").check_head_dim(d)


def test_rotate_values_are_checked():
    assert QuantConfig(rotate=True).rotate == "both" and QuantConfig(rotate=False).rotate == "none"
    with pytest.raises(ValueError, match="rotate must be one of"):
        QuantConfig(rotate="channels")


def _gen(model, ids, cache, n=20):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, **cache_kwargs(model, cache))[:, ids.shape[1]:]


@pytest.mark.parametrize("rotate", ["keys", "values", "both"])
def test_rotated_cache_attends_as_the_unrotated_one(rotate):
    """At 8 bits a rotated cache gives full precision's tokens, and its materialized history (layer.keys/values:
    what any other reader gets) is the model's keys and values, not the rotated ones."""
    model = tiny_llama_d64()
    ids = torch.randint(1, 128, (2, 150), generator=torch.Generator().manual_seed(0))
    ref_cache = DynamicCache()
    ref = _gen(model, ids, ref_cache)
    cache = QuantizedPagedCache(key_bits=8, value_bits=8, residual_length=32, sink_length=4, rotate=rotate)
    assert torch.equal(_gen(model, ids, cache), ref)
    for layer, ref_layer in zip(cache.layers, ref_cache.layers, strict=True):
        for got, want in ((layer.keys, ref_layer.keys), (layer.values, ref_layer.values)):
            assert (got - want).norm() / want.norm() < 0.02  # 8-bit codes; a rotated basis would be ~1.4


def test_rotation_spreads_an_outlier_channel_for_value_groups():
    """Values are quantized per token over groups of channels: one large channel sets its group's range and the
    other channels lose their precision; rotated, its energy spreads over every channel of the block."""
    g = torch.Generator().manual_seed(1)
    v = torch.randn(1, 2, 64, 64, generator=g)
    v[..., 5] *= 30
    h = hadamard(64, torch.float32, "cpu")
    for bits, bound in ((4, 0.6), (2, 0.8)):
        plain = quant.dequantize_values(*quant.quantize_values(v, bits, 32), 32, torch.float32)
        rotated = quant.dequantize_values(*quant.quantize_values(v @ h, bits, 32), 32, torch.float32) @ h
        assert (rotated - v).norm() < bound * (plain - v).norm(), bits


@pytest.mark.parametrize("rotate", ["values", "both"])
def test_static_cache_stores_and_attends_rotated_as_the_eager_cache(rotate):
    """StaticQuantizedPagedCache(rotate=...) (its decode step rotates the token, the query and the output itself)
    gives the eager rotated cache's tokens, at 2/4 bits where a basis mix-up would show."""
    model = tiny_llama_d64()
    ids = torch.randint(1, 128, (2, 160), generator=torch.Generator().manual_seed(2))
    kw = dict(key_bits=4, value_bits=2, group_size=32, residual_length=32, sink_length=4, rotate=rotate)
    eager = _gen(model, ids, QuantizedPagedCache(**kw), n=40)
    static = kivi_cache.StaticQuantizedPagedCache(model, 200, **kw)
    assert torch.equal(_gen(model, ids, static, n=40), eager)
    unrotated = _gen(model, ids, QuantizedPagedCache(**dict(kw, rotate="none")), n=40)
    assert not torch.equal(unrotated, eager)  # the rotation changes the 2-bit codes, hence some token

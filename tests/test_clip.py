"""Clipped quantization (``QuantConfig.clip``): the setting is checked, the range search never raises a group's
reconstruction error and lowers it where a group's extremes are outliers, and every cache that writes groups (eager
prompt and flush writes, the static cache's decode-step flush, continuous batching: tests/test_cb.py) stores the
reference's clipped groups."""

import pytest
import torch
from models import tiny_llama_d64
from transformers import DynamicCache

import kivi_cache
from kivi_cache import QuantConfig, QuantizedPagedCache, cache_kwargs, quant


def test_clip_values_are_checked():
    assert QuantConfig(clip=True).clip == "both" and QuantConfig(clip=False).clip == "none"
    assert QuantConfig(clip="keys").clip_args == dict(clip_keys=True, clip_values=False)
    assert QuantConfig().clip_args == dict(clip_keys=False, clip_values=False)
    with pytest.raises(ValueError, match="clip must be one of"):
        QuantConfig(clip="tokens")
    with pytest.raises(ValueError, match="clip must be one of"):
        QuantizedPagedCache(clip=1)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("which", ["keys", "values"])
def test_clipping_never_raises_a_groups_error(bits, which):
    """Per group, the clipped reconstruction's squared error is at most the plain one's (the plain range is the
    first candidate); at 2 bits, with outliers, it is much lower on the whole."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 64, 64, generator=g)
    x[..., 7] *= 6  # an outlier channel (value groups)
    x[..., 5, :] *= 6  # an outlier token (key groups)
    q, dq = ((quant.quantize_keys, quant.dequantize_keys) if which == "keys"
             else (quant.quantize_values, quant.dequantize_values))
    plain = dq(*q(x, bits, 32, torch.float16), 32, torch.float32)
    clipped = dq(*q(x, bits, 32, torch.float16, clip=True), 32, torch.float32)
    if which == "keys":  # per channel over 32 tokens
        err = lambda y: (y - x).square().reshape(2, 3, 2, 32, 64).sum(3)  # noqa: E731
    else:  # per token over 32 channels
        err = lambda y: (y - x).square().reshape(2, 3, 64, 2, 32).sum(-1)  # noqa: E731
    e_plain, e_clip = err(plain), err(clipped)
    assert (e_clip <= e_plain * (1 + 1e-6) + 1e-9).all()
    if bits == 2:
        assert e_clip.sum() < 0.8 * e_plain.sum()
    if bits == 8:  # at 256 levels the plain range is the best for nearly every group
        assert e_clip.sum() > 0.9 * e_plain.sum()


def test_a_nan_group_stays_nan_and_others_are_clipped():
    x = torch.randn(1, 1, 32, 64, generator=torch.Generator().manual_seed(3))
    x[0, 0, 3, 9] = float("nan")
    codes, scale, zero = quant.quantize_keys(x, 2, 32, torch.float16, clip=True)
    assert scale[0, 0, 0, 9].isnan() and zero[0, 0, 0, 9].isnan() and (codes[0, 0, :, 9] == 0).all()
    assert not scale[0, 0, 0, :9].isnan().any()


def _gen(model, ids, cache, n=30):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, **cache_kwargs(model, cache))[:, ids.shape[1]:]


@pytest.mark.parametrize("clip", ["keys", "values", "both"])
def test_eager_cache_stores_the_references_clipped_groups(clip):
    """Layer 0's keys of a prompt do not depend on the cache: its stored groups are the reference's quantization,
    clipped where ``clip`` asks, of the full-precision cache's keys and values."""
    model = tiny_llama_d64()
    ids = torch.randint(1, 128, (2, 160), generator=torch.Generator().manual_seed(4))
    kw = dict(key_bits=2, value_bits=2, group_size=32, residual_length=32)
    ref_cache, cache = DynamicCache(), QuantizedPagedCache(**kw, clip=clip)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, ref_cache))
        model(ids, **cache_kwargs(model, cache))
    layer, ref = cache.layers[0], ref_cache.layers[0]
    n = layer.paged_lens[0]
    assert n == 128 and layer.paged_lens == [n, n]
    k_want = quant.dequantize_keys(*quant.quantize_keys(ref.keys[:, :, :n], 2, 32, clip=clip != "values"), 32)
    v_want = quant.dequantize_values(*quant.quantize_values(ref.values[:, :, :n], 2, 32, clip=clip != "keys"), 32)
    assert torch.allclose(layer.keys[:, :, :n], k_want, atol=1e-6, rtol=0)
    assert torch.allclose(layer.values[:, :, :n], v_want, atol=1e-6, rtol=0)
    plain = quant.dequantize_keys(*quant.quantize_keys(ref.keys[:, :, :n], 2, 32), 32)
    if clip != "values":  # the test sees the difference
        assert not torch.allclose(layer.keys[:, :, :n], plain, atol=1e-3)


def test_static_cache_flushes_clipped_groups_as_the_eager_cache():
    """StaticQuantizedPagedCache(clip=...) (its decode steps flush through append_and_flush) gives the eager
    clipped cache's tokens; without clipping some token differs at 2 bits."""
    model = tiny_llama_d64()
    ids = torch.randint(1, 128, (2, 100), generator=torch.Generator().manual_seed(5))
    kw = dict(key_bits=2, value_bits=2, group_size=32, residual_length=32, sink_length=4, clip="both")
    eager = _gen(model, ids, QuantizedPagedCache(**kw), n=60)
    static = kivi_cache.StaticQuantizedPagedCache(model, 200, **kw)
    assert torch.equal(_gen(model, ids, static, n=60), eager)
    assert not torch.equal(_gen(model, ids, QuantizedPagedCache(**dict(kw, clip="none")), n=60), eager)

"""Per-layer code widths (``QuantizedPagedCache(layer_bits=[(key_bits, value_bits), ...])``): each layer stores at its
own widths (and so equals a cache of those widths for that layer), the eager and static caches agree, and a bad or
mis-sized list is refused before anything is stored (or, found at a later layer of the first forward, leaves the
cache marked unusable)."""

import pytest
import torch
from models import tiny_llama_d64

import kivi_cache
from kivi_cache import CacheUnusableError, QuantizedPagedCache, cache_kwargs


def _gen(model, ids, cache, n=16):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, **cache_kwargs(model, cache))[:, ids.shape[1]:]


def test_each_layer_stores_at_its_own_widths():
    model = tiny_llama_d64()
    ids = torch.randint(1, 128, (2, 150), generator=torch.Generator().manual_seed(0))
    mixed = QuantizedPagedCache(layer_bits=[(8, 8), (2, 4)], residual_length=32, sink_length=4)
    _gen(model, ids, mixed)
    assert [(x.cfg.key_bits, x.cfg.value_bits) for x in mixed.layers] == [(8, 8), (2, 4)]
    for i, (kb, vb) in enumerate([(8, 8), (2, 4)]):
        alone = QuantizedPagedCache(key_bits=kb, value_bits=vb, residual_length=32, sink_length=4)
        model(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, alone))
        single = QuantizedPagedCache(layer_bits=[(kb, vb), (kb, vb)], residual_length=32, sink_length=4)
        model(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, single))
        for name in ("k_codes", "v_codes", "k_scale", "v_scale"):
            assert torch.equal(single.layers[i].pool.tensors[name], alone.layers[i].pool.tensors[name])
    # the mixed cache's memory: each layer at its widths
    rep = [layer.memory_stats() for layer in mixed.layers]
    assert rep[0]["codes"] > rep[1]["codes"]


def test_static_cache_takes_the_same_layer_bits():
    model = tiny_llama_d64()
    ids = torch.randint(1, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    bits = [(4, 2), (8, 4)]
    eager = _gen(model, ids, QuantizedPagedCache(layer_bits=bits, **kivi_cache.config.PRESETS["int4"]
                                                 | dict(key_bits=4, value_bits=4)))
    static = kivi_cache.StaticQuantizedPagedCache(model, 200, layer_bits=bits)
    assert [(x.cfg.key_bits, x.cfg.value_bits) for x in static.layers] == bits
    assert torch.equal(_gen(model, ids, static), eager)


@pytest.mark.parametrize("bad,match", [([(8, 8), (3, 2)], r"layer_bits\[1\]: key_bits must be one of"),
                                      ([(8,)], r"layer_bits\[0\] must be a \(key_bits, value_bits\) pair"),
                                      ([], "non-empty list"), ("48", "non-empty list")])
def test_bad_layer_bits_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        QuantizedPagedCache(layer_bits=bad)


def test_a_short_list_is_refused_up_front_with_the_config_and_marks_the_cache_unusable_without():
    model = tiny_llama_d64()
    with pytest.raises(ValueError, match="layer_bits gives 1 layers' bits for a model of 2 layers"):
        QuantizedPagedCache(layer_bits=[(8, 8)], config=model.config)
    with pytest.raises(ValueError, match="layer_bits gives 1 layers' bits for a model of 2 layers"):
        kivi_cache.StaticQuantizedPagedCache(model, 64, layer_bits=[(8, 8)])
    cache = QuantizedPagedCache(layer_bits=[(8, 8)])
    ids = torch.randint(1, 128, (1, 20))
    with pytest.raises(ValueError, match="but the model has a layer 1"):
        model(ids, **cache_kwargs(model, cache))
    with pytest.raises(CacheUnusableError):
        model(ids, **cache_kwargs(model, cache))

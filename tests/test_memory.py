"""MemoryReport's baseline (a transformers DynamicCache of the same tokens) and break_even_tokens, on real caches."""

import pytest
import torch
from models import SMALL, tiny_llama, tiny_llama_d64
from transformers import DynamicCache

from kivi_cache import (
    Int2PagedCache,
    Int4PagedCache,
    Int8PagedCache,
    QuantConfig,
    QuantizedPagedCache,
    break_even_tokens,
    cache_kwargs,
)


def dynamic_bytes(cache: DynamicCache) -> int:
    """The bytes of a DynamicCache's tensors."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def prompt(model, cache, n: int, batch: int = 1) -> None:
    with torch.no_grad():
        model(torch.randint(0, 128, (batch, n)), **cache_kwargs(model, cache))


@pytest.mark.parametrize("padded", [False, True])
def test_baseline_is_a_dynamic_cache_of_the_same_tokens(padded):
    """The baseline counts what a DynamicCache holds after the same generate: its tensors' bytes (every position of
    every sequence, pads included) as allocated, the real tokens as live, in the model's dtype."""
    model = tiny_llama()
    ids = torch.randint(1, 128, (3, 90), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :20] = mask[2, :7] = 0
    caches = DynamicCache(), QuantizedPagedCache(key_bits=4, value_bits=2, sink_length=2, **SMALL)
    for cache in caches:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=20,
                           min_new_tokens=20, do_sample=False, pad_token_id=0)
    dyn, ours = caches
    rep = ours.memory_report()
    positions = dyn.get_seq_length()
    token_bytes = 2 * 4 * 32 * 4  # key and value, 4 heads of 32 channels, float32
    real = 3 * positions - int((mask == 0).sum())
    assert (rep.layers, rep.batch_size, rep.seq_length, rep.baseline_dtype) == (2, 3, positions, "float32")
    assert rep.baseline_allocated == dynamic_bytes(dyn) == 2 * 3 * positions * token_bytes
    assert rep.baseline_live == 2 * real * token_bytes
    assert rep.quantized_tokens + rep.residual_tokens == 2 * real  # the cache stores no pads either
    assert rep.live_ratio == pytest.approx(rep.live / rep.baseline_live) and rep.live_ratio < 0.6
    assert rep.allocated_ratio == pytest.approx(rep.allocated / rep.baseline_allocated) and rep.allocated_ratio < 1
    d = rep.to_dict()
    assert d["live_ratio"] == rep.live_ratio and d["baseline_allocated"] == rep.baseline_allocated


def test_report_text_names_both_comparisons():
    model = tiny_llama(layers=1)
    cache = Int4PagedCache()
    prompt(model, cache, 300)
    rep = cache.memory_report()
    text = str(rep)
    lines = text.splitlines()
    assert len(lines) == 5 and max(map(len, lines)) <= 120
    assert "1 layers, 1 sequence x 300 positions" in lines[0] and "DynamicCache of the same tokens in float32" in text
    assert f"live       {rep.live / 2**20:.3f} MiB = {rep.live_ratio:.2f} x the baseline's " in lines[1]
    assert f"allocated  {rep.allocated / 2**20:.3f} MiB = {rep.allocated_ratio:.2f} x the baseline's" in lines[3]
    assert f"{rep.baseline_allocated / 2**20:.3f} MiB" in lines[3]
    empty = QuantizedPagedCache().memory_report()
    assert empty.live_ratio != empty.live_ratio and "n/a x the baseline's" in str(empty)  # nan: nothing stored


@pytest.mark.parametrize("make,ratio", [
    (Int4PagedCache, 1.0), (Int4PagedCache, 0.5), (Int2PagedCache, 1.0), (Int2PagedCache, 0.45),
    (Int8PagedCache, 0.75),
    (lambda: QuantizedPagedCache(key_bits=2, value_bits=2, group_size=16, residual_length=16, page_size=32,
                                 sink_length=3), 0.6),
])
def test_break_even_tokens_is_where_the_report_stays_below(make, ratio):
    """From the length returned on, every length's live bytes are below ``ratio`` times the DynamicCache's (the
    report of a real cache at that length, and QuantConfig.live_bytes over many lengths after it); one token less
    is not."""
    model = tiny_llama_d64()  # 2 layers, 2 KV heads of 64 channels, float32
    cfg = make().quant_config
    n = break_even_tokens(make(), 64, torch.float32, ratio)
    assert n == break_even_tokens(cfg, 64, torch.float32, ratio)
    g = cfg.group_size
    for length in (n - 1, n, n + g - 1, n + g):
        cache = make()
        prompt(model, cache, length, batch=2)
        rep = cache.memory_report()
        assert rep.live == 2 * cfg.live_bytes(length, 64, torch.float32, num_heads=2) * 2  # layers, sequences
        assert rep.baseline_live == 2 * 2 * length * 2 * 2 * 64 * 4
        assert (rep.live_ratio < ratio) == (length >= n), length
    below = [cfg.live_bytes(m, 64, torch.float32) < ratio * 2 * m * 64 * 4 for m in range(1, n + 20 * g)]
    assert not below[n - 2] and all(below[n - 1:])  # below[i]: length i + 1


def test_break_even_without_savings_below_the_first_group():
    """ratio=1: the first length at which a group leaves the window (sinks + residual + group); below it the cache
    holds the tokens in full precision, exactly the DynamicCache's bytes, whatever the dtype."""
    for cfg in (Int4PagedCache().quant_config, QuantConfig(group_size=16, residual_length=0, page_size=16)):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            n = break_even_tokens(cfg, 64, dtype)
            assert n == cfg.sink_length + cfg.residual_length + cfg.group_size
            assert cfg.live_bytes(n - 1, 64, dtype) == 2 * (n - 1) * 64 * dtype.itemsize
            assert break_even_tokens(cfg, 64, dtype, 0.75) >= n


@pytest.mark.parametrize("args,match", [
    ((Int8PagedCache(), 64, torch.float16, 0.5), r"never gets below 0.5 x a torch.float16 DynamicCache: long "
                                                 r"sequences approach 0.5625 x \(1.125 bytes per element against 2\)"),
    ((Int4PagedCache(), 64, torch.float16, 0.0), r"ratio must be a number in \(0, 1\], got 0.0"),
    ((Int4PagedCache(), 64, torch.float16, 1.5), r"ratio must be a number in \(0, 1\], got 1.5"),
    ((dict(key_bits=4), 64, torch.float16), "config must be a QuantConfig or a kivi_cache cache, got dict"),
    ((Int4PagedCache(), 64, torch.int8), "dtype must be a floating-point torch.dtype"),
    ((Int4PagedCache(), 48, torch.float16), "group_size=32 must divide the model's head_dim=48"),
    ((Int4PagedCache(), 0, torch.float16), "head_dim must be an integer >= 1"),
])
def test_break_even_errors(args, match):
    with pytest.raises(ValueError, match=match):
        break_even_tokens(*args)

"""PagePool sizing: a first pool of the prompt's pages, growth by what a step needs or 1/8, and the warning of a
size budget that a cache outgrows."""

import warnings

import pytest
import torch
from models import SMALL, tiny_llama

from kivi_cache import Int4PagedCache, QuantConfig, QuantizedPagedCache, cache_kwargs
from kivi_cache.pool import PagePool


def forward(model, cache, ids):
    with torch.no_grad():
        return model(ids, **cache_kwargs(model, cache)).logits


def steps(model, cache, ids, prompt):
    """The first ``prompt`` tokens at once, then one at a time; the logits of every step."""
    out = [forward(model, cache, ids[:, :prompt])]
    out += [forward(model, cache, ids[:, t:t + 1]) for t in range(prompt, ids.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize("batch,n", [(1, 20), (1, 49), (2, 100), (3, 300)])
def test_first_pool_holds_the_prompts_pages(batch, n):
    """Without a budget the first update allocates exactly the pages the prompt's quantized tokens fill (none for a
    prompt that stays in the window), not a fixed number of pages."""
    model = tiny_llama(layers=1)
    cache = QuantizedPagedCache(**SMALL)  # group 16, residual 16, pages of 32
    forward(model, cache, torch.randint(0, 128, (batch, n)))
    layer = cache.layers[0]
    quantized = max(0, n - 16) // 16 * 16  # whole groups beyond the residual window
    need = batch * -(-quantized // 32)
    assert layer.pool.capacity == layer.pool.pages_in_use == need
    assert cache.memory_report().pages_total == need


def test_pool_grows_by_what_a_step_needs_or_an_eighth():
    pool = PagePool(QuantConfig(**SMALL), 2, 32, torch.float32, torch.device("cpu"))
    assert pool.capacity == 0
    pool.allocate_many(5)
    assert pool.capacity == 5  # the first growth: exactly the request
    pool.allocate()
    assert pool.capacity == 6  # one more page: the request (1/8 of 5 rounds up to 1)
    pool.allocate_many(pool.capacity - pool.pages_in_use + 3)
    assert pool.capacity == 9
    pool.reserve(80)
    assert pool.capacity == 89 and pool.pages_in_use == 9  # a prompt's reservation: exactly what it needs
    pool.allocate_many(80)
    pool.allocate()
    assert pool.capacity == 89 + 12  # an eighth of 89, rounded up
    assert all(t.shape[0] == pool.capacity for t in pool.tensors.values())


def ours(records):
    return [r for r in records if "size budget" in str(r.message)]


@pytest.mark.parametrize("budget,text", [
    (dict(num_pages=4), r"num_pages=4: 4 pages of 32 tokens in a layer's pool"),
    (dict(max_batch_size=1, max_cache_len=80), r"max_batch_size=1, max_cache_len=80: 2 pages of 32 tokens"),
])
def test_an_exceeded_budget_warns_once_and_the_pool_still_grows(budget, text):
    """A budget smaller than the tokens stored: the pools grow past it (same logits as a cache without one) and the
    cache warns once, naming the parameters and the pages needed; a second cache warns again."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 200))
    want = steps(model, QuantizedPagedCache(**SMALL), ids, 120)
    for _ in range(2):
        cache = QuantizedPagedCache(**SMALL, **budget)
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            got = steps(model, cache, ids, 120)
        assert torch.equal(got, want)
        assert len(ours(records)) == 1 and ours(records)[0].category is UserWarning
        message = str(ours(records)[0].message)
        assert text in message and "a layer needs 6 pages" in message, message
        assert all(layer.pool.capacity > cache.quant_config.num_pages for layer in cache.layers)


def test_no_warning_within_a_budget_or_without_one():
    model = tiny_llama(layers=1)
    ids = torch.randint(0, 128, (2, 150))
    caches = (QuantizedPagedCache(**SMALL, max_batch_size=2, max_cache_len=150), QuantizedPagedCache(**SMALL),
              Int4PagedCache(num_pages=10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cache in caches:
            steps(model, cache, ids, 100)
    assert caches[0].layers[0].pool.capacity == caches[0].quant_config.num_pages

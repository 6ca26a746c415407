"""Every operation of the cache is all or nothing: a refused call changes nothing, a call that fails part way marks
the cache unusable (``CacheUnusableError`` until ``reset()``), and the cache stores data, never autograd graphs.
tests/test_stateful.py drives random sequences of these operations against DynamicCache."""

import pytest
import torch
import transformers as T
from models import SMALL, tiny_llama
from transformers import DynamicCache

from kivi_cache import (
    CacheUnusableError,
    Int8PagedCache,
    QuantizedPagedCache,
    StaticQuantizedPagedCache,
    cache_kwargs,
    ops,
)
from kivi_cache.pool import PagePool

CFG = dict(key_bits=8, value_bits=8, group_size=16, residual_length=16, page_size=32)


def _state(cache):
    """Everything a layer's bookkeeping holds, and its stored history in full precision."""
    out = []
    for layer in cache.layers:
        out.append((layer.seen, [list(t) for t in layer.tables], layer.paged_lens[:], layer.window_lens[:],
                    layer.sinks[:], layer.pads[:], layer.hidden[:], list(layer.pool.refcount), sorted(layer.pool.free),
                    layer.keys.clone(), layer.values.clone()))
    return out


def _assert_same_state(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x[:-2] == y[:-2]
        assert torch.equal(x[-2], y[-2]) and torch.equal(x[-1], y[-1])


def _forward(model, ids, cache):
    with torch.no_grad():
        return model(ids, **cache_kwargs(model, cache)).logits


def _mixed_model():
    """Layer 0 full attention, layer 1 a sliding window of 24."""
    torch.manual_seed(0)
    cfg = T.Qwen2Config(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        use_sliding_window=True, sliding_window=24, max_window_layers=1)
    return T.Qwen2ForCausalLM(cfg).eval()


def test_a_refused_crop_changes_no_layer():
    """The sliding layer refuses to bring released tokens back; the full layer, checked first, must not have been
    cropped meanwhile (transformers' Cache.crop goes layer by layer)."""
    model = _mixed_model()
    ids = torch.randint(3, 128, (1, 150), generator=torch.Generator().manual_seed(0))
    cache = QuantizedPagedCache(**CFG)
    _forward(model, ids, cache)
    assert cache.layers[1].sliding_window == 24 and cache.layers[1].hidden[0] > 0
    assert cache.layers[0].sliding_window is None
    before = _state(cache)
    with pytest.raises(ValueError, match="sliding window"):
        cache.crop(-100)
    _assert_same_state(_state(cache), before)
    assert [layer.get_seq_length() for layer in cache.layers] == [150, 150]


def test_malformed_indices_are_refused_and_change_nothing():
    model = tiny_llama()
    ids = torch.randint(0, 100, (3, 40), generator=torch.Generator().manual_seed(1))
    cache = QuantizedPagedCache(**CFG)
    _forward(model, ids, cache)
    before = _state(cache)
    bad = [
        (cache.batch_select_indices, torch.tensor([True, False]), "bool mask must have one entry per sequence"),
        (cache.reorder_cache, torch.tensor([0.0, 1.5, 2.0]), "integer indices"),
        (cache.reorder_cache, torch.tensor([[0, 1, 2]]), "1-d tensor"),
        (cache.reorder_cache, [0, 1, 3], r"indices in \[0, 3\)"),
        (cache.reorder_cache, torch.tensor([0, -1, 2]), r"indices in \[0, 3\)"),
        (cache.batch_select_indices, [0, 1.0], "must hold ints"),
        (cache.batch_select_indices, "01", "1-d integer tensor"),
    ]
    for call, index, message in bad:
        with pytest.raises(IndexError, match=message):
            call(index)
        _assert_same_state(_state(cache), before)
    for repeats in (0, 1.5, True):
        with pytest.raises(ValueError, match="repeats must be an int >= 1"):
            cache.batch_repeat_interleave(repeats)
    with pytest.raises(ValueError, match="crop takes an int"):
        cache.crop(1.5)
    with pytest.raises(ValueError, match="layer_idx must be an int >= 0"):
        cache.update(torch.zeros(3, 4, 1, 32), torch.zeros(3, 4, 1, 32), -1)
    _assert_same_state(_state(cache), before)
    # the valid forms still work: a bool mask of the batch, a list, a tensor with repeats
    cache.batch_select_indices(torch.tensor([True, False, True]))
    cache.reorder_cache([1, 1])
    assert cache.batch_size == 2 and cache.layers[0].tables[0] == cache.layers[0].tables[1]


def test_states_of_another_dtype_or_device_are_refused_and_change_nothing():
    model = tiny_llama()
    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = QuantizedPagedCache(**CFG)
    _forward(model, ids, cache)
    before = _state(cache)
    k = torch.randn(1, 4, 1, 32)
    for key, value, message in [
        (k.to(torch.bfloat16), k.to(torch.bfloat16), "dtype and device of the tokens stored"),
        (k.long(), k.long(), "dtype and device of the tokens stored"),
        (k, k.double(), "must have one dtype"),
        (k.to("meta"), k.to("meta"), "dtype and device of the tokens stored"),
    ]:
        with pytest.raises(ValueError, match=message):
            cache.update(key, value, 0)
        _assert_same_state(_state(cache), before)
    assert cache.get_seq_length() == 40
    ref = DynamicCache()
    _forward(model, ids, ref)
    nxt = torch.tensor([[5]])
    torch.testing.assert_close(_forward(model, nxt, cache), _forward(model, nxt, ref), rtol=2e-2, atol=2e-2)


def test_a_store_that_fails_part_way_makes_the_cache_unusable_until_reset(monkeypatch):
    """A failure while a step is stored (out of memory while the pool grows, a kernel error) leaves the step
    counted but partly stored: every later use raises CacheUnusableError naming the cause, until reset()."""
    model = tiny_llama()
    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = QuantizedPagedCache(**CFG)
    _forward(model, ids, cache)

    def out_of_memory(self, n):
        raise torch.OutOfMemoryError("injected")

    with monkeypatch.context() as m:
        m.setattr(PagePool, "_grow", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            _forward(model, torch.randint(0, 100, (1, 600)), cache)  # the chunk's flush needs new pages
    for use in (lambda: cache.get_seq_length(), lambda: cache.crop(-1), lambda: cache.reorder_cache([0]),
                lambda: cache.batch_repeat_interleave(2), lambda: cache.layers[0].keys,
                lambda: _forward(model, torch.tensor([[1]]), cache)):
        with pytest.raises(CacheUnusableError, match="injected"):
            use()
    cache.reset()
    ref = DynamicCache()
    torch.testing.assert_close(_forward(model, ids, cache), _forward(model, ids, ref))
    assert cache.get_seq_length() == 40


def test_a_decode_step_whose_window_write_fails_makes_the_cache_unusable(monkeypatch):
    """The decode op writes the step's token into the window (already counted): if it fails, the window lacks the
    token, so the cache must refuse further use."""
    model = tiny_llama()
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(3))
    cache = QuantizedPagedCache(**CFG)
    _forward(model, ids, cache)

    def failing(self, *args, **kwargs):
        raise RuntimeError("injected kernel failure")

    with monkeypatch.context() as m:
        m.setattr(ops.DecodeRunner, "__call__", failing)
        with pytest.raises(RuntimeError, match="injected"):
            _forward(model, torch.tensor([[7]]), cache)
    with pytest.raises(CacheUnusableError, match="injected kernel failure"):
        _forward(model, torch.tensor([[7]]), cache)


def test_a_failure_between_layers_of_one_forward_makes_the_cache_unusable():
    """Layer 0 stored the step, layer 1 refused its states: the layers disagree on the length."""
    cache = QuantizedPagedCache(**CFG)
    k = torch.randn(1, 4, 5, 32)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="dtype and device"):
        cache.update(k.double(), k.double(), 1)
    with pytest.raises(CacheUnusableError, match="update of layer 1"):
        cache.get_seq_length()
    cache.reset()
    cache.update(k, k, 0)
    assert cache.get_seq_length() == 5


def test_a_refusal_on_the_first_layer_leaves_the_cache_usable():
    cache = QuantizedPagedCache(**CFG)
    k = torch.randn(1, 4, 5, 32)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    with pytest.raises(ValueError):
        cache.update(k.double(), k.double(), 0)
    assert cache.get_seq_length() == 5
    cache.update(k, k, 0)
    assert cache.get_seq_length() == 10


def test_a_forward_with_autograd_stores_no_graph():
    """Without torch.no_grad the forward attends as usual (gradients flow through the step), the stored codes,
    scales and window hold no autograd history, and the cache keeps working."""
    model = tiny_llama()
    ids = torch.randint(0, 100, (1, 200), generator=torch.Generator().manual_seed(4))
    cache = Int8PagedCache(**dict(SMALL))
    logits = model(ids, **cache_kwargs(model, cache)).logits
    logits.sum().backward()  # the prompt's attention keeps its graph
    layer = cache.layers[0]
    assert layer.paged_lens[0] > 0
    assert not any(t.requires_grad for t in (*layer.pool.args(), layer.res_k, layer.res_v))
    assert layer.keys.shape[2] == 200 and not layer.keys.requires_grad
    for t in range(3):  # decode steps with grad on: the window write and the flushes
        model(torch.tensor([[t + 1]]), **cache_kwargs(model, cache))
    assert not any(t.requires_grad for t in (*layer.pool.args(), layer.res_k, layer.res_v))
    ref = Int8PagedCache(**dict(SMALL))
    with torch.no_grad():
        model(ids, **cache_kwargs(model, ref))
        for t in range(3):
            model(torch.tensor([[t + 1]]), **cache_kwargs(model, ref))
    assert torch.equal(layer.keys, ref.layers[0].keys) and torch.equal(layer.values, ref.layers[0].values)


def _generate(model, ids, cache, n=20):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False)


STATIC_CFG = dict(key_bits=4, value_bits=2, group_size=16, residual_length=16, page_size=32, sink_length=2)


def test_every_cache_class_generates_again_after_reset():
    from kivi_cache import Int2PagedCache, Int4PagedCache

    model = tiny_llama()
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(5))
    other = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(6))
    makers = [lambda: QuantizedPagedCache(**CFG), lambda: Int4PagedCache(**SMALL),
              lambda: Int2PagedCache(group_size=32), lambda: Int8PagedCache(residual_length=16),
              lambda: StaticQuantizedPagedCache(model, 96, **STATIC_CFG)]
    for make in makers:
        cache = make()
        first = _generate(model, ids, cache)
        cache.reset()
        assert cache.get_seq_length() == 0
        assert torch.equal(_generate(model, other, cache), _generate(model, other, make()))
        cache.reset()
        assert torch.equal(_generate(model, ids, cache), first)


def test_static_reset_keeps_the_tensors_a_compiled_step_captured():
    model = tiny_llama()
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(5))
    cache = StaticQuantizedPagedCache(model, 96, **STATIC_CFG)
    _generate(model, ids, cache)
    layer = cache.layers[0]
    captured = [layer.res_k, layer.res_v, layer.block_table, layer.paged_len, layer.window_len, layer.sink_len,
                layer.seen_t, *layer.pool.args()]
    cache.reset()
    assert not layer.static and cache.get_seq_length() == 0
    _generate(model, ids, cache)
    now = [layer.res_k, layer.res_v, layer.block_table, layer.paged_len, layer.window_len, layer.sink_len, layer.seen_t,
           *layer.pool.args()]
    assert all(a is b for a, b in zip(captured, now, strict=True))


def _greedy_steps(model, ids, cache, n):
    """Greedy decoding one forward at a time: yields after the prompt and after each of ``n`` steps."""
    with torch.no_grad():
        seq = torch.cat([ids, _forward(model, ids, cache)[:, -1:].argmax(-1)], 1)
        yield seq
        for _ in range(n):
            logits = model(seq[:, -1:], **cache_kwargs(model, cache),
                           cache_position=torch.tensor([seq.shape[1] - 1])).logits
            seq = torch.cat([seq, logits[:, -1:].argmax(-1)], 1)
            yield seq


def test_two_static_caches_of_one_model_in_use_at_once():
    """Interleaved steps of two static caches (two threads each with its own cache do this): each step is served
    by its own cache's layer, not the one bound last."""
    model = tiny_llama()
    a_ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(7))
    b_ids = torch.randint(0, 100, (2, 30), generator=torch.Generator().manual_seed(8))
    solo = [list(_greedy_steps(model, ids, StaticQuantizedPagedCache(model, 96, **STATIC_CFG), 9))[-1]
            for ids in (a_ids, b_ids)]
    caches = [StaticQuantizedPagedCache(model, 96, **STATIC_CFG) for _ in range(2)]
    for cache, other in (caches, caches[::-1]):
        def update(k, v, layer_idx, *args, cache=cache, other=other, real=cache.update, **kwargs):
            out = real(k, v, layer_idx, *args, **kwargs)
            other._bind(layer_idx)  # the other thread's update of this layer runs between ours and our attention
            return out

        cache.update = update
    a = _greedy_steps(model, a_ids, caches[0], 9)
    b = _greedy_steps(model, b_ids, caches[1], 9)
    steps = list(zip(a, b, strict=True))  # each cache's step follows the other's
    assert torch.equal(steps[-1][0], solo[0]) and torch.equal(steps[-1][1], solo[1])

"""QuantizedPagedCache against transformers' DynamicCache on tiny random models."""

import collections

import pytest
import torch
from models import SMALL, decisive_prompt, tiny_llama, tiny_llama_d64, tiny_qwen2, window_written_by_copies
from transformers import DynamicCache

import kivi_cache
from kivi_cache import QuantizedPagedCache, cache_kwargs, quant

GEN = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False)


def gen(model, ids, cache, attention_mask=None, **kw):
    args = dict(GEN, **kw)
    with torch.no_grad():
        return model.generate(ids, attention_mask=attention_mask, **cache_kwargs(model, cache), **args)


def stepwise_logits(model, ids, cache, prefill):
    """Prefill ``prefill`` tokens, then feed the rest one at a time; logits for every position."""
    with torch.no_grad():
        out = [model(ids[:, :prefill], **cache_kwargs(model, cache)).logits]
        for t in range(prefill, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], **cache_kwargs(model, cache)).logits)
    return torch.cat(out, 1)


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
@pytest.mark.parametrize("kw", [SMALL, dict(group_size=32, residual_length=32, page_size=64)])
def test_int8_greedy_tokens_equal_dynamic_cache(make, kw):
    model = make()
    ids = decisive_prompt(model, 70, margin=0.005)
    ref = gen(model, ids, DynamicCache())
    cache = QuantizedPagedCache(key_bits=8, value_bits=8, **kw)
    out = gen(model, ids, cache)
    assert cache.memory_report().quantized_tokens > 0  # pages were really used
    assert torch.equal(out, ref)


# the relative logit error these models give over 80 decode steps: llama int8 9.5e-4, int4 1.7e-2, int2 8.3e-2;
# qwen2 int8 1.5e-3, int4 3.1e-2, int2 1.2e-1. Each bound is about twice the larger of the two (three times at 8 bits)
BOUNDS = {8: 5e-3, 4: 6e-2, 2: 2.5e-1}


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
def test_logit_error_bounded_and_ordered_by_bits(make):
    model = make()
    ids = torch.randint(0, 128, (2, 120))
    with torch.no_grad():
        full = model(ids).logits
    errs = {}
    for bits in (8, 4, 2):
        logits = stepwise_logits(model, ids, QuantizedPagedCache(key_bits=bits, value_bits=bits, **SMALL), 40)
        errs[bits] = float((logits - full).norm() / full.norm())
        assert errs[bits] < BOUNDS[bits], (bits, errs[bits])
    assert errs[8] < errs[4] < errs[2]
    assert errs[8] > 0


def test_full_precision_cache_path_is_exact_before_any_flush():
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 60))
    with torch.no_grad():
        full = model(ids).logits
    logits = stepwise_logits(model, ids, QuantizedPagedCache(key_bits=2, value_bits=2, residual_length=128), 20)
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kb,vb", [(4, 4), (2, 4), (2, 2)])
def test_stored_history_is_fake_quantized_original(kb, vb):
    """Pages hold exactly quantize->dequantize of the keys/values a DynamicCache holds; the window holds them raw."""
    model = tiny_qwen2()
    ids = torch.randint(0, 128, (1, 75))
    dyn = DynamicCache()
    cache = QuantizedPagedCache(key_bits=kb, value_bits=vb, **SMALL)
    stepwise_logits(model, ids, dyn, 33)
    stepwise_logits(model, ids, cache, 33)
    layer = cache.layers[0]  # the first layer's keys do not depend on earlier quantized attention
    k_ref, v_ref = dyn.layers[0].keys, dyn.layers[0].values
    k, v = layer._stored_layout(layer.seen)
    q = layer.paged_lens[0]
    assert q == 48 and layer.window_lens[0] == 27  # 75 = 48 quantized + 27 (R=16 .. R+G-1=31)
    g = SMALL["group_size"]
    fake_k = quant.dequantize_keys(*quant.quantize_keys(k_ref[:, :, :q], kb, g), g)
    fake_v = quant.dequantize_values(*quant.quantize_values(v_ref[:, :, :q], vb, g), g)
    torch.testing.assert_close(k[:, :, :q], fake_k, rtol=0, atol=1e-6)
    torch.testing.assert_close(v[:, :, :q], fake_v, rtol=0, atol=1e-6)
    assert torch.equal(k[:, :, q:], k_ref[:, :, q:]) and torch.equal(v[:, :, q:], v_ref[:, :, q:])


def test_stored_layout_in_one_copy_equals_the_per_sequence_copies(monkeypatch):
    """The history eager attention reads (``_stored_layout``): without pads or released pages one concatenation of
    sinks, quantized tokens and window gives what the per-sequence copies into zeros give."""
    from kivi_cache import layer as L

    model = tiny_llama(layers=1)
    cache = QuantizedPagedCache(key_bits=2, value_bits=4, sink_length=4, **SMALL)
    stepwise_logits(model, torch.randint(0, 128, (2, 70)), cache, 21)
    layer = cache.layers[0]
    assert layer.paged_lens == [48, 48] and layer.sinks == [4, 4] and layer.window_lens == [22, 22]
    tail = (torch.randn(2, layer.num_heads, 3, layer.head_dim), torch.randn(2, layer.num_heads, 3, layer.head_dim))
    fast = layer._stored_layout(layer.seen)
    fast_tail = layer._stored_layout(layer.seen, tail=tail)  # a chunk's tokens appended in the same buffer
    monkeypatch.setattr(L, "all_equal", lambda xs: False)  # the general path
    slow = layer._stored_layout(layer.seen)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))
    assert all(torch.equal(a, torch.cat([b, t], dim=2)) for a, b, t in zip(fast_tail, slow, tail, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fast_tail, layer._stored_layout(layer.seen, tail=tail), strict=True))


def test_residual_window_invariant_over_many_steps():
    model = tiny_llama(layers=1)
    cache = QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL)
    ids = torch.randint(0, 128, (1, 5))
    stepwise_logits(model, torch.randint(0, 128, (1, 100)), cache, 5)
    layer = cache.layers[0]
    r, g = SMALL["residual_length"], SMALL["group_size"]
    assert r <= layer.window_lens[0] < r + g and layer.paged_lens[0] % g == 0
    assert layer.paged_lens[0] + layer.window_lens[0] == 100 == cache.get_seq_length()
    del ids


@pytest.mark.parametrize("padded", [False, True])
def test_window_write_left_to_the_decode_op_gives_the_same_logits(monkeypatch, padded):
    """A one-token step without a flush leaves its window write to the decode op (new_k/new_v); a flush step writes
    first (the flush reads the window). Same logits and stored state as the two copies
    (models.window_written_by_copies); every non-flush step deferred."""
    from kivi_cache import layer as L

    model = tiny_qwen2(layers=1)
    ids = torch.randint(0, 128, (2, 90))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0  # windows of different lengths: the indexed write path

    def run(fuse):
        seen = []

        class Spy(L.ops.DecodeRunner):  # every decode step's call: whether it hands the op the step's token
            def __call__(self, q, res_lengths, sm_scale, new_k=None, new_v=None, sink_logits=None):
                seen.append(new_k is not None)
                return super().__call__(q, res_lengths, sm_scale, new_k, new_v, sink_logits)

        monkeypatch.setattr(L.ops, "DecodeRunner", Spy)
        cache = QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL)
        with torch.no_grad(), window_written_by_copies(active=not fuse):
            out = [model(ids[:, :10], attention_mask=mask[:, :10], **cache_kwargs(model, cache)).logits]
            for t in range(10, ids.shape[1]):
                out.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], **cache_kwargs(model, cache)).logits)
        monkeypatch.undo()
        return torch.cat(out, 1), cache.layers[0], seen

    a, la, seen_a = run(False)
    b, lb, seen_b = run(True)
    assert torch.equal(a, b)
    assert torch.equal(la.res_k, lb.res_k) and torch.equal(la.res_v, lb.res_v) and la.window_lens == lb.window_lens
    assert not any(seen_a)
    flushes = sum(1 for x in seen_b if not x)
    assert 0 < flushes < len(seen_b) // 4 and len(seen_b) == 80  # deferred everywhere but at the flushes


@pytest.mark.parametrize("attn", ["eager", "kivi"])
def test_other_attention_implementations_stay_correct(attn):
    model = tiny_llama(attn=attn)
    ids = torch.randint(0, 128, (1, 70))
    ref = gen(model, ids, DynamicCache())
    assert torch.equal(gen(model, ids, QuantizedPagedCache(key_bits=8, value_bits=8, **SMALL)), ref)


def test_named_and_default_paths_agree_at_4_bits():
    ids = torch.randint(0, 128, (1, 70))
    outs = [gen(tiny_llama(attn=a), ids, QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL))
            for a in ("sdpa", "kivi", "eager")]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_beam_search_matches_dynamic_cache_at_8_bits():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 50))
    kw = dict(num_beams=3, max_new_tokens=24, min_new_tokens=24)
    ref = gen(model, ids, DynamicCache(), **kw)
    cache = QuantizedPagedCache(key_bits=8, value_bits=8, **SMALL)
    out = gen(model, ids, cache, **kw)
    assert torch.equal(out, ref)
    layer = cache.layers[0]
    # beams share pages: fewer pages in use than 3 private copies would need
    private = sum(-(-q // SMALL["page_size"]) for q in layer.paged_lens)
    assert layer.pool.pages_in_use <= private


def _left_pad(prompts, pad_id=0):
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    return ids, mask


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_padded_batch_gives_same_tokens_as_alone(bits):
    model = tiny_qwen2()
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (37, 70, 51)]
    ids, mask = _left_pad(prompts)
    cache = QuantizedPagedCache(key_bits=bits, value_bits=bits, **SMALL)
    batch = gen(model, ids, cache, attention_mask=mask)
    assert cache.layers[0].pads == [33, 0, 19]  # pad tokens were not stored
    for i, p in enumerate(prompts):
        alone = gen(model, torch.tensor([p]), QuantizedPagedCache(key_bits=bits, value_bits=bits, **SMALL))
        assert torch.equal(batch[i, ids.shape[1]:], alone[0, len(p):]), i


def test_prompt_and_decode_never_build_an_n_by_n_visibility(monkeypatch):
    """A prompt on an empty cache (padded or not) and the one-token steps only need which tokens are real: the
    [B, n, n] chunk visibility (n * n bools per sequence: 1 GiB at a 32k prompt) is built only for a chunk on a
    filled cache."""
    from kivi_cache import layer as L

    built = []
    real = L.chunk_visibility
    monkeypatch.setattr(L, "chunk_visibility", lambda *a: built.append(a[1]) or real(*a))
    model = tiny_qwen2()
    ids, mask = _left_pad([torch.randint(1, 128, (n,)).tolist() for n in (37, 70)])
    gen(model, ids, QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL), attention_mask=mask)
    gen(model, torch.randint(0, 128, (1, 60)), QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL))
    assert built == []
    with torch.no_grad():  # a 9-token chunk on a filled cache does need it (and gets it)
        cache = QuantizedPagedCache(key_bits=8, value_bits=8, **SMALL)
        for s in (0, 60):
            model(torch.randint(0, 128, (1, 60 if s == 0 else 9)), **cache_kwargs(model, cache))
    assert built == [9] * len(cache.layers)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_valid_tokens_reads_padding_from_bool_and_additive_masks(dtype):
    from kivi_cache.masks import MaskReader, chunk_visibility

    _valid_tokens, _chunk_visibility = MaskReader().valid_tokens, chunk_visibility

    real = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    vis = torch.ones(5, 5, dtype=torch.bool).tril()[None] & real[:, None, :]
    mask = vis[:, None] if dtype == torch.bool else torch.where(vis, 0.0, torch.finfo(dtype).min)[:, None]
    assert torch.equal(_valid_tokens(mask, 5, 2), real)
    assert torch.equal(_chunk_visibility(mask, 5, 2, "cpu"), vis)
    assert _valid_tokens(mask[1:], 5, 1) is None and _valid_tokens(None, 5, 2) is None


def test_padding_flags_are_read_back_once_per_forward_not_per_layer(monkeypatch):
    """Deciding that a step's tokens are all real reads a flag from the device; for a padded batch that was a
    sync per layer and step on a GPU. Every layer of a forward gets the same mask tensor, so it is read once."""
    import sys

    from kivi_cache import masks as M

    reads = []
    real_any = torch.Tensor.any

    def counting_any(self, *a, **k):
        # the caller's file from its frame: inspect.stack() built the context of every frame of the stack at each
        # Tensor.any call of generate (25 s of this test's 25.5 s)
        if sys._getframe(1).f_code.co_filename == M.__file__:
            reads.append(1)
        return real_any(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "any", counting_any)
    model = tiny_llama(layers=3)
    ids, mask = _left_pad([torch.randint(1, 128, (n,)).tolist() for n in (20, 33)])
    cache = QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL)
    out = gen(model, ids, cache, attention_mask=mask)
    forwards = out.shape[1] - ids.shape[1]  # the prompt's forward and one per new token after the first
    assert 0 < len(reads) <= forwards, (len(reads), forwards)


def test_padding_flag_memo_follows_in_place_changes_of_the_mask():
    from kivi_cache.masks import MaskReader

    _valid_tokens = MaskReader().valid_tokens
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    assert _valid_tokens(mask, 1, 2) is None
    mask[1, 0, 0, -1] = False  # the same tensor, modified: not the remembered answer
    assert torch.equal(_valid_tokens(mask, 1, 2), torch.tensor([[True], [False]]))
    other = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    assert _valid_tokens(other, 1, 2) is None


@pytest.mark.parametrize("shared", [False, True])
def test_flush_fast_path_matches_the_per_sequence_loop(monkeypatch, shared):
    """A uniform batch's flush reserves one group for every sequence in one go; the page ids, tables, lengths and
    stored bytes equal the per-sequence loop's, also where sequences share pages (copy-on-write)."""
    from kivi_cache import layer as L

    def run(fast):
        if not fast:
            monkeypatch.setattr(L.QuantizedPagedLayer, "_reserve_one_group_each", lambda self: None)
        torch.manual_seed(0)
        cache = QuantizedPagedCache(key_bits=4, value_bits=4, group_size=16, residual_length=16, page_size=48)
        k = torch.randn(3, 2, 60, 32)  # 32 quantized tokens: page 0 is partly filled when the beams share it
        cache.update(k, k.flip(-1), 0)
        layer = cache.layers[0]
        layer.commit(layer.pending)
        if shared:
            cache.batch_repeat_interleave(2)  # beams share every page: the next writes copy on write
        for _ in range(100):  # flushes into fresh and partly filled pages
            one = torch.randn(layer.batch_size, 2, 1, 32)
            cache.update(one, -one, 0)
            layer.commit(layer.pending)
        monkeypatch.undo()
        return layer

    a, b = run(True), run(False)
    assert a.tables == b.tables and a.paged_lens == b.paged_lens and a.pool.free == b.pool.free
    assert a.pool.refcount == b.pool.refcount
    for x, y in zip(a.pool.args(), b.pool.args(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("shared", [False, True])
def test_device_state_kept_through_decode_flushes_equals_a_fresh_upload(shared):
    """A decode step's flush updates the cached block table, quantized and window lengths in place (a new page
    column, lengths + G, a row of the constant length table) instead of uploading them again; at every step they
    equal a fresh upload, also where beams share pages (copy-on-write forces the upload). The block table has spare
    columns up to a power of two: a new page column goes into one in place (the same tensor, so the layer's decode
    runner stays valid), and the table is replaced only where its width passes a power of two; a flush into the
    last column's pages reads their ids from the table (no upload)."""
    torch.manual_seed(0)
    cache = QuantizedPagedCache(key_bits=4, value_bits=4, group_size=16, residual_length=16, page_size=48)
    k = torch.randn(3, 2, 60, 32)
    cache.update(k, k.flip(-1), 0)
    layer = cache.layers[0]
    layer.commit(layer.pending)
    if shared:
        cache.batch_repeat_interleave(2)
    kept = appends = crossings = replaced = same_flushes = 0
    uploads = []
    real_upload = layer._upload
    layer._upload = lambda a: uploads.append(a) or real_upload(a)
    steps = 250
    for _ in range(steps):
        cached = layer._device_state()
        w0 = len(layer.tables[0])
        assert cached[0].shape[1] == 1 << (w0 - 1).bit_length() and (cached[0][:, w0:] == -1).all()
        one = torch.randn(layer.batch_size, 2, 1, 32)
        q0, n_up = layer.paged_lens[0], len(uploads)
        cache.update(one, -one, 0)
        layer.commit(layer.pending)
        dev = layer._device_tables
        kept += dev is not None and dev[0] is not None and dev is not cached
        w1 = len(layer.tables[0])
        if layer.paged_lens[0] != q0 and w1 == w0 and not shared:  # a flush into the last column's pages: no upload
            same_flushes += 1
            assert len(uploads) == n_up
        appends += w1 > w0
        crossings += (w0 - 1).bit_length() != (w1 - 1).bit_length()
        replaced += layer._device_tables is not None and layer._device_tables[0] is not cached[0]
        assert shared or layer._device_tables[1] is cached[1]  # the paged lengths grow in place (the runner keeps them)
        now = layer._device_state()
        layer._device_tables = None
        fresh = layer._device_state()
        for x, y in zip(now, fresh, strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y)
        layer._device_tables = now  # continue from the kept state
    # every step kept (and updated) the device state, except a flush that copied a shared page (tables changed)
    assert kept == steps if not shared else 0.9 * steps <= kept < steps
    if not shared:  # new columns mostly written in place
        assert appends >= 5 and replaced == crossings < appends and same_flushes >= 5, (appends, crossings, replaced,
                                                                                         same_flushes)


def test_window_length_rows_are_views_with_one_alignment():
    """The one-token step's window lengths are rows of a constant table shared by the layers: contiguous, equal to
    r everywhere, never copied, and all at the same 16-byte alignment (one specialization of the decode kernel)."""
    cache = QuantizedPagedCache(key_bits=4, value_bits=4, group_size=16, residual_length=16)
    k = torch.randn(3, 2, 20, 32)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    a, b = cache.layers
    base = a._uniform_lengths(0).data_ptr()
    for r in range(a.res_k.shape[2] + 1):
        row = a._uniform_lengths(r)
        assert row.shape == (3,) and row.is_contiguous() and torch.equal(row, torch.full((3,), r, dtype=torch.int32))
        assert (row.data_ptr() - base) % 16 == 0
        assert b._uniform_lengths(r).data_ptr() == row.data_ptr()  # shared by the layers


def test_padded_batch_under_inference_mode():
    """Inference-mode tensors have no version counter (the padding-flag memo keys on it): same tokens as no_grad."""
    model = tiny_qwen2()
    ids, mask = _left_pad([torch.randint(1, 128, (n,)).tolist() for n in (20, 41)])
    ref = gen(model, ids, QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL), attention_mask=mask)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, **cache_kwargs(model, QuantizedPagedCache(
            key_bits=4, value_bits=4, **SMALL)), **GEN)
    assert torch.equal(out, ref)


def test_continued_generation_chunk_over_quantized_past():
    """A second generate call feeds a multi-token chunk on top of a filled cache (paged prefix attention)."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 60))
    dyn, cache = DynamicCache(), QuantizedPagedCache(key_bits=8, value_bits=8, **SMALL)
    a_ref, a = gen(model, ids, dyn), gen(model, ids, cache)
    assert torch.equal(a, a_ref)
    more = torch.randint(0, 128, (1, 9))
    b_ref = gen(model, torch.cat([a_ref, more], 1), dyn)
    b = gen(model, torch.cat([a, more], 1), cache)
    assert torch.equal(b, b_ref)


def test_chunked_prefill_matches_single_prefill_logits():
    model = tiny_qwen2()
    ids = torch.randint(0, 128, (2, 90))
    with torch.no_grad():
        full = model(ids).logits
        cache = QuantizedPagedCache(key_bits=8, value_bits=8, **SMALL)
        parts = [model(ids[:, s:s + 30], **cache_kwargs(model, cache)).logits for s in (0, 30, 60)]
    err = (torch.cat(parts, 1) - full).norm() / full.norm()
    assert err < BOUNDS[8]


def test_assisted_decoding_with_crop():
    model = tiny_llama()
    assistant = tiny_llama(seed=1)
    ids = torch.randint(0, 128, (1, 60))
    ref = gen(model, ids, DynamicCache())
    out = gen(model, ids, QuantizedPagedCache(key_bits=8, value_bits=8, **SMALL), assistant_model=assistant)
    assert torch.equal(out, ref)


def test_prompt_lookup_decoding_matches_dynamic_cache():
    """Every candidate accepted: transformers >= 5.24 then calls ``crop(0)``, which removes nothing."""
    model = tiny_llama()
    head = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([head, head[:, :20]], 1)  # a repeat: the lookup's candidates are taken whole
    ref = gen(model, ids, DynamicCache())
    cache = QuantizedPagedCache(key_bits=8, value_bits=8, **SMALL)
    out = gen(model, ids, cache, prompt_lookup_num_tokens=5)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == out.shape[1] - 1


def test_crop_zero_removes_nothing():
    model = tiny_llama()
    cache = QuantizedPagedCache(key_bits=8, value_bits=8, **SMALL)
    stepwise_logits(model, torch.randint(0, 128, (1, 50)), cache, 40)
    cache.crop(0)
    assert cache.get_seq_length() == 50 and cache.layers[0].paged_lens[0] + cache.layers[0].window_lens[0] == 50


def test_crop_within_residual_equals_never_having_seen_the_tokens():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 80))
    a = QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL)
    b = QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL)
    stepwise_logits(model, ids[:, :78], a, 40)  # 48 quantized + 30 in the window
    stepwise_logits(model, ids[:, :75], b, 40)  # 48 quantized + 27
    a.crop(-3)
    assert a.get_seq_length() == b.get_seq_length() == 75
    assert a.layers[0].paged_lens == b.layers[0].paged_lens == [48]
    nxt = ids[:, 75:76]
    with torch.no_grad():
        la = model(nxt, **cache_kwargs(model, a)).logits
        lb = model(nxt, **cache_kwargs(model, b)).logits
    assert torch.equal(la, lb)


def test_crop_into_pages_releases_them_and_keeps_working():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 130))
    cache = QuantizedPagedCache(key_bits=8, value_bits=8, **SMALL)
    stepwise_logits(model, ids, cache, 40)
    layer = cache.layers[0]
    used = layer.pool.pages_in_use
    cache.crop(-70)
    assert cache.get_seq_length() == 60
    assert layer.paged_lens[0] + layer.window_lens[0] == 60 and layer.paged_lens[0] % 16 == 0
    assert layer.pool.pages_in_use < used
    cache.crop(50)  # legacy form: keep the first 50
    assert cache.get_seq_length() == 50
    with torch.no_grad():
        dyn = DynamicCache()
        model(ids[:, :50], **cache_kwargs(model, dyn))
        ref = model(ids[:, 50:52], **cache_kwargs(model, dyn)).logits
        got = model(ids[:, 50:52], **cache_kwargs(model, cache)).logits
    assert (got - ref).norm() / ref.norm() < BOUNDS[8]


def test_batch_select_indices_matches_cache_built_from_those_rows():
    model = tiny_qwen2()
    ids = torch.randint(0, 128, (3, 70))
    full = QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL)
    stepwise_logits(model, ids, full, 30)
    full.batch_select_indices(torch.tensor([2, 0]))
    part = QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL)
    stepwise_logits(model, ids[[2, 0]], part, 30)
    nxt = torch.randint(0, 128, (2, 1))
    with torch.no_grad():
        a = model(nxt, **cache_kwargs(model, full)).logits
        b = model(nxt, **cache_kwargs(model, part)).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert full.batch_size == 2


def test_pages_are_reused_and_pool_does_not_grow_past_live_tokens():
    model = tiny_llama(layers=1)
    cache = QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL)
    ids = torch.randint(0, 128, (4, 300))
    stepwise_logits(model, ids[:, :200], cache, 100)
    layer = cache.layers[0]
    cap = layer.pool.capacity
    cache.batch_select_indices(torch.tensor([1]))  # three sequences leave: their pages go back to the pool
    freed = len(layer.pool.free)
    assert freed >= 3 * (layer.paged_lens[0] // SMALL["page_size"])
    cache.reset()
    assert layer.pool.pages_in_use == 0
    stepwise_logits(model, ids, cache, 100)  # 4 x 300 tokens: needs more than before, reuses first
    need = 4 * -(-layer.paged_lens[0] // SMALL["page_size"])
    assert layer.pool.pages_in_use == need
    assert layer.pool.capacity <= max(cap, 2 * need)


def test_preallocated_pool_does_not_grow():
    model = tiny_llama(layers=1)
    cache = QuantizedPagedCache(key_bits=2, value_bits=2, num_pages=8, **SMALL)
    stepwise_logits(model, torch.randint(0, 128, (2, 150)), cache, 50)
    assert cache.layers[0].pool.capacity == 8 and cache.layers[0].pool.pages_in_use == 8


@pytest.mark.parametrize("prompt,total,sinks", [(40, 70, 0), (100, 157, 4), (19, 22, 0), (33, 64, 2), (60, 96, 0)])
def test_max_batch_preallocation_is_enough_and_tight(prompt, total, sinks):
    # max_batch_size/max_cache_len preallocate what a cache of that many tokens needs: the pool never grows,
    # and holds at most one spare page per sequence at full length; 96 tokens: the last group opens a page
    # (with one token less that page is not needed)
    model = tiny_llama(layers=1)
    b = 3
    cache = QuantizedPagedCache(key_bits=4, value_bits=2, sink_length=sinks, max_batch_size=b, max_cache_len=total,
                                **SMALL)
    pages = cache.quant_config.num_pages
    assert pages == b * cache.quant_config.pages_per_sequence(total)
    stepwise_logits(model, torch.randint(0, 128, (b, total)), cache, prompt)
    pool = cache.layers[0].pool
    assert cache.layers[0].seen == total
    assert pool.capacity == pages, "the preallocated pool grew"
    assert pool.pages_in_use >= pages - b


def test_generate_within_max_batch_preallocation():
    model = tiny_llama(layers=1)
    cache = kivi_cache.Int2PagedCache(group_size=16, page_size=32, residual_length=16, max_batch_size=2,
                                      max_cache_len=90)
    gen(model, torch.randint(0, 128, (2, 58)), cache)  # 58 + 32 new: 89 tokens cached
    assert cache.layers[0].pool.capacity == cache.quant_config.num_pages > 0


def test_pool_grows_by_what_a_step_needs_not_by_doubling():
    model = tiny_llama(layers=1)
    cache = QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL)
    ids = torch.randint(0, 128, (5, 400))
    with torch.no_grad():
        model(ids[:, :300], **cache_kwargs(model, cache))
    pool = cache.layers[0].pool
    assert pool.capacity == pool.pages_in_use == 5 * -(-cache.layers[0].paged_lens[0] // SMALL["page_size"])
    stepwise_logits(model, ids[:, 300:], cache, 1)  # decode steps: growth by a page per sequence, or 1/8
    assert pool.pages_in_use <= pool.capacity <= pool.pages_in_use + max(5, -(-pool.capacity // 8))


def test_memory_report_counts_bytes_exactly():
    model = tiny_llama(layers=2)
    cache = QuantizedPagedCache(key_bits=2, value_bits=4, **SMALL)
    stepwise_logits(model, torch.randint(0, 128, (2, 100)), cache, 40)
    rep = cache.memory_report()
    layer = cache.layers[0]
    q, r = sum(layer.paged_lens), sum(layer.window_lens)
    h, d, g = 4, 32, 16
    assert rep.quantized_tokens == 2 * q and rep.residual_tokens == 2 * r
    assert rep.codes == 2 * q * h * d * (2 + 4) // 8
    assert rep.scales == rep.zeros == 2 * (q // g * h * d + q * h * (d // g)) * 4  # fp32 model
    assert rep.residual == 2 * 2 * r * h * d * 4
    assert rep.sink_tokens == 0 and rep.sinks == 0  # this cache keeps no sinks
    with_sinks = QuantizedPagedCache(key_bits=2, value_bits=4, sink_length=3, **SMALL)
    stepwise_logits(model, torch.randint(0, 128, (2, 100)), with_sinks, 40)
    assert with_sinks.memory_report().sink_tokens == 2 * 2 * 3  # layers x sequences x sinks
    assert with_sinks.memory_report().sinks == 2 * 2 * 3 * 2 * h * d * 4
    ws = with_sinks.memory_report()  # the sinks are part of the residual, not taken from it again
    assert ws.live == ws.codes + ws.scales + ws.zeros + ws.residual and ws.residual > ws.sinks > 0
    assert rep.fp16_equivalent == 2 * 2 * (q + r) * h * d * 2
    assert rep.live == rep.codes + rep.scales + rep.zeros + rep.residual  # each kind counted, from its own sum
    held = sum(t.numel() * t.element_size() for lay in cache.layers
               for t in (*lay.pool.tensors.values(), lay.res_k, lay.res_v))  # what the tensors hold, counted here
    assert rep.allocated == held
    assert rep.allocated == rep.live + rep.pool_slack and rep.pool_slack >= 0
    assert rep.compression == pytest.approx(rep.fp16_equivalent / rep.live)
    assert rep.pages_total == sum(lay.pool.capacity for lay in cache.layers)
    assert rep.pages_in_use == sum(lay.pool.pages_in_use for lay in cache.layers) > cache.layers[0].pool.pages_in_use
    text = str(rep)
    assert f"allocated  {rep.allocated / (1 << 20):.3f} MiB" in text  # MiB, 2**20 bytes
    mib = 1 << 20
    assert f"codes {rep.codes / mib:.3f}, scales and zero points {(rep.scales + rep.zeros) / mib:.3f}" in text


def test_memory_report_counts_shared_pages_once():
    """Beams (or repeated rows) share their pages: the report counts the bytes held, each page once."""
    model = tiny_llama(layers=1)
    cache = QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 200)), **cache_kwargs(model, cache))
    alone = cache.memory_report()
    cache.batch_repeat_interleave(8)  # 8 rows on the same pages, each its own window
    rep = cache.memory_report()
    assert (rep.codes, rep.scales, rep.zeros) == (alone.codes, alone.scales, alone.zeros)
    assert rep.residual == 8 * alone.residual and rep.quantized_tokens == 8 * alone.quantized_tokens
    assert rep.allocated == rep.live + rep.pool_slack and rep.pool_slack >= 0


def test_handles_materialize_for_user_code():
    cache = QuantizedPagedCache(key_bits=8, value_bits=8, **SMALL)
    k = torch.randn(1, 2, 40, 32)
    v = torch.randn(1, 2, 40, 32)
    kh, vh = cache.update(k, v, 0)
    assert kh.shape == (1, 2, 40, 32) and cache.get_seq_length() == 40
    torch.testing.assert_close(kh + 0, k)  # a chunk attends to itself in full precision
    k2 = torch.randn(1, 2, 1, 32)
    kh2, _ = cache.update(k2, k2, 0)
    got = kh2 * 1
    assert got.shape == (1, 2, 41, 32)
    assert torch.equal(got[:, :, -1:], k2)
    assert (got[:, :, :32] - k[:, :, :32]).abs().max() < 0.05  # quantized part (8-bit)
    # handles inside the arguments' containers: a list, keyword arguments, a namedtuple (through pytree)
    assert torch.equal(torch.cat([kh2, k2], dim=2), torch.cat([got, k2], dim=2))
    assert torch.equal(torch.cat(tensors=(k2, kh2), dim=2), torch.cat([k2, got], dim=2))
    pair = collections.namedtuple("pair", "a b")
    assert torch.equal(torch.stack(pair(kh2, kh2)), torch.stack([got, got]))


def test_update_rejects_mismatched_shapes():
    cache = QuantizedPagedCache(**SMALL)
    cache.update(torch.randn(2, 2, 5, 32), torch.randn(2, 2, 5, 32), 0)
    with pytest.raises(ValueError, match="do not match the cache"):
        cache.update(torch.randn(3, 2, 1, 32), torch.randn(3, 2, 1, 32), 0)


def _state(cache):
    """What a cache holds, for comparing before and after a refused operation."""
    out = [cache.get_seq_length()]
    for layer in cache.layers:
        out += [layer.batch_size, [list(t) for t in layer.tables], list(layer.paged_lens), list(layer.window_lens),
                list(layer.sinks), list(layer.pool.refcount), sorted(layer.pool.free), layer.pool.capacity,
                layer.res_k.clone(), layer.res_v.clone(), layer.unusable]
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                    for x, y in zip(a, b, strict=True))


def test_another_batch_is_refused_with_reset_and_reset_takes_it():
    """A cache holds one batch of conversations: a forward of another batch size raises, saying to reset() the cache
    (or make a new one), and changes nothing (the batch held goes on as if nothing happened); after reset() the
    cache takes any batch, as a new cache would."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 80))
    cache, twin = QuantizedPagedCache(sink_length=2, **SMALL), QuantizedPagedCache(sink_length=2, **SMALL)
    stepwise_logits(model, ids[:, :70], cache, 60)
    stepwise_logits(model, ids[:, :70], twin, 60)
    before = _state(cache)
    with pytest.raises(ValueError, match=r"a cache holds one batch of conversations; call cache.reset\(\) \(or "
                                         r"make a new cache\)"):
        with torch.no_grad():
            model(torch.randint(0, 128, (3, 5)), **cache_kwargs(model, cache))
    assert _same(_state(cache), before)
    with torch.no_grad():
        a = model(ids[:, 70:], **cache_kwargs(model, cache)).logits
        b = model(ids[:, 70:], **cache_kwargs(model, twin)).logits
    assert torch.equal(a, b)
    cache.reset()
    assert cache.get_seq_length() == 0 and all(layer.pool.pages_in_use == 0 for layer in cache.layers)
    other = torch.randint(0, 128, (3, 50))
    got = stepwise_logits(model, other, cache, 40)
    want = stepwise_logits(model, other, QuantizedPagedCache(sink_length=2, **SMALL), 40)
    assert torch.equal(got, want)


@pytest.mark.parametrize("prefill", [3, 33])
def test_attention_sinks_stay_in_full_precision(prefill):
    model = tiny_qwen2()
    ids = torch.randint(0, 128, (1, 90))
    dyn = DynamicCache()
    cache = QuantizedPagedCache(key_bits=2, value_bits=2, sink_length=4, **SMALL)
    stepwise_logits(model, ids, dyn, prefill)
    stepwise_logits(model, ids, cache, prefill)
    layer = cache.layers[0]
    k_ref, v_ref = dyn.layers[0].keys, dyn.layers[0].values
    s, q, r = layer.sinks[0], layer.paged_lens[0], layer.window_lens[0]
    assert s == 4 and q % 16 == 0 and 16 <= r - s < 32 and s + q + (r - s) == 90
    assert torch.equal(layer.res_k[0, :, :4], k_ref[0, :, :4])  # sinks: exact
    assert torch.equal(layer.res_v[0, :, :4], v_ref[0, :, :4])
    k, _ = layer._stored_layout(layer.seen)
    g = SMALL["group_size"]
    fake = quant.dequantize_keys(*quant.quantize_keys(k_ref[:, :, 4:4 + q], 2, g), g)
    torch.testing.assert_close(k[:, :, 4:4 + q], fake, rtol=0, atol=1e-6)  # pages: the tokens after the sinks
    assert torch.equal(k[:, :, 4 + q:], k_ref[:, :, 4 + q:])  # newest: exact
    with torch.no_grad():  # the sdpa hook and the materialized (eager) path agree with sinks too
        nxt = ids[:, -1:]
        eager = tiny_qwen2(attn="eager")
        c2 = QuantizedPagedCache(key_bits=2, value_bits=2, sink_length=4, **SMALL)
        stepwise_logits(eager, ids, c2, prefill)
        a = model(nxt, **cache_kwargs(model, cache)).logits
        b = eager(nxt, **cache_kwargs(eager, c2)).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_sinks_improve_int2_logits_on_this_model():
    """Not a law of nature, a regression guard: measured 2-bit error with and without 4 sinks."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 120))
    with torch.no_grad():
        full = model(ids).logits
    err = {}
    for sinks in (0, 4):
        c = QuantizedPagedCache(key_bits=2, value_bits=2, sink_length=sinks, **SMALL)
        err[sinks] = float((stepwise_logits(model, ids, c, 40) - full).norm() / full.norm())
    assert err[4] < BOUNDS[2] and err[0] < BOUNDS[2]
    print("int2 relative logit error without / with 4 sinks:", err)


@pytest.mark.parametrize("remove", [5, 40, 88])
def test_crop_with_sinks(remove):
    model = tiny_llama(layers=1)
    cache = QuantizedPagedCache(key_bits=4, value_bits=4, sink_length=4, **SMALL)
    stepwise_logits(model, torch.randint(0, 128, (1, 90)), cache, 30)
    cache.crop(-remove)
    layer = cache.layers[0]
    n = 90 - remove
    assert cache.get_seq_length() == n
    assert layer.paged_lens[0] + layer.window_lens[0] == n and layer.sinks[0] == min(4, n)
    assert layer.pool.pages_in_use == -(-layer.paged_lens[0] // SMALL["page_size"])
    stepwise_logits(model, torch.randint(0, 128, (1, 20)), cache, 1)  # keeps working
    assert cache.get_seq_length() == n + 20


@pytest.mark.parametrize("sink", [0, 4])
@pytest.mark.parametrize("prefill", [1, 16, 31, 32, 47, 48, 63, 100])
def test_window_holds_whole_groups_beyond_r(prefill, sink):
    """After any prefill and any decode step, a sequence longer than R keeps R..R+G-1 full-precision tokens after
    its sinks and stores whole key groups before them: q = (n - s - R) // G * G exactly (one group flushed early or
    late changes the logits only by quantization noise, which the token tests do not see)."""
    g, window_len = SMALL["group_size"], SMALL["residual_length"]
    cache = QuantizedPagedCache(key_bits=4, value_bits=4, sink_length=sink, **SMALL)
    for n in range(prefill, prefill + 2 * g + 1):
        k = torch.randn(1, 2, n - cache.get_seq_length(), 32)
        cache.update(k, k, 0)
        layer = cache.layers[0]
        layer.commit(layer.pending)
        s = min(sink, n)
        assert layer.sinks == [s]
        assert layer.paged_lens == [max(0, n - s - window_len) // g * g], n
        assert layer.paged_lens[0] + layer.window_lens[0] == n


@pytest.mark.parametrize("remove", range(19, 28))
def test_crop_with_sinks_across_the_window_edge(remove):
    """Crops that take the whole window after the sinks and reach into the pages (90 tokens: 4 sinks, 64 quantized,
    22 in the window): the first n tokens stay as they were stored, sinks included, and whole groups stay in pages."""
    g = SMALL["group_size"]
    cache = QuantizedPagedCache(key_bits=4, value_bits=4, sink_length=4, **SMALL)
    k = torch.randn(1, 2, 90, 32)
    cache.update(k, k, 0)
    layer = cache.layers[0]
    layer.commit(layer.pending)
    assert (layer.paged_lens[0], layer.window_lens[0], layer.sinks[0]) == (64, 26, 4)
    before, _ = layer._stored_layout(90)
    cache.crop(-remove)
    n = 90 - remove
    assert layer.sinks == [4] and layer.window_lens[0] >= 4
    assert layer.paged_lens == [(n - 4) // g * g] and layer.paged_lens[0] + layer.window_lens[0] == n
    after, _ = layer._stored_layout(n)
    assert torch.equal(after, before[:, :, :n])


def test_flush_into_a_shared_page_copies_it_first():
    """Rows made by batch_repeat_interleave share their pages; the next flush writes into the shared, partly filled
    page, so each row must get its own copy of it (copy-on-write) holding the groups already there."""
    g = SMALL["group_size"]
    cache = QuantizedPagedCache(key_bits=8, value_bits=8, **SMALL)
    k = torch.randn(1, 2, 40, 32)
    cache.update(k, k, 0)
    layer = cache.layers[0]
    layer.commit(layer.pending)
    assert layer.paged_lens == [g]  # one group in the first half of page 0
    first, _ = layer._stored_layout(40)
    cache.batch_repeat_interleave(2)
    assert layer.pool.pages_in_use == 1
    for _ in range(8):  # the window reaches R + G: each row flushes a group into the second half of the page
        x = torch.randn(2, 2, 1, 32)
        cache.update(x, x, 0)
        layer.commit(layer.pending)
    assert layer.paged_lens == [2 * g, 2 * g] and layer.pool.pages_in_use == 2
    got, _ = layer._stored_layout(48)
    for row in range(2):
        assert torch.equal(got[row, :, :g], first[0, :, :g])


def test_batch_repeat_interleave_of_a_batch_repeats_each_row_in_place():
    """[a, b] repeated twice is [a, a, b, b] (torch.repeat_interleave), pages, window and lengths alike; generate calls
    it on an empty cache, so only a filled batch of two or more shows the order."""
    cache = QuantizedPagedCache(key_bits=4, value_bits=4, **SMALL)
    k = torch.randn(2, 2, 40, 32)
    cache.update(k, k, 0)
    layer = cache.layers[0]
    layer.commit(layer.pending)
    before = layer.keys.clone()
    cache.batch_repeat_interleave(2)
    assert torch.equal(layer.keys, before.repeat_interleave(2, dim=0))
    assert cache.layers[0].paged_lens == [16] * 4


def test_each_layer_keeps_its_pages_on_its_own_device():
    """device_map="auto" puts layers on different devices; each layer's pool, window and block table
    must follow its own keys. Without GPUs, the meta device stands in for a second device."""
    cache = QuantizedPagedCache(key_bits=4, value_bits=2, **SMALL)
    for layer_idx, device in enumerate(("cpu", "meta", "cpu")):
        k = torch.randn(2, 2, 70, 32, device=device)
        cache.update(k, k, layer_idx)
        layer = cache.layers[layer_idx]
        layer.commit(layer.pending)  # store: quantize and write 48 tokens per sequence into pages
    for layer, device in zip(cache.layers, ("cpu", "meta", "cpu"), strict=True):
        assert layer.paged_lens == [48, 48]
        assert all(t.device.type == device for t in layer.pool.tensors.values())
        assert layer.res_k.device.type == device
        assert all(t.device.type == device for t in layer._device_state())


@pytest.mark.parametrize("bits", [4, 2])
def test_chunked_prefill_kernel_path_matches_reference(bits):
    """Prefill in chunks with a left-padded batch: chunks after the first attend to the quantized past through
    the kernels' prefix path (dequantize per batch slice + fused SDPA) and match the torch reference."""
    model = tiny_llama_d64()
    ids = torch.randint(0, 128, (3, 90), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :40] = 0  # padding through the whole first chunk and into the second
    logits = {}
    for backend in ("torch", "triton"):
        kivi_cache.set_backend(backend)
        try:
            cache = QuantizedPagedCache(key_bits=bits, value_bits=bits, **SMALL)
            with torch.no_grad():
                logits[backend] = torch.cat([model(ids[:, s:s + 30], attention_mask=mask[:, :s + 30],
                                                   **cache_kwargs(model, cache)).logits for s in (0, 30, 60)], 1)
        finally:
            kivi_cache.set_backend("auto")
    valid = mask.bool()
    a, b = logits["triton"][valid], logits["torch"][valid]
    err = ((a - b).norm() / b.norm()).item()
    assert torch.isfinite(logits["triton"][valid]).all() and err < 1e-4, err


@pytest.mark.parametrize("window", [None, 1, 3, 5, 9])
def test_chunk_visibility_without_a_mask_is_the_causal_window(window):
    """A chunk of several tokens on a filled cache with no mask (a direct call; transformers passes one there): token
    i of the chunk sees token j iff j <= i and, with a window, i - j < window, as the float mask transformers builds
    (additive, finfo.min where hidden) says through the same function."""
    from kivi_cache.masks import chunk_visibility as _chunk_visibility

    n, past = 7, 5
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    want = (j <= i) & (torch.ones(n, n, dtype=torch.bool) if window is None else (i - j < window))
    got = _chunk_visibility(None, n, 2, "cpu", window)
    assert got.shape == (2, n, n) and torch.equal(got[0], want) and torch.equal(got[1], want)
    float_mask = torch.zeros(2, 1, n, past + n)
    float_mask[..., past:].masked_fill_(~want, torch.finfo(torch.float32).min)
    assert torch.equal(_chunk_visibility(float_mask, n, 2, "cpu", window), got)

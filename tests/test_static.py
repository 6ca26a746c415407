"""StaticQuantizedPagedCache: same tokens as QuantizedPagedCache, no graph breaks, torch.compile gives the
same logits, clear errors for what static mode does not do."""

import pytest
import torch
from models import tiny_llama, tiny_llama_d64, tiny_qwen2
from transformers import DynamicCache

from kivi_cache import QuantConfig, QuantizedPagedCache, StaticQuantizedPagedCache, cache_kwargs, ops
from kivi_cache.static import StaticQuantizedPagedLayer, ring_pages

CFG = dict(key_bits=4, value_bits=2, group_size=16, residual_length=16, page_size=32, sink_length=2)


def _generate(model, ids, cache, n=30, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                              max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
def test_static_generates_the_dynamic_caches_tokens(make):
    model = make()
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(3))
    ref = _generate(model, ids, QuantizedPagedCache(**CFG))
    cache = StaticQuantizedPagedCache(model, 128, **CFG)
    out = _generate(model, ids, cache)
    assert torch.equal(out, ref)  # 30 steps: flushes every 16 tokens, sinks, GQA (qwen2)
    report = cache.memory_report()
    assert report.quantized_tokens > 0 and report.sink_tokens == 2 * 2 * model.config.num_hidden_layers
    assert cache.is_compileable and not QuantizedPagedCache().is_compileable
    # allocated once: every sequence's pages
    assert cache.layers[0].pool.capacity == 2 * QuantConfig(**CFG).pages_per_sequence(128)


def _static_on_both_backends(model, ids, cfg, steps: int, check) -> None:
    """Greedy ``steps`` tokens with a fresh ``StaticQuantizedPagedCache(model, 128, **cfg)`` on the torch reference
    path and on the Triton kernels (the interpreter on CPU); ``check(cache)`` after each; the two give the same tokens
    and logits to 1e-4."""
    res = {}
    try:
        for backend in ("torch", "triton"):
            ops.set_backend(backend)
            cache = StaticQuantizedPagedCache(model, 128, **cfg)
            res[backend] = _scores(model, ids, cache, steps)
            check(cache)
    finally:
        ops.set_backend("auto")
    assert torch.equal(res["torch"][0], res["triton"][0])
    torch.testing.assert_close(res["triton"][1], res["torch"][1], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_static_step_on_the_kernels_matches_the_reference():
    """The static step through the Triton kernels (on CPU the interpreter: append_and_flush, then the decode
    kernels) gives the torch reference path's tokens and logits; 40 steps of a batch of 2 with two flushes each
    and sinks."""
    cfg = dict(key_bits=4, value_bits=4, group_size=32, residual_length=32, page_size=64, sink_length=2)
    ids = torch.randint(0, 100, (2, 60), generator=torch.Generator().manual_seed(4))

    def check(cache):  # 99 tokens: flushes at 66 and 98 (2 sinks + R + G)
        assert cache.layers[0].paged_len.tolist() == [64, 64]

    _static_on_both_backends(tiny_llama_d64(), ids, cfg, 40, check)


def _decode_logits(model, ids, forward, steps):
    cache = StaticQuantizedPagedCache(model, 96, **CFG)
    logits = []
    with torch.no_grad():
        out = model(ids, **cache_kwargs(model, cache))
        tok = out.logits[:, -1:].argmax(-1)
        for i in range(steps):
            out = forward(tok, **cache_kwargs(model, cache), cache_position=torch.full((1,), ids.shape[1] + i))
            logits.append(out.logits[:, -1].float())
            tok = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1), cache


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
def test_static_pool_holds_exactly_the_pages_of_max_cache_len_and_refuses_more_tokens(make):
    """Every sequence gets QuantConfig.pages_per_sequence(max_cache_len) pages (its whole key groups beyond the sinks
    and the window; not ceil(max_cache_len / page_size)), generating up to max_cache_len gives the dynamic cache's
    tokens, and one token more fails instead of overwriting the last page (eagerly: a ValueError before the step
    writes anything; compiled: an asynchronous device assert)."""
    model = make()
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(5))
    n = 30
    max_len = 40 + n  # 69 tokens cached: 48 quantized = 2 pages of 32 (ceil(70 / 32) = 3)
    per_seq = QuantConfig(**CFG).pages_per_sequence(max_len)
    assert per_seq == 2
    cache = StaticQuantizedPagedCache(model, max_len, **CFG)
    assert torch.equal(_generate(model, ids, cache, n=n), _generate(model, ids, QuantizedPagedCache(**CFG), n=n))
    for layer in cache.layers:
        assert layer.block_table.shape == (2, per_seq) and layer.pool.capacity == 2 * per_seq
        assert layer.paged_len.tolist() == [48, 48]  # the last page filled: the sizing is tight
    cache = StaticQuantizedPagedCache(model, max_len, **CFG)
    with pytest.raises(ValueError, match="max_cache_len"):  # eager: checked on the host before the step writes
        _generate(model, ids, cache, n=n + 2)
    assert cache.layers[0].seen_t.item() == max_len and cache.layers[-1].seen_t.item() == max_len


def test_decode_step_has_no_graph_breaks_and_compiles_to_the_same_logits():
    model = tiny_llama()
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(5))
    cache = StaticQuantizedPagedCache(model, 96, **CFG)
    with torch.no_grad():
        tok = model(ids, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        explain = torch._dynamo.explain(model)(tok, **cache_kwargs(model, cache), cache_position=torch.full((1,), 40))
    assert explain.graph_break_count == 0, [str(r.reason)[:200] for r in explain.break_reasons]
    torch._dynamo.reset()
    eager, _ = _decode_logits(model, ids, model.forward, 20)
    compiled, cache = _decode_logits(model, ids, torch.compile(model.forward, backend="aot_eager", fullgraph=True), 20)
    assert torch.equal(eager, compiled)  # 20 steps include a flush of a group into the pages
    assert int(cache.layers[0].paged_len.max()) > 0


def test_a_compiled_step_past_max_cache_len_fails():
    """Compiled, the step has no host check: the traced assert stops the step that would need a page beyond the
    sequence's own (eagerly the same step raises a ValueError: the test above)."""
    model = tiny_llama()
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
    cache = StaticQuantizedPagedCache(model, 45, **CFG)
    with torch.no_grad():
        tok = model(ids, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        for i in range(5):  # 45 tokens cached: the limit
            out = forward(tok, **cache_kwargs(model, cache), cache_position=torch.full((1,), 40 + i))
            tok = out.logits[:, -1:].argmax(-1)
        with pytest.raises(RuntimeError, match="max_cache_len"):
            forward(tok, **cache_kwargs(model, cache), cache_position=torch.full((1,), 45))
    torch._dynamo.reset()


def test_static_errors():
    model = tiny_llama()
    ids = torch.randint(0, 100, (1, 40))
    for bad in (0, True, 64.0):
        with pytest.raises(ValueError, match=r"max_cache_len must be an integer >= 1"):
            StaticQuantizedPagedCache(model, bad)
    cache = StaticQuantizedPagedCache(model, 30, **CFG)
    with pytest.raises(ValueError, match="max_cache_len"), torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
    cache = StaticQuantizedPagedCache(model, 96, **CFG)
    with torch.no_grad():
        model(ids, **cache_kwargs(model, cache))
        model(ids[:, :1], **cache_kwargs(model, cache), cache_position=torch.tensor([40]))  # the first decode step
        with pytest.raises(ValueError, match="one token per sequence"):
            model(ids[:, :3], **cache_kwargs(model, cache))
    with pytest.raises(IndexError, match=r"beam_idx must hold 1 indices in \[0, 1\)"):
        cache.reorder_cache(torch.tensor([0, 0]))
    with pytest.raises(NotImplementedError, match="batch_repeat_interleave"):
        cache.batch_repeat_interleave(2)


def test_static_another_batch_is_refused_until_reset():
    """A static cache holds one batch of conversations too: a decode step or a prompt of another batch raises,
    saying to reset() the cache, and changes nothing; after reset() another batch gets a new cache's tokens."""
    model = tiny_llama()
    gen = torch.Generator().manual_seed(3)
    ids, other = torch.randint(0, 100, (2, 40), generator=gen), torch.randint(0, 100, (3, 40), generator=gen)
    cache = StaticQuantizedPagedCache(model, 128, **CFG)
    _generate(model, ids, cache, n=5)
    layer = cache.layers[0]
    before = int(cache.get_seq_length()), layer.paged_len.clone(), layer.window_len.clone(), layer.res_k.clone()
    for n in (1, 3):  # a decode step, a prompt
        with pytest.raises(ValueError, match=r"a cache holds one batch of conversations; call cache.reset\(\)"):
            with torch.no_grad():
                model(torch.randint(0, 100, (3, n)), **cache_kwargs(model, cache))
        after = int(cache.get_seq_length()), layer.paged_len, layer.window_len, layer.res_k
        assert before[0] == after[0] and all(torch.equal(a, b) for a, b in zip(before[1:], after[1:], strict=True))
        assert layer.static and layer.unusable is None
    cache.reset()
    got = _generate(model, other, cache, n=5)
    assert torch.equal(got, _generate(model, other, StaticQuantizedPagedCache(model, 128, **CFG), n=5))


def test_static_layer_keys_equal_the_eager_caches():
    """``layer.keys``/``values`` (the dequantized history) read the device state in static mode."""
    model = tiny_llama()
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(3))
    eager, static = QuantizedPagedCache(**CFG), StaticQuantizedPagedCache(model, 128, **CFG)
    for cache in (eager, static):
        _generate(model, ids, cache)
    assert static.layers[0].static and static.get_seq_length() == eager.get_seq_length() == 69
    for (k, v, _), (ks, vs, _) in zip(eager, static, strict=True):
        assert torch.equal(ks, k) and torch.equal(vs, v)


def test_static_refuses_attention_it_cannot_serve():
    """A static decode step hands the model the bare window and serves it in the sdpa hook; any other attention got
    that window as the whole history (a shape error, or wrong logits where max_cache_len equals the window's
    capacity). Now refused when the cache is made, or at the first decode step (nothing written) when the
    implementation changed afterwards."""
    from transformers import BloomConfig, BloomForCausalLM

    with pytest.raises(ValueError, match=r"attn_implementation 'sdpa' or 'kivi', got 'eager'"):
        StaticQuantizedPagedCache(tiny_llama(attn="eager"), 64, **CFG)
    bloom = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=128, n_layer=1, n_head=4)).eval()
    with pytest.raises(ValueError, match="BloomForCausalLM does not declare it"):
        StaticQuantizedPagedCache(bloom, 64, **CFG)
    model = tiny_llama()
    ids = torch.randint(0, 100, (1, 30), generator=torch.Generator().manual_seed(3))
    cache = StaticQuantizedPagedCache(model, 34, **CFG)  # 34: sinks + residual + group, the window's capacity
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="materialized full-precision history"):
        _generate(model, ids, cache, n=5)  # a flush at the 4th step: the bare window is no longer the history
    assert int(cache.layers[0].seen_t) == 30  # the prompt, and no decode token


def test_binding_does_not_capture_other_caches():
    """A model bound to a static cache still serves other caches normally."""
    model = tiny_llama()
    ids = torch.randint(0, 100, (1, 40))
    q8 = dict(key_bits=8, value_bits=8, group_size=16, residual_length=16, page_size=32)
    before = [_generate(model, ids, DynamicCache(), n=8), _generate(model, ids, QuantizedPagedCache(**q8), n=8)]
    static = StaticQuantizedPagedCache(model, 96, **CFG)
    _generate(model, ids, static, n=8)
    after = [_generate(model, ids, DynamicCache(), n=8), _generate(model, ids, QuantizedPagedCache(**q8), n=8)]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_static_with_a_one_token_prompt_matches_dynamic():
    """A one-token prompt is stored by the one-token path (the window write left to the decode op)."""
    model = tiny_llama()
    ids = torch.randint(1, 100, (2, 1), generator=torch.Generator().manual_seed(3))
    ref = _generate(model, ids, QuantizedPagedCache(**CFG))
    assert torch.equal(_generate(model, ids, StaticQuantizedPagedCache(model, 64, **CFG)), ref)


def test_static_with_left_padding_matches_dynamic():
    """Ragged prompts (left padding): per-sequence lengths live on the device in static mode."""
    model = tiny_qwen2()
    ids = torch.randint(1, 100, (3, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, :23] = 0
    ids[mask == 0] = 0

    def gen(cache):
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=40,
                                  min_new_tokens=40, do_sample=False, pad_token_id=0)

    assert torch.equal(gen(StaticQuantizedPagedCache(model, 96, **CFG)), gen(QuantizedPagedCache(**CFG)))


@pytest.mark.parametrize("chunk", [16, 24])
def test_static_with_a_chunked_prompt_matches_dynamic(chunk):
    """generate's prefill_chunk_size: the prompt arrives in chunks (eager, with flushes between them), then
    the static decode; same tokens as the dynamic cache with the same chunks, and no page beyond the fixed ones."""
    model = tiny_llama()
    ids = torch.randint(0, 100, (2, 70), generator=torch.Generator().manual_seed(11))
    ref = _generate(model, ids, QuantizedPagedCache(**CFG), n=20, prefill_chunk_size=chunk)
    cache = StaticQuantizedPagedCache(model, 128, **CFG)
    out = _generate(model, ids, cache, n=20, prefill_chunk_size=chunk)
    assert torch.equal(out, ref)
    layer = cache.layers[0]
    assert layer.static and layer.decoding and layer.pool.capacity == 2 * QuantConfig(**CFG).pages_per_sequence(128)
    assert layer.pool.pages_in_use == 2 * QuantConfig(**CFG).pages_per_sequence(128)  # every sequence's fixed pages


def test_static_with_a_chunked_left_padded_prompt_matches_dynamic():
    model = tiny_qwen2()
    ids = torch.randint(1, 100, (3, 70), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, :33] = 0  # a sequence whose first chunks are all padding
    ids[mask == 0] = 0

    def gen(cache):
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=30,
                                  min_new_tokens=30, do_sample=False, pad_token_id=0, prefill_chunk_size=16)

    assert torch.equal(gen(StaticQuantizedPagedCache(model, 128, **CFG)), gen(QuantizedPagedCache(**CFG)))


class _RecordingBackend:
    """aot_eager, remembering for every graph dynamo hands over the source files its operations came from."""

    def __init__(self):
        from torch._dynamo.backends.registry import lookup_backend

        self.aot_eager = lookup_backend("aot_eager")
        self.graph_files = []

    def __deepcopy__(self, memo):  # CompileConfig.to_dict deep-copies its fields: keep one record
        return self

    def __call__(self, gm, example_inputs):
        traces = (node.meta.get("stack_trace") or "" for node in gm.graph.nodes)
        self.graph_files.append({line.split('"')[1] for t in traces for line in t.splitlines() if 'File "' in line})
        return self.aot_eager(gm, example_inputs)

    def graphs_from(self, path_part: str) -> int:
        return sum(any(path_part in f for f in files) for files in self.graph_files)


def _compiled_generate(model, ids, cache, n, chunk):
    """generate as on a GPU: its own torch.compile of the forward (prompt chunks included, transformers 5.17),
    here with the recording aot_eager backend and forced on the CPU."""
    from transformers import CompileConfig

    backend = _RecordingBackend()
    config = CompileConfig(backend=backend, mode=None)
    config._compile_all_devices = True  # generate compiles on accelerators only, unless told otherwise
    torch._dynamo.reset()
    out = _generate(model, ids, cache, n=n, prefill_chunk_size=chunk, compile_config=config)
    return out, backend


@pytest.mark.slow
def test_compiled_generate_with_a_chunked_prompt_matches_eager():
    """generate compiles every prompt chunk's forward too: the chunks run eagerly inside it, the decode steps
    compiled through the static path, and the tokens are those of the eager static and dynamic caches."""
    model = tiny_llama()
    ids = torch.randint(0, 100, (2, 70), generator=torch.Generator().manual_seed(11))
    ref = _generate(model, ids, QuantizedPagedCache(**CFG), n=20, prefill_chunk_size=16)
    eager = _generate(model, ids, StaticQuantizedPagedCache(model, 128, **CFG), n=20, prefill_chunk_size=16)
    cache = StaticQuantizedPagedCache(model, 128, **CFG)
    out, backend = _compiled_generate(model, ids, cache, n=20, chunk=16)
    assert torch.equal(eager, ref) and torch.equal(out, ref)
    assert backend.graphs_from("kivi_cache/static.py") >= 1  # the decode step was compiled, our static update in it
    assert int(cache.layers[0].paged_len.max()) > 0 and cache.layers[0].decoding


@pytest.mark.slow
def test_compiled_chunked_prompt_keeps_dynamo_out_of_the_bookkeeping():
    """A compiled prompt chunk graph-breaks into the eager cache path instead of tracing it: no compiled graph
    holds an operation of kivi_cache, and the graphs compiled do not grow with the number of chunks."""
    model = tiny_llama()
    seen = {}  # chunks -> (graphs compiled, graphs holding kivi_cache code); n=1: the prompt only, no decode step
    for chunks in (2, 6):
        ids = torch.randint(0, 100, (2, 16 * chunks), generator=torch.Generator().manual_seed(chunks))
        _, backend = _compiled_generate(model, ids, StaticQuantizedPagedCache(model, 128, **CFG), n=1, chunk=16)
        seen[chunks] = (len(backend.graph_files), backend.graphs_from("kivi_cache/"))
    # (graphs, graphs holding kivi_cache code) is (10-11, 0) at 2 and 6 chunks alike; the count varies by a graph with
    # the order tests run in (dynamo's automatic dynamic shapes), so its growth is bounded, not required to be zero
    assert seen[2][1] == seen[6][1] == 0 and seen[6][0] <= seen[2][0] + 2, seen


def _prefilled_generate(model, ids, mask, cache, n, chunk, **kw):
    from kivi_cache import prefill

    prefill(model, cache, ids, attention_mask=mask, chunk_size=chunk)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def _left_padded(seed):
    ids = torch.randint(1, 100, (3, 70), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, :33] = 0  # whole chunks of padding
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("chunk", [None, 16])
def test_prefill_equals_generate_storing_the_prompt_itself(chunk):
    """prefill's chunks (positions and mask per chunk) against no prefill at all, with transformers' DynamicCache:
    the logits of every new token agree; and a quantized cache counts each sequence's pads over the chunks."""
    from kivi_cache import prefill

    model = tiny_qwen2()
    ids, mask = _left_padded(5)

    def logits(cache):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=10,
                                 min_new_tokens=10, do_sample=False, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
        return torch.stack(out.logits, 1)

    ref = logits(DynamicCache())
    cache = DynamicCache()
    prefill(model, cache, ids, attention_mask=mask, chunk_size=chunk)
    torch.testing.assert_close(logits(cache), ref, rtol=1e-4, atol=1e-4)
    paged = QuantizedPagedCache(**CFG)
    prefill(model, paged, ids, attention_mask=mask, chunk_size=chunk)
    layer = paged.layers[0]
    assert layer.pads == [0, 9, 33]
    assert all(p + q + r == layer.seen == 69
               for p, q, r in zip(layer.pads, layer.paged_lens, layer.window_lens, strict=True))


def test_prefill_then_generate_matches_the_dynamic_cache_and_compiles_no_prompt_chunk():
    """kivi_cache.prefill stores all but the last prompt token eagerly (generate would compile every chunk's
    forward for a compileable cache); generate then runs the last token and the decode steps: same tokens as
    the dynamic cache prefilled the same way, eagerly and with generate's compile, and no compiled graph
    holds the prompt's chunks (the graphs compiled do not grow with the number of chunks)."""
    from transformers import CompileConfig

    model = tiny_qwen2()
    ids, mask = _left_padded(5)
    ref = _prefilled_generate(model, ids, mask, QuantizedPagedCache(**CFG), n=20, chunk=16)
    eager = _prefilled_generate(model, ids, mask, StaticQuantizedPagedCache(model, 128, **CFG), n=20, chunk=16)
    assert torch.equal(eager, ref)
    graphs = {}
    for chunk in (8, 32):
        backend = _RecordingBackend()
        config = CompileConfig(backend=backend, mode=None)
        config._compile_all_devices = True
        torch._dynamo.reset()
        cache = StaticQuantizedPagedCache(model, 128, **CFG)
        out = _prefilled_generate(model, ids, mask, cache, n=20, chunk=chunk, compile_config=config)
        graphs[chunk] = len(backend.graph_files)
        assert torch.equal(out, _prefilled_generate(model, ids, mask, QuantizedPagedCache(**CFG), n=20, chunk=chunk))
        assert backend.graphs_from("kivi_cache/static.py") >= 1 and cache.layers[0].decoding
    # 9 chunks or 3: the prompt never reaches the compiler; only the decode step is compiled (1 graph here;
    # generate's own prefill_chunk_size=16 compiles 20 for this prompt)
    assert graphs[8] == graphs[32] <= 2, graphs


def test_prefill_errors():
    from kivi_cache import prefill

    model = tiny_llama()
    ids = torch.randint(0, 100, (2, 10))
    cache = QuantizedPagedCache(**CFG)
    for bad, match in ((dict(input_ids=ids[:, :1]), "at least 2 tokens"), (dict(chunk_size=0), "chunk_size"),
                       (dict(chunk_size=True), "chunk_size"),
                       (dict(attention_mask=torch.ones(2, 9)), "attention_mask")):
        args = {**dict(input_ids=ids, attention_mask=None, chunk_size=None), **bad}
        with pytest.raises(ValueError, match=match):
            prefill(model, cache, **args)
    assert cache.get_seq_length() == 0  # nothing stored by a refused call
    prefill(model, cache, ids)
    assert cache.get_seq_length() == 9
    with pytest.raises(ValueError, match="empty cache"):
        prefill(model, cache, ids)


def _mistral(window=24, head_dim=32):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, sliding_window=window,
                        max_position_embeddings=512, pad_token_id=0)
    return MistralForCausalLM(cfg).eval()


def test_static_sliding_window_matches_the_eager_cache_and_compiles():
    """A sliding-window model (Mistral, window 24) in static mode: the step's attention reads the window (the tokens
    equal the eager cache's, which serves the window from the pages and releases pages; without the window the
    logits differ), no graph break, and the compiled step gives the same logits."""
    import unittest.mock as um

    from kivi_cache import hook

    model = _mistral()
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(3))
    ref = _generate(model, ids, QuantizedPagedCache(**CFG))
    cache = StaticQuantizedPagedCache(model, 128, **CFG)
    assert torch.equal(_generate(model, ids, cache), ref)
    assert all(layer.sliding_window == 24 and layer.cfg.sink_length == 0 for layer in cache.layers)
    assert cache.layers[0].hidden[0] > 0  # the prompt's hidden pages were never written
    eager_logits, _ = _decode_logits(model, ids, model.forward, 20)
    with um.patch.object(hook, "_pattern", lambda module, kwargs: (True, None)):  # the window ignored
        ignored, _ = _decode_logits(model, ids, model.forward, 20)
    assert not torch.allclose(eager_logits, ignored, atol=1e-3)
    _assert_static_step_compiles_to(model, ids, eager_logits)


def _assert_static_step_compiles_to(model, ids, eager_logits, steps: int = 20):
    """A static decode step after the prompt ``ids`` traces with no graph break, and the compiled (aot_eager,
    fullgraph) decode gives exactly ``eager_logits`` (:func:`_decode_logits` over ``steps`` steps)."""
    with torch.no_grad():
        static = StaticQuantizedPagedCache(model, 96, **CFG)
        tok = model(ids, **cache_kwargs(model, static)).logits[:, -1:].argmax(-1)
        position = torch.full((1,), ids.shape[1])
        explain = torch._dynamo.explain(model)(tok, **cache_kwargs(model, static), cache_position=position)
    assert explain.graph_break_count == 0, [str(r.reason)[:200] for r in explain.break_reasons]
    torch._dynamo.reset()
    compiled, _ = _decode_logits(model, ids, torch.compile(model.forward, backend="aot_eager", fullgraph=True), steps)
    assert torch.equal(eager_logits, compiled)


def test_static_learned_sinks_match_the_eager_cache_and_compile():
    """GPT-OSS (learned sink logits, a sliding and a full layer) in static mode: the decode op takes the sinks (the
    tokens equal the eager cache's; without them the logits differ), no graph break, and the compiled step gives
    the same logits."""
    import unittest.mock as um

    from transformers import GptOssConfig, GptOssForCausalLM

    from kivi_cache import hook

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=2,
                       num_experts_per_tok=1, sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                       max_position_embeddings=512)
    model = GptOssForCausalLM(cfg).eval()
    for module in model.modules():
        if hasattr(module, "sinks"):
            torch.nn.init.normal_(module.sinks, std=2.0)
    model.set_attn_implementation("kivi")
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(3))
    ref = _generate(model, ids, QuantizedPagedCache(**CFG))
    cache = StaticQuantizedPagedCache(model, 128, **CFG)
    assert torch.equal(_generate(model, ids, cache), ref)
    assert [layer.sliding_window for layer in cache.layers] == [24, None]
    eager_logits, _ = _decode_logits(model, ids, model.forward, 20)
    with um.patch.object(hook, "_sink_logits", lambda kwargs: None):  # the sinks dropped
        dropped, _ = _decode_logits(model, ids, model.forward, 20)
    assert not torch.allclose(eager_logits, dropped, atol=1e-3)
    _assert_static_step_compiles_to(model, ids, eager_logits)


@pytest.mark.parametrize("chunk", [None, 16])
def test_static_sliding_pool_is_allocated_exactly(chunk):
    """A sliding-window layer drops its sink tokens when the hook learns its window, after lazy_initialization sized
    the pool with them: a sequence then holds one more group. The fixed pages of every sequence are allocated
    exactly (the end of the prompt must not grow the pool by a growth step of 1/8 of it or more)."""
    model = _mistral()
    ids = torch.randint(3, 128, (2, 40 if chunk else 20), generator=torch.Generator().manual_seed(3))
    ref = _generate(model, ids, QuantizedPagedCache(**CFG), prefill_chunk_size=chunk)
    cache = StaticQuantizedPagedCache(model, 128, **CFG)
    assert torch.equal(_generate(model, ids, cache, prefill_chunk_size=chunk), ref)
    per_sequence = QuantConfig(**dict(CFG, sink_length=0)).pages_per_sequence(128)
    ring = ring_pages(QuantConfig(**CFG), 24)  # ceil((24 - 16) / 32) = 1
    for layer in cache.layers:
        assert layer.cfg.sink_length == 0 and [len(t) for t in layer.tables] == [per_sequence] * 2
        assert layer.ring == ring == 1
        assert layer.pool.capacity == layer.pool.pages_in_use == 2 * ring + (layer.pool.zero is not None)


def _scores(model, ids, cache, n):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, 1)


def test_static_sliding_layer_reuses_a_ring_of_pages(monkeypatch):
    """A sliding-window layer in static mode holds ring_pages per sequence (window 60, residual 16, page 32: 2
    pages, not the 9 of max_cache_len 300), its table naming them in turn; over 170 steps (the ring goes round ~3
    times) the logits equal the eager cache's (which releases pages instead), as do the memory report and the
    dequantized keys (released tokens as zeros). With one page fewer the logits differ: the bound is tight."""
    model = _mistral(window=60)
    ids = torch.randint(3, 128, (2, 50), generator=torch.Generator().manual_seed(5))
    eager = QuantizedPagedCache(**CFG)
    ref_seq, ref = _scores(model, ids, eager, 170)
    cache = StaticQuantizedPagedCache(model, 300, **CFG)
    seq, got = _scores(model, ids, cache, 170)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    ring = ring_pages(QuantConfig(**CFG), 60)
    assert ring == 2
    for layer, ref_layer in zip(cache.layers, eager.layers, strict=True):
        assert layer.ring == ring and layer.pool.pages_in_use == 2 * ring + (layer.pool.zero is not None)
        for table, h in zip(layer.tables, layer.hidden, strict=True):
            assert len(table) == 9 and all(table[j] == table[j - ring] for j in range(h + ring, len(table)))
        torch.testing.assert_close(layer.keys, ref_layer.keys, rtol=0, atol=0)
    assert cache.memory_report().quantized_tokens == eager.memory_report().quantized_tokens > 0
    monkeypatch.setattr(StaticQuantizedPagedLayer, "_ring_pages", lambda self, maxp: ring - 1)
    _, short = _scores(model, ids, StaticQuantizedPagedCache(model, 300, **CFG), 170)
    assert (short - ref).abs().max() > 1e-2


@pytest.mark.slow
def test_static_ring_on_the_kernels_matches_the_reference():
    """The ring of a sliding layer through the Triton kernels (on CPU the interpreter: append_and_flush writing into
    reused pages, the windowed decode kernel reading them): the torch reference path's tokens and logits over 40
    steps (window 40, residual 16, page 32: a ring of 1 page, written for a second page's tokens)."""
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(6))

    def check(cache):
        assert [layer.ring for layer in cache.layers] == [1, 1]
        assert cache.layers[0].paged_len.tolist() == [48, 48]  # 70 tokens: 3 flushes of 16, the third into page 1

    # head_dim 64: one the kernels take
    _static_on_both_backends(_mistral(window=40, head_dim=64), ids, dict(CFG, sink_length=0), 40, check)


def test_a_prompt_chunk_past_max_cache_len_changes_nothing():
    """A further prompt chunk that does not fit max_cache_len is refused before the layer leaves its static state
    (validate first, then change): the cache stays as the first chunk left it."""
    from kivi_cache import cache_kwargs

    model = tiny_llama()
    ids = torch.randint(0, 100, (2, 70), generator=torch.Generator().manual_seed(5))
    cache = StaticQuantizedPagedCache(model, 64, **CFG)
    with torch.no_grad():
        model(ids[:, :20], **cache_kwargs(model, cache))
        layer = cache.layers[0]
        before = (layer.static, layer.seen, list(map(list, layer.tables)), layer.paged_lens, layer.window_lens)
        with pytest.raises(ValueError, match="does not fit"):
            model(ids[:, 20:], **cache_kwargs(model, cache))
    assert (layer.static, layer.seen, list(map(list, layer.tables)), layer.paged_lens, layer.window_lens) == before

"""Model families other than Llama: attention the hook must not serve from the pages (sliding windows given as an
attention argument, chunked attention) falls back to the materialized history and stays exact. Tiny random models,
no download."""

import warnings

import pytest
import torch
import transformers as T
from transformers import DynamicCache

from kivi_cache import QuantConfig, QuantizedPagedCache, cache_kwargs
from kivi_cache.layer import QuantizedPagedLayer

SMALL = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)

# window / chunk of 16 tokens and a 40-token prompt: every decode step depends on the window being applied
WINDOWED = {
    # these pass the window to the attention function as a keyword (sliding_window=config.sliding_window)
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, head_dim=32, sliding_window=16)),
    "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**SMALL, sliding_window=16, pad_token_id=0)),
    "starcoder2": lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(**SMALL, sliding_window=16)),
    # chunked attention: only the config's layer_types says so (nothing on the module or in the arguments)
    "llama4": lambda: T.Llama4ForCausalLM(T.Llama4TextConfig(
        **SMALL, head_dim=32, intermediate_size_mlp=256, attention_chunk_size=16, num_local_experts=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}


def _generate(model, ids, mask, cache, n=8, **kw):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_windowed_attention_without_config_matches_dynamic_cache(family):
    """Without ``config=`` the cache cannot refuse these models up front; the hook must see the window (a
    ``sliding_window`` argument, or a layer type other than full attention) and use the materialized fallback.
    With a window larger than the whole sequence nothing is quantized, so the logits must equal DynamicCache's."""
    torch.manual_seed(0)
    model = WINDOWED[family]().eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 40), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ids[1, :7] = 0
    ref_seq, ref_logits = _generate(model, ids, mask, DynamicCache())
    seq, logits = _generate(model, ids, mask, QuantizedPagedCache(key_bits=8, value_bits=8, residual_length=256))
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(seq, ref_seq)


# ------------------------------------------------------------------ encoder-decoder models, layer tensors

def _whisper():
    torch.manual_seed(0)
    cfg = T.WhisperConfig(vocab_size=128, d_model=128, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                          max_source_positions=25, max_target_positions=128, pad_token_id=0, bos_token_id=1,
                          eos_token_id=2, decoder_start_token_id=1, begin_suppress_tokens=None, suppress_tokens=None)
    return T.WhisperForConditionalGeneration(cfg).eval()


def _bart():
    torch.manual_seed(0)
    cfg = T.BartConfig(vocab_size=128, d_model=128, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                       max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                       decoder_start_token_id=2, forced_eos_token_id=None)
    return T.BartForConditionalGeneration(cfg).eval()


def _t5():
    torch.manual_seed(0)
    cfg = T.T5Config(vocab_size=128, d_model=128, d_kv=32, d_ff=128, num_layers=1, num_decoder_layers=2, num_heads=4,
                     decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T.T5ForConditionalGeneration(cfg).eval()


def _encoder_inputs(name):
    gen = torch.Generator().manual_seed(1)
    if name == "whisper":
        return dict(input_features=torch.randn(2, 16, 50, generator=gen))
    ids = torch.randint(3, 128, (2, 30), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    return dict(input_ids=ids, attention_mask=mask)


def _generate_ed(model, inputs, cache, n=40, **kw):
    with torch.no_grad():
        return model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, **kw)


NO_QUANT = dict(key_bits=8, value_bits=8, residual_length=256)  # nothing reaches the pages: exact
PAGED = dict(key_bits=8, value_bits=8, group_size=16, residual_length=8, page_size=16, sink_length=2)


@pytest.mark.parametrize("name", ["t5", "bart", "whisper"])
def test_encoder_decoder_caches(name):
    """``EncoderDecoderCache(QuantizedPagedCache(), DynamicCache())``: the decoder's self-attention in pages (T5's
    position bias takes the materialized fallback), cross-attention in the DynamicCache; or both quantized."""
    from transformers import EncoderDecoderCache

    model = {"t5": _t5, "bart": _bart, "whisper": _whisper}[name]()
    inputs = _encoder_inputs(name)
    ref = _generate_ed(model, inputs, EncoderDecoderCache(DynamicCache(), DynamicCache()))
    out = _generate_ed(model, inputs, EncoderDecoderCache(QuantizedPagedCache(**NO_QUANT), DynamicCache()))
    assert torch.equal(out, ref)
    cache = EncoderDecoderCache(QuantizedPagedCache(**PAGED), DynamicCache())
    out = _generate_ed(model, inputs, cache)
    assert all(q > 0 for layer in cache.self_attention_cache.layers for q in layer.paged_lens)  # pages in use
    assert torch.equal(out[:, :8], ref[:, :8])
    # a quantized cross-attention cache too: the models read its layers' keys/values after the first step (None
    # there is an AttributeError); they are the dequantized encoder states
    out = _generate_ed(model, inputs, EncoderDecoderCache(QuantizedPagedCache(**NO_QUANT),
                                                          QuantizedPagedCache(**NO_QUANT)))
    assert torch.equal(out, ref)
    if name != "whisper":  # right-padded encoder input: the cross-attention cache keeps every position
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["attention_mask"][1, -6:] = 0
        kw = dict(output_logits=True, return_dict_in_generate=True)
        ref = _generate_ed(model, inputs, EncoderDecoderCache(DynamicCache(), DynamicCache()), n=8, **kw)
        cache = EncoderDecoderCache(QuantizedPagedCache(**NO_QUANT), QuantizedPagedCache(**NO_QUANT))
        out = _generate_ed(model, inputs, cache, n=8, **kw)
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), rtol=1e-4, atol=1e-4)
        assert all(layer.pads == [0, 0] for layer in cache.cross_attention_cache.layers)
        # a model that does not mark its cross-attention with is_causal=False: still not served from the pages (the
        # paged attention would ignore the encoder's padding)
        for path, module in model.named_modules():
            if path.endswith(("encoder_attn", "EncDecAttention")):  # the decoder's cross-attention (BART, T5)
                module.is_causal = True
        out = _generate_ed(model, inputs, EncoderDecoderCache(QuantizedPagedCache(**NO_QUANT),
                                                              QuantizedPagedCache(**NO_QUANT)), n=8, **kw)
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), rtol=1e-4, atol=1e-4)


def test_cross_attention_as_long_as_the_decoder_step_is_not_served_as_self_attention():
    """Teacher forcing 30 decoder tokens over a 30-token, right-padded encoder input: the cross-attention keys then
    have the queries' length; BART marks those modules is_causal=False, and they must not be served as causal
    self-attention (which would also count the encoder's padding as the cache's pads). Nothing is quantized: the
    logits equal DynamicCache's."""
    from transformers import EncoderDecoderCache

    model = _bart()
    gen = torch.Generator().manual_seed(1)
    ids, dec = torch.randint(3, 128, (2, 30), generator=gen), torch.randint(3, 128, (2, 30), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -6:] = 0
    nxt = torch.randint(3, 128, (2, 1), generator=gen)

    def run(cache):
        with torch.no_grad():
            enc = model.get_encoder()(input_ids=ids, attention_mask=mask)
            kw = dict(encoder_outputs=enc, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
            return torch.cat([model(decoder_input_ids=dec, **kw).logits, model(decoder_input_ids=nxt, **kw).logits], 1)

    ref = run(EncoderDecoderCache(DynamicCache(), DynamicCache()))
    cache = EncoderDecoderCache(QuantizedPagedCache(**NO_QUANT), QuantizedPagedCache(**NO_QUANT))
    torch.testing.assert_close(run(cache), ref, rtol=1e-5, atol=1e-5)
    assert all(layer.pads == [0, 0] for layer in cache.cross_attention_cache.layers)


def test_whisper_generate_returning_a_dict():
    """Whisper's generate with ``return_dict_in_generate`` splits the cache by sequence through each layer's
    ``keys``/``values``, which must not be None (a TypeError there): they are the dequantized history."""
    from transformers import EncoderDecoderCache

    model = _whisper()
    inputs = _encoder_inputs("whisper")
    kw = dict(return_dict_in_generate=True, output_scores=True)
    ref = _generate_ed(model, inputs, EncoderDecoderCache(DynamicCache(), DynamicCache()), **kw)
    out = _generate_ed(model, inputs, EncoderDecoderCache(QuantizedPagedCache(**NO_QUANT), DynamicCache()), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores))


def test_layer_keys_and_values_are_the_dequantized_history():
    """``layer.keys``/``layer.values`` and iterating the cache give what a DynamicCache holds (``[B, H, seen, D]``,
    right-aligned; stored tokens dequantized), pending tokens included, without committing anything."""
    from models import tiny_llama

    model = tiny_llama()
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    caches = [DynamicCache(), QuantizedPagedCache(**PAGED)]
    with torch.no_grad():
        for cache in caches:
            model(ids, attention_mask=mask, **cache_kwargs(model, cache))
    ref, got = caches
    assert got.layers[0].paged_lens == [16, 16]  # pages in use
    assert len(list(got)) == len(list(ref)) == 2
    for (rk, rv, _), (k, v, sliding) in zip(ref, got, strict=True):
        assert sliding is None and k.shape == rk.shape and v.shape == rv.shape
        real = mask.bool()[:, None, :, None]
        torch.testing.assert_close(k * real, rk * real, atol=0.05, rtol=0.05)
        torch.testing.assert_close(v * real, rv * real, atol=0.05, rtol=0.05)
    layer = got.layers[1]
    torch.testing.assert_close(layer.keys[:, :, -8:], ref.layers[1].keys[:, :, -8:])  # the window: exact
    # a pending step (update called, attention not yet run) shows in keys and stays pending
    new = torch.randn(2, 4, 3, 32)
    kh, _ = got.update(new, new, 0)
    assert got.layers[0].keys.shape == (2, 4, 43, 32) and got.layers[0].pending is not None
    assert torch.equal(got.layers[0].keys[:, :, -3:], new)
    with pytest.raises(AttributeError, match="read-only"):
        got.layers[0].keys = new
    assert QuantizedPagedLayer(QuantConfig()).keys is None  # before the first update, as a DynamicLayer's


def test_values_of_another_head_dim_are_refused_clearly():
    """DeepSeek-V3's multi-head latent attention caches 32-channel keys and 16-channel values: refused at the first
    update, naming the shapes, with nothing stored."""
    torch.manual_seed(0)
    cfg = T.DeepseekV3Config(**dict(SMALL, num_key_value_heads=4), n_routed_experts=2, num_experts_per_tok=1,
                             moe_intermediate_size=64, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
                             qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1)
    model = T.DeepseekV3ForCausalLM(cfg).eval()
    cache = QuantizedPagedCache()
    with pytest.raises(ValueError, match=r"values have another head_dim than its keys"), torch.no_grad():
        model(torch.randint(3, 128, (1, 8)), **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 0 and not any(layer.is_initialized for layer in cache.layers)


def test_falcon_alibi_matches_dynamic_cache():
    """Falcon with ALiBi: from transformers 5.25 its bias is added into the attention mask handed to the sdpa
    function (5.24 computed attention itself); the paged attention reads only padding from the mask."""
    torch.manual_seed(0)
    cfg = T.FalconConfig(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         multi_query=True, alibi=True, new_decoder_architecture=False)
    model = T.FalconForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ref_seq, ref_logits = _generate(model, ids, mask, DynamicCache())
    seq, logits = _generate(model, ids, mask, QuantizedPagedCache(**NO_QUANT))
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(seq, ref_seq)


@pytest.mark.parametrize("new", [1, 3])
def test_additive_bias_in_the_mask_takes_the_fallback(new):
    """A floating 4-D mask holding values other than 0 and the masked-out minimum carries a bias (ALiBi, a user's
    mask): the decode step and a chunk on a filled cache, which read only padding from the mask, take the
    materialized fallback instead of dropping it."""
    from models import tiny_llama

    model = tiny_llama()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 128, (2, 40), generator=gen)
    nxt = torch.randint(1, 128, (2, new), generator=gen)
    total = 40 + new
    bias = -0.3 * (total - 1 - torch.arange(total, dtype=torch.float32))  # ALiBi-like: older keys weigh less
    mask = bias.expand(2, 1, new, total).clone()
    causal = torch.ones(new, total, dtype=torch.bool).tril(40)
    mask[:, :, ~causal] = torch.finfo(torch.float32).min
    mask[1, :, :, 5] = torch.finfo(torch.float32).min  # and a token hidden from the second sequence
    logits = []
    for cache in (DynamicCache(), QuantizedPagedCache(**NO_QUANT)):
        with torch.no_grad():
            model(ids, **cache_kwargs(model, cache))
            out = model(nxt, attention_mask=mask, position_ids=torch.arange(40, total).expand(2, new),
                        **cache_kwargs(model, cache))
        logits.append(out.logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_fallback_layers_do_not_store_pads():
    """Layers the hook leaves to the materialized fallback (here Llama 4's chunked attention) still see the padding
    mask: a left-padded batch stores no pad tokens there either, so each sequence is quantized in the same groups
    as alone (stored pads would shift the sequence's key groups)."""
    torch.manual_seed(0)
    model = WINDOWED["llama4"]().eval()
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ids[1, :7] = 0
    cache = QuantizedPagedCache(**PAGED)
    _, logits = _generate(model, ids, mask, cache)
    assert all(layer.pads == [0, 7] for layer in cache.layers)
    alone = QuantizedPagedCache(**PAGED)
    _, alone_logits = _generate(model, ids[1:, 7:], None, alone)
    assert cache.layers[0].paged_lens[1] == alone.layers[0].paged_lens[0] > 0
    torch.testing.assert_close(logits[1], alone_logits[0], rtol=1e-4, atol=1e-4)


def test_hybrid_models_with_state_layers_are_refused_clearly():
    """LFM2's convolution layers (and Mamba / linear-attention layers of Jamba, Qwen3-Next) keep state in the
    cache through ``has_previous_state``/``update_conv_state``: without ``config=`` that was an IndexError inside
    transformers' Cache; now a ValueError naming what is unsupported."""
    torch.manual_seed(0)
    cfg = T.Lfm2Config(**dict(SMALL, num_hidden_layers=4), layer_types=["conv", "full_attention"] * 2)
    model = T.Lfm2ForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match="convolution or state-space layers"), torch.no_grad():
        model.generate(torch.randint(3, 128, (1, 8)), **cache_kwargs(model, QuantizedPagedCache()), max_new_tokens=2)
    with pytest.raises(ValueError, match="layer_types"):
        QuantizedPagedCache(config=cfg)


# sliding-window models: (model, how it names the window); windows of 24 tokens over pages of 16 and a residual
# window of 8 (+ a group of 16 before a flush), so a query's window starts in the pages, mid-page or in the residual
def _gpt_oss(attn="kivi"):
    """GPT-OSS (learned sink logits, ``s_aux``): a sliding layer (window 24) and a full one; sinks of order 1-5 (its
    init's 0.02 would hardly matter)."""
    cfg = T.GptOssConfig(**dict(SMALL, intermediate_size=128), head_dim=32, num_local_experts=2,
                         num_experts_per_tok=1, sliding_window=24, layer_types=["sliding_attention", "full_attention"])
    model = T.GptOssForCausalLM(cfg).eval()
    for module in model.modules():
        if hasattr(module, "sinks"):
            torch.nn.init.normal_(module.sinks, std=2.0)
    model.set_attn_implementation(attn)
    return model


SLIDING = {
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, head_dim=32, sliding_window=24)),  # argument
    "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**SMALL, sliding_window=24, pad_token_id=0)),
    "starcoder2": lambda: T.Starcoder2ForCausalLM(T.Starcoder2Config(**SMALL, sliding_window=24)),
    # the module holds it, and only some layers are sliding (config.layer_types)
    "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        **dict(SMALL, num_hidden_layers=3), head_dim=32, sliding_window=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=24,
                                                      max_window_layers=1)),
    # every module holds the window, the global layers too (which pass sliding_window=None)
    "exaone4": lambda: T.Exaone4ForCausalLM(T.Exaone4Config(**SMALL, head_dim=32, sliding_window=24,
                                                            layer_types=["sliding_attention", "full_attention"])),
    # learned sink logits (s_aux) on a sliding and a full layer, served under attn_implementation="kivi"
    "gpt_oss": _gpt_oss,
}
SLIDING_PAGED = dict(key_bits=8, value_bits=8, group_size=16, residual_length=8, page_size=16)


def _materialize_calls(monkeypatch):
    calls = []
    real = QuantizedPagedLayer.materialize
    monkeypatch.setattr(QuantizedPagedLayer, "materialize", lambda self, *a: calls.append(self.seen) or real(self, *a))
    return calls


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_window_models_are_served_from_the_pages(monkeypatch, family):
    """Sliding-window layers are served by the paged attention with the window (no fallback step), for a padded
    batch, a prompt longer than the window and 24 decode steps. With the same stored tokens the served logits equal
    the materialized fallback's (sdpa over the dequantized history with transformers' sliding mask) and stay close
    to DynamicCache's (8-bit); sliding layers keep no sink tokens, the others keep theirs."""
    from kivi_cache import hook

    torch.manual_seed(0)
    model = SLIDING[family]().eval()
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ids[1, :7] = 0
    _, ref_logits = _generate(model, ids, mask, DynamicCache(), n=24)
    calls = _materialize_calls(monkeypatch)
    served = QuantizedPagedCache(**SLIDING_PAGED, sink_length=2)
    seq, logits = _generate(model, ids, mask, served, n=24)
    assert calls == []
    windows = [layer.sliding_window for layer in served.layers]
    assert 24 in windows and all(w in (None, 24) for w in windows), windows
    assert all((layer.cfg.sink_length == 0) == (layer.sliding_window is not None) for layer in served.layers)
    assert all(sum(layer.paged_lens) > 0 for layer in served.layers)  # the pages are read
    err = ((logits - ref_logits).norm() / ref_logits.norm()).item()
    assert err < 2e-2, err
    # the same storage (no sinks anywhere), attention through the fallback: the same logits
    same = QuantizedPagedCache(**SLIDING_PAGED)
    _, served_logits = _generate(model, ids, mask, same, n=24)
    monkeypatch.setattr(hook, "_pattern", lambda module, kwargs: (False, None))
    _, fallback_logits = _generate(model, ids, mask, QuantizedPagedCache(**SLIDING_PAGED), n=24)
    assert calls  # now every step took the fallback
    torch.testing.assert_close(served_logits, fallback_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [24, 25])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_sliding_window_release_at_every_window_phase(monkeypatch, window, backend):
    """The page a window's oldest token sits in must stay until the window has left it. With window 25 over 16-token
    pages and an 8-token residual the window's start crosses a page boundary exactly at some steps (window 24 never
    does); on the torch backend the decode runner calls the op without its kernel path. Served logits equal the
    fallback's, which stores every token and never releases a page."""
    import kivi_cache
    from kivi_cache import hook

    torch.manual_seed(0)
    model = T.MistralForCausalLM(T.MistralConfig(**SMALL, head_dim=32, sliding_window=window)).eval()
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    kivi_cache.set_backend(backend)
    try:
        served = QuantizedPagedCache(**SLIDING_PAGED)
        _, logits = _generate(model, ids, None, served, n=40)
    finally:
        kivi_cache.set_backend("auto")
    assert served.layers[0].sliding_window == window and served.layers[0].hidden[0] > 0  # pages were released
    monkeypatch.setattr(hook, "_pattern", lambda module, kwargs: (False, None))
    _, fallback_logits = _generate(model, ids, None, QuantizedPagedCache(**SLIDING_PAGED), n=40)
    torch.testing.assert_close(logits, fallback_logits, rtol=1e-4, atol=1e-4)


def test_soft_capping_is_never_served_from_the_pages(monkeypatch):
    """Gemma 2 caps its attention scores (attn_logit_softcapping), which the paged kernels do not: under "kivi" every
    step takes the fallback, the original sdpa, which from transformers 5.25 refuses soft-capping with a ValueError
    (use eager attention for Gemma 2; 5.17's sdpa ignores the cap, as with attn_implementation="sdpa" and any cache).
    A one-token prompt is the case that would otherwise be served from the pages."""
    from transformers.models.gemma2 import modeling_gemma2

    torch.manual_seed(0)
    model = modeling_gemma2.Gemma2ForCausalLM(T.Gemma2Config(
        **SMALL, head_dim=32, attn_logit_softcapping=2.0, sliding_window=512)).eval()
    model.set_attn_implementation("kivi")
    calls = _materialize_calls(monkeypatch)
    ids = torch.randint(3, 128, (1, 1), generator=torch.Generator().manual_seed(1))
    try:
        _generate(model, ids, None, QuantizedPagedCache(**SLIDING_PAGED), n=4)
        assert len(calls) == 2 * 4  # 5.17: every step of both layers took the fallback
    except ValueError as e:
        assert "softcap" in str(e) and calls  # 5.25: the fallback's sdpa refused the cap at the first step


def test_global_layers_of_a_model_whose_modules_all_hold_the_window():
    """EXAONE 4 sets ``sliding_window`` on every attention module, its global (full-attention) layers too, and
    passes ``sliding_window=None`` for those: they are full attention (the hook must not go by the module's attribute:
    windowing them puts the logits 124% off DynamicCache's). Nothing quantized: the logits equal DynamicCache's."""
    torch.manual_seed(0)
    model = SLIDING["exaone4"]().eval()
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(1))
    ref_seq, ref_logits = _generate(model, ids, None, DynamicCache())
    cache = QuantizedPagedCache(**NO_QUANT)
    seq, logits = _generate(model, ids, None, cache)
    assert [layer.sliding_window for layer in cache.layers] == [24, None]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(seq, ref_seq)


@pytest.mark.parametrize("family", ["mistral", "gemma3", "gpt_oss"])
def test_sliding_window_chunked_prefill_and_continued_generation(monkeypatch, family):
    """Several new tokens over a filled sliding-window cache (a second ``generate`` on the same cache, and a prompt
    prefilled in chunks): each query's window starts at its own position; the logits equal the fallback's over the
    same storage."""
    from kivi_cache import hook

    torch.manual_seed(0)
    model = SLIDING[family]().eval()
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(2))

    def run():
        cache = QuantizedPagedCache(**SLIDING_PAGED)
        first, _ = _generate(model, ids[:, :30], None, cache, n=6)
        with torch.no_grad():
            out = model(torch.cat([first, ids[:, 36:]], 1), **cache_kwargs(model, cache))
        return out.logits

    calls = _materialize_calls(monkeypatch)
    served = run()
    assert calls == []
    monkeypatch.setattr(hook, "_pattern", lambda module, kwargs: (False, None))
    torch.testing.assert_close(served, run(), rtol=1e-4, atol=1e-4)


def test_a_layer_holding_sinks_keeps_them_and_falls_back_past_the_window(monkeypatch):
    """A layer that stored sink tokens before the hook saw its window (here: filled through ``update`` alone)
    cannot drop them: it refuses the window, is served while the timeline is shorter than it and takes the
    fallback from there (exact with nothing quantized)."""
    layer_cache = QuantizedPagedCache(**NO_QUANT, sink_length=2)
    layer_cache.update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32), 0)
    layer = layer_cache.layers[0]
    layer._flush_pending()
    assert layer.sinks == [2] and not layer.use_sliding_window(16) and layer.sliding_window is None
    empty = QuantizedPagedCache(sink_length=2)
    empty.update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32), 0)
    assert empty.layers[0].use_sliding_window(16) and empty.layers[0].cfg.sink_length == 0
    assert empty.quant_config.sink_length == 2  # the cache's setting (other layers) is untouched
    assert empty.layers[0].use_sliding_window(16) and not empty.layers[0].use_sliding_window(32)


def test_sliding_window_layers_release_the_pages_no_query_sees(monkeypatch):
    """A sliding-window layer keeps only the pages its window can still reach: a long prompt's hidden part is never
    written (zero-page entries), decoding releases pages as the window moves, so the pages in use stay bounded by
    the window whatever the length; full-attention layers keep everything. The output equals the fallback's
    (which stores everything) and beam search over the shared pages too."""
    from kivi_cache import hook

    torch.manual_seed(0)
    model = SLIDING["gemma3"]().eval()  # layers 0, 1 sliding (24), 2 full
    ids = torch.randint(3, 128, (2, 200), generator=torch.Generator().manual_seed(3))
    cache = QuantizedPagedCache(**SLIDING_PAGED)
    seq, logits = _generate(model, ids, None, cache, n=40)
    p = SLIDING_PAGED["page_size"]
    sliding, full = cache.layers[0], cache.layers[2]
    assert sliding.sliding_window == 24 and full.sliding_window is None
    zero = sliding.pool.zero
    for i in range(2):
        table = sliding.tables[i]
        assert sliding.hidden[i] >= (200 + 40 - 24 - 8 - 16) // p - 1
        assert all(page == zero for page in table[:sliding.hidden[i]]) and zero not in table[sliding.hidden[i]:]
    # live pages: the window, the residual window and a group before a flush, over 16-token pages, + the zero page
    bound = 2 * (-(-(24 + 8 + 16) // p) + 1) + 1
    assert sliding.pool.pages_in_use <= bound < full.pool.pages_in_use
    assert sliding.pool.capacity < full.pool.capacity  # the prompt's hidden part was never written
    assert full.pool.zero is None and all(len(t) == full.paged_lens[i] // p for i, t in enumerate(full.tables))
    report = cache.memory_report()
    assert report is not None
    monkeypatch.setattr(hook, "_pattern", lambda module, kwargs: (False, None))
    fallback = QuantizedPagedCache(**SLIDING_PAGED)
    fb_seq, fb_logits = _generate(model, ids, None, fallback, n=40)
    assert fallback.layers[0].pool.zero is None
    torch.testing.assert_close(logits, fb_logits, rtol=1e-4, atol=1e-4)

    def beams():  # beam search: the beams share pages, the zero page included
        with torch.no_grad():
            return model.generate(ids[:1, :150], **cache_kwargs(model, QuantizedPagedCache(**SLIDING_PAGED)),
                                  max_new_tokens=30, min_new_tokens=30, num_beams=3, do_sample=False, pad_token_id=0)

    fb_beams = beams()  # still the fallback
    monkeypatch.undo()
    assert torch.equal(beams(), fb_beams)


def test_crop_refuses_to_bring_released_tokens_back(monkeypatch):
    """``crop`` on a sliding-window layer that released pages: allowed while the window stays clear of them (up to
    the limit: the next query, at the kept length, sees the last 24 stored indices, and its logits equal the
    fallback's over the same history), a ValueError naming the limit (and nothing changed) past it."""
    from kivi_cache import hook

    torch.manual_seed(0)
    model = SLIDING["mistral"]().eval()
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(4))
    cache = QuantizedPagedCache(**SLIDING_PAGED)
    seq, _ = _generate(model, ids, None, cache, n=4)
    layer = cache.layers[0]
    assert layer.hidden[0] > 0
    limit = layer.paged_lens[0] + layer.window_lens[0] + 1 - layer.hidden[0] * SLIDING_PAGED["page_size"] - 24
    assert limit > 0
    before = (list(layer.tables[0]), layer.paged_lens[:], layer.window_lens[:], layer.seen)
    with pytest.raises(ValueError, match=f"crop by at most {limit} tokens"):
        cache.crop(-(limit + 1))
    assert (layer.tables[0], layer.paged_lens, layer.window_lens, layer.seen) == before
    cache.crop(-limit)
    assert layer.seen == before[3] - limit
    nxt = seq[:, layer.seen:layer.seen + 1]
    with torch.no_grad():
        logits = model(nxt, **cache_kwargs(model, cache)).logits
    monkeypatch.setattr(hook, "_pattern", lambda module, kwargs: (False, None))
    fallback = QuantizedPagedCache(**SLIDING_PAGED)
    _generate(model, ids, None, fallback, n=4)
    fallback.crop(-limit)
    with torch.no_grad():
        ref = model(nxt, **cache_kwargs(model, fallback)).logits
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_assisted_decoding_with_a_sliding_window_model(monkeypatch):
    """Assisted decoding stores the candidates as a chunk and crops the rejected ones: a sliding-window layer keeps
    the pages its chunk's first query sees, so crop can take any of the chunk back (with pages released by the
    chunk's last token, crop(-1) would raise). The tokens equal the fallback's over the same storage."""
    from kivi_cache import hook

    torch.manual_seed(0)
    model = SLIDING["mistral"]().eval()
    torch.manual_seed(1)
    assistant = SLIDING["mistral"]().eval()
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(40))

    def run():
        cache = QuantizedPagedCache(**SLIDING_PAGED)
        with torch.no_grad():
            out = model.generate(ids, **cache_kwargs(model, cache), assistant_model=assistant, max_new_tokens=20,
                                 min_new_tokens=20, do_sample=False, pad_token_id=0, num_assistant_tokens=6,
                                 num_assistant_tokens_schedule="constant")
        return out, cache

    served, cache = run()
    assert cache.layers[0].hidden[0] > 0
    monkeypatch.setattr(hook, "_pattern", lambda module, kwargs: (False, None))
    assert torch.equal(served, run()[0])


def test_past_recording_keeps_a_prompts_pages_for_crop():
    """transformers' ``activate_past_recording`` (assisted decoding, before its first forward: the prompt plus the
    first candidates): a sliding-window layer then writes all of a prompt's pages (none skipped), so crop can take
    back any of its tokens; without it the prompt's hidden pages are never written and such a crop is refused."""
    torch.manual_seed(0)
    model = SLIDING["mistral"]().eval()
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(5))
    for record in (False, True):
        cache = QuantizedPagedCache(**SLIDING_PAGED)
        if record:  # as transformers 5.25 calls it (a keyword for recurrent layers, which do not apply here)
            cache.activate_past_recording(recurrent_states_to_keep=3)
        with torch.no_grad():
            model(ids, **cache_kwargs(model, cache))
        assert all(layer.record_past == record for layer in cache.layers)
        if not record:
            with pytest.raises(ValueError, match="would bring tokens back"):
                cache.crop(-30)
            continue
        cache.crop(-30)
        with torch.no_grad():
            logits = model(ids[:, 70:71], **cache_kwargs(model, cache)).logits
    with torch.no_grad():
        ref = model(ids[:, :71], **cache_kwargs(model, QuantizedPagedCache(**SLIDING_PAGED))).logits[:, -1:]
    torch.testing.assert_close(logits, ref, rtol=2e-2, atol=2e-2)


def test_memory_baseline_of_sliding_layers_is_the_dynamic_caches():
    """A sliding-window layer's baseline is what transformers' DynamicCache(config=...) holds for it (the last
    window - 1 positions of a DynamicSlidingWindowLayer), a full layer's every position: the report's
    ``baseline_allocated`` is that cache's tensors' bytes after the same generate, padded batch included."""
    torch.manual_seed(0)
    model = SLIDING["gemma3"]().eval()  # layers 0, 1 sliding (24), 2 full
    ids = torch.randint(3, 128, (2, 100), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    dyn, ours = DynamicCache(config=model.config), QuantizedPagedCache(**SLIDING_PAGED)
    _generate(model, ids, mask, dyn, n=20)
    _generate(model, ids, mask, ours, n=20)
    assert [type(layer).__name__ for layer in dyn.layers][:2] == ["DynamicSlidingWindowLayer"] * 2
    rep = ours.memory_report()
    held = sum(t.numel() * t.element_size() for layer in dyn.layers for t in (layer.keys, layer.values))
    token_bytes = 2 * 2 * 32 * 4  # key and value, 2 KV heads of 32 channels, float32
    positions = 100 + 20 - 1
    assert rep.baseline_allocated == held == 2 * (2 * 23 + positions) * token_bytes
    assert rep.baseline_live == (2 * 2 * 23 + 2 * positions - 30) * token_bytes  # the window holds real tokens only
    assert rep.live_ratio < 1


def test_config_sizes_the_pools_of_sliding_layers():
    """``config=`` with ``max_batch_size``/``max_cache_len``: a sliding-window layer's pool holds the pages its window
    reaches (``QuantConfig.sliding_pages_per_sequence`` per sequence, + the zero page), a full layer's the whole
    ``max_cache_len``; generation stays within them (no pool growth) and gives the tokens of a cache without them."""
    from transformers import MistralConfig, Qwen2Config

    from kivi_cache.cache import _layer_windows

    assert _layer_windows(MistralConfig(sliding_window=64, num_hidden_layers=3)) == [64] * 3
    assert _layer_windows(MistralConfig(sliding_window=None, num_hidden_layers=2)) == [None] * 2
    assert _layer_windows(Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=1,
                                      num_hidden_layers=2)) == [None, 64]
    torch.manual_seed(0)
    model = SLIDING["gemma3"]().eval()  # layers 0, 1 sliding (24), 2 full
    ids = torch.randint(3, 128, (2, 200), generator=torch.Generator().manual_seed(3))
    cfg = QuantConfig(**SLIDING_PAGED)
    sized = QuantizedPagedCache(**SLIDING_PAGED, config=model.config, max_batch_size=2, max_cache_len=260)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the budget: no warning that the cache outgrew it
        seq, _ = _generate(model, ids, None, sized, n=40)
    sliding = 2 * cfg.sliding_pages_per_sequence(24, 260) + 1
    assert sliding == 5
    assert [layer.pool.capacity for layer in sized.layers] == [sliding, sliding, 2 * cfg.pages_per_sequence(260)]
    plain_seq, _ = _generate(model, ids, None, QuantizedPagedCache(**SLIDING_PAGED), n=40)
    assert torch.equal(seq, plain_seq)
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        cfg.sliding_pages_per_sequence(0, 100)


def test_sliding_page_bound_is_tight(monkeypatch):
    """``QuantConfig.sliding_pages_per_sequence`` is the most pages a sequence of a sliding layer holds while
    decoding: across windows of several phases against 32-token pages of 8-token groups (R=8), a padded batch of 2
    and beam search, the peak of the pool's pages in use (the zero page aside) never exceeds the bound times the
    sequences, and reaches it for some windows (so one page less would not do, and one more would waste a page a
    sequence)."""
    from kivi_cache.pool import PagePool

    paged = dict(key_bits=8, value_bits=8, group_size=8, residual_length=8, page_size=32)
    cfg = QuantConfig(**paged)
    peak = {}
    for name in ("allocate", "allocate_many", "copy_on_write"):
        real = getattr(PagePool, name)

        def wrapped(self, *a, _real=real):
            out = _real(self, *a)
            new = [out] if isinstance(out, int) else out
            used = self.pages_in_use - (self.zero is not None and self.zero not in new)  # the zero page aside
            peak[id(self)] = max(peak.get(id(self), 0), used)
            return out
        monkeypatch.setattr(PagePool, name, wrapped)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    peaks = {}
    for w, beams in [(w, 1) for w in range(27, 60, 4)] + [(45, 2)]:
        peak.clear()
        torch.manual_seed(0)
        model = T.MistralForCausalLM(T.MistralConfig(**dict(SMALL, num_hidden_layers=1), head_dim=32,
                                                     sliding_window=w)).eval()
        cache = QuantizedPagedCache(**paged)
        _generate(model, ids, mask, cache, n=150, num_beams=beams)
        assert cache.layers[0].sliding_window == w
        seqs = 2 * beams
        peaks[w, beams] = (max(peak.values()), seqs * cfg.sliding_pages_per_sequence(w, 159),
                           seqs * cfg.pages_per_sequence(159))
    assert all(p <= b < f for p, b, f in peaks.values()), peaks
    assert any(p == b for p, b, _ in peaks.values()), peaks


def test_learned_attention_sinks_are_served(monkeypatch):
    """GPT-OSS adds a learned sink logit per query head to every softmax (``s_aux``), which sdpa would drop (its
    logits would be far off that way). With ``attn_implementation="kivi"`` the sinks are computed: on the
    prompt and with DynamicCache by sdpa with the sink as one more key, while decoding by the kernels' merge. Padded
    batch, sliding and full layers: nothing quantized, the logits equal the eager model's with DynamicCache; 8-bit,
    served with no fallback step and close to it; the sinks matter (dropped, the logits are far off)."""
    from kivi_cache import hook

    torch.manual_seed(0)
    model = _gpt_oss(attn="eager")
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    ids[1, :7] = 0
    ref_seq, ref_logits = _generate(model, ids, mask, DynamicCache(), n=24)
    _, eager_logits = _generate(model, ids, mask, QuantizedPagedCache(**NO_QUANT), n=24)  # the materialized history
    torch.testing.assert_close(eager_logits, ref_logits, rtol=1e-4, atol=1e-4)
    model.set_attn_implementation("kivi")
    _, dyn_logits = _generate(model, ids, mask, DynamicCache(), n=24)
    torch.testing.assert_close(dyn_logits, ref_logits, rtol=1e-4, atol=1e-4)
    calls = _materialize_calls(monkeypatch)
    seq, logits = _generate(model, ids, mask, QuantizedPagedCache(**NO_QUANT), n=24)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(seq, ref_seq)
    cache = QuantizedPagedCache(**SLIDING_PAGED)
    _, logits8 = _generate(model, ids, mask, cache, n=24)
    assert calls == [] and all(sum(layer.paged_lens) > 0 for layer in cache.layers)
    assert [layer.sliding_window for layer in cache.layers] == [24, None]
    err = ((logits8 - ref_logits).norm() / ref_logits.norm()).item()
    assert err < 2e-2, err
    monkeypatch.setattr(hook, "_sink_logits", lambda kwargs: None)
    _, dropped = _generate(model, ids, mask, QuantizedPagedCache(**NO_QUANT), n=24)
    assert ((dropped - ref_logits).norm() / ref_logits.norm()).item() > 0.1


def test_sdpa_with_sinks_matches_gpt_oss_eager_attention():
    """The sink-aware sdpa (prompt, fallback, other caches) against GPT-OSS's own eager attention function over
    masks of every kind it meets: none (a causal prompt: one discarded query keeps it square), a bool mask with
    padding and a window, a float mask, fewer queries than keys without a mask (top-left, as sdpa's is_causal:
    a prompt in transformers' StaticCache buffer); fp32 and
    bf16 (the sink split over two channels keeps it to fp32 accuracy)."""
    from transformers.models.gpt_oss import modeling_gpt_oss as G

    from kivi_cache.hook import sdpa_with_sinks

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    module.sinks = torch.nn.Parameter(torch.randn(4) * 3 + 0.3)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for lq, lk in ((9, 9), (4, 11)):
            q = torch.randn(2, 4, lq, 32).to(dtype)
            k = torch.randn(2, 2, lk, 32).to(dtype)
            v = torch.randn(2, 2, lk, 32).to(dtype)
            pos_q = torch.arange(lq)[:, None] + lk - lq
            causal = torch.arange(lk)[None, :] <= pos_q
            window = causal & (pos_q - torch.arange(lk)[None, :] < 5)
            padded = causal[None, None].repeat(2, 1, 1, 1)
            padded[1, :, :, :3] = False
            floating = torch.where(window, 0.0, torch.finfo(dtype).min)[None, None].to(dtype)
            top_left = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None]
            for mask in (None, window[None, None], padded, floating):
                dense = top_left[None, None] if mask is None else mask
                if dense.dtype == torch.bool:
                    dense = torch.where(dense, 0.0, torch.finfo(torch.float32).min)
                want, _ = G.eager_attention_forward(module, q.float(), k.float(), v.float(), dense.float(),
                                                    scaling=32 ** -0.5)
                got, _ = sdpa_with_sinks(module, q, k, v, mask, scaling=32 ** -0.5, s_aux=module.sinks)
                assert got.shape == want.shape and got.dtype == dtype
                err = ((got.float() - want).norm() / want.norm()).item()
                assert err < tol, (dtype, lq, lk, None if mask is None else mask.dtype, err)


def test_learned_sinks_with_transformers_static_cache():
    """GPT-OSS under our attention (``kivi``) with transformers' own StaticCache: the prompt's full layer gets keys
    of the whole static buffer and no mask (sdpa's is_causal, aligned top-left); the logits equal GPT-OSS's eager
    attention with the same cache (a mask aligned bottom-right puts the logits 0.7 off)."""
    from transformers import StaticCache

    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    out = {}
    for impl in ("eager", "kivi"):
        torch.manual_seed(0)
        model = _gpt_oss(attn=impl)
        out[impl] = _generate(model, ids, torch.ones_like(ids), StaticCache(config=model.config, max_cache_len=100))
    assert torch.equal(out["kivi"][0], out["eager"][0])
    torch.testing.assert_close(out["kivi"][1], out["eager"][1], rtol=1e-4, atol=1e-4)


def test_eager_attention_over_a_quantized_history_warns_once(monkeypatch):
    """A model left on eager attention (GPT-OSS's default) reads our cache through the dequantized history: correct
    but slow, so the first such decode step over quantized pages warns once per process, naming the fix."""
    import warnings

    from kivi_cache import handles

    monkeypatch.setattr(handles, "_warned_slow", False)
    torch.manual_seed(0)
    model = _gpt_oss(attn="eager")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _generate(model, ids, None, QuantizedPagedCache(**SLIDING_PAGED), n=4)
        _generate(model, ids, None, QuantizedPagedCache(**SLIDING_PAGED), n=4)
    slow = [r for r in rec if "does not read the quantized pages" in str(r.message)]
    assert len(slow) == 1 and "attn_implementation='kivi'" in str(slow[0].message)
    model.set_attn_implementation("kivi")
    monkeypatch.setattr(handles, "_warned_slow", False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _generate(model, ids, None, QuantizedPagedCache(**SLIDING_PAGED), n=4)
    assert not [r for r in rec if "does not read the quantized pages" in str(r.message)]

"""Importing kivi_cache must not change what a model computes with transformers' own caches (or none): the hook
wraps the global "sdpa" function and registers "kivi"; with keys that are not our handles both must give the model's
reference attention (transformers' own sdpa, restored by ``hook.uninstall()``; for GPT-OSS's learned sinks its eager
attention). Tiny random fp32 models, no download."""

import pytest
import torch
import transformers as T
from test_families import SLIDING, _gpt_oss
from transformers import DynamicCache, EncoderDecoderCache, StaticCache

from kivi_cache import cache_kwargs, hook

L, PAD, N = 44, 7, 6  # a prompt past the windows of 24, the second sequence left-padded by 7, 6 new tokens


def _llama():
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16))


FAMILIES = {"llama": _llama, "qwen2": SLIDING["qwen2"], "mistral": SLIDING["mistral"], "gemma3": SLIDING["gemma3"],
            "gpt_oss": _gpt_oss}


def _inputs(padded=True):
    ids = torch.randint(3, 128, (2, L), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :PAD] = 0
        ids[1, :PAD] = 0
    return ids, mask


def _gen(model, ids, mask, **kw):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)
    return out, torch.stack(out.logits, 1)


def _cases(model):
    """name -> logits, each a way of running the model on transformers' caches (or none)."""
    ids, mask = _inputs()
    out = {}
    with torch.no_grad():
        out["default"] = _gen(model, ids, mask)[1]
        out["dynamic_config"] = _gen(model, ids, mask, **cache_kwargs(model, DynamicCache(config=model.config)))[1]
        # no padding: the prompt gets no mask at all over a static buffer longer than it (sdpa's is_causal)
        for padded in (False, True):
            cache = StaticCache(config=model.config, max_cache_len=80)
            out[f"static_pad{int(padded)}"] = _gen(model, *_inputs(padded), **cache_kwargs(model, cache))[1]
        out["no_cache"] = model(ids, attention_mask=mask, use_cache=False).logits * mask[..., None]
        # a prompt prefilled in chunks, then a second generate continuing on the returned cache (a chunk after a
        # history)
        first, first_logits = _gen(model, ids[:, :30], mask[:, :30], prefill_chunk_size=16,
                                   **cache_kwargs(model, DynamicCache()))
        ids2 = torch.cat([first.sequences, ids[:, 30:]], 1)
        mask2 = torch.cat([mask[:, :30], torch.ones(2, N, dtype=mask.dtype), mask[:, 30:]], 1)
        _, second_logits = _gen(model, ids2, mask2, **cache_kwargs(model, first.past_key_values))
        out["chunked_continued"] = torch.cat([first_logits, second_logits], 1)
    return out


def _reference(model, family):
    if family == "gpt_oss":  # learned sinks: GPT-OSS's own (eager) attention
        model.set_attn_implementation("eager")
        return _cases(model)
    hook.uninstall()  # transformers' own sdpa
    try:
        model.set_attn_implementation("sdpa")
        return _cases(model)
    finally:
        hook.install()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_caches_give_the_reference_attention(family):
    """DynamicCache(config=...) (sliding layers), StaticCache (padded or not), generate's default cache, no cache,
    chunked prefill and a continued generate: "sdpa" (wrapped) and "kivi" equal the reference."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    ref = _reference(model, family)
    for impl in ("kivi",) if family == "gpt_oss" else ("sdpa", "kivi"):
        model.set_attn_implementation(impl)
        got = _cases(model)
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-4,
                                       msg=lambda m, i=impl, n=name: f"{i} {n}: {m}")


def _bart():
    cfg = T.BartConfig(vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
                       pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                       forced_eos_token_id=None)
    return T.BartForConditionalGeneration(cfg)


def _t5():  # (as many encoder as decoder layers: generate's default cache assumes it in transformers 5.25)
    cfg = T.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                     decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T.T5ForConditionalGeneration(cfg)


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_encoder_decoder_with_transformers_caches(name):
    """BART, T5 (a position bias passed to the attention function): the encoder (bidirectional, padded), the
    decoder's self-attention and cross-attention with EncoderDecoderCache(DynamicCache, DynamicCache) and generate's
    static cache."""
    torch.manual_seed(0)
    model = {"bart": _bart, "t5": _t5}[name]().eval()
    ids = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -6:] = 0

    def run():
        out = []
        with torch.no_grad():
            for kw in (cache_kwargs(model, EncoderDecoderCache(DynamicCache(), DynamicCache())),
                       dict(cache_implementation="static")):
                res = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True, **kw)
                out.append(torch.stack(res.logits, 1))
        return torch.stack(out)

    hook.uninstall()
    try:
        model.set_attn_implementation("sdpa")
        ref = run()
    finally:
        hook.install()
    for impl in ("sdpa", "kivi"):
        model.set_attn_implementation(impl)
        torch.testing.assert_close(run(), ref, rtol=1e-4, atol=1e-4)


def _privacy_filter():
    from transformers.models.openai_privacy_filter import OpenAIPrivacyFilterConfig

    cfg = OpenAIPrivacyFilterConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                                    num_experts_per_tok=1, sliding_window=24, num_labels=3, pad_token_id=0,
                                    eos_token_id=1, bos_token_id=2)
    model = T.OpenAIPrivacyFilterForTokenClassification(cfg).eval()
    for module in model.modules():
        if hasattr(module, "sinks"):
            torch.nn.init.normal_(module.sinks, std=2.0)
    return model


@pytest.mark.parametrize("length, padded", [(16, False), (16, True), (40, False)])
def test_bidirectional_model_with_sinks(length, padded):
    """OpenAI's privacy filter: a bidirectional encoder (is_causal=False) with GPT-OSS's learned sinks. Shorter than
    its window and unpadded, it gets no mask: under "kivi" that is full attention, as its eager attention computes
    (sdpa_with_sinks must not take a missing mask for causal: that puts the logits 92% off)."""
    torch.manual_seed(0)
    model = _privacy_filter()
    ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, -5:] = 0
    out = {}
    for impl in ("eager", "kivi"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model(ids, attention_mask=mask).logits * mask[..., None]
    torch.testing.assert_close(out["kivi"], out["eager"], rtol=1e-4, atol=1e-4)


def test_sdpa_with_sinks_reads_is_causal():
    """sdpa_with_sinks without a mask: causal unless the call or the module says is_causal=False (transformers'
    sdpa's rule), against GPT-OSS's eager attention with the matching mask (none for bidirectional)."""
    from transformers.models.gpt_oss import modeling_gpt_oss as G

    from kivi_cache.hook import sdpa_with_sinks

    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    module.sinks = torch.nn.Parameter(torch.randn(4) * 3)
    q, k, v = torch.randn(2, 4, 9, 32), torch.randn(2, 2, 9, 32), torch.randn(2, 2, 9, 32)
    causal = torch.where(torch.ones(9, 9, dtype=torch.bool).tril(), 0.0, torch.finfo(torch.float32).min)
    for module_causal, arg, want_causal in ((True, None, True), (False, None, False), (True, False, False),
                                            (False, True, True)):
        module.is_causal = module_causal
        want, _ = G.eager_attention_forward(module, q, k, v, causal[None, None] if want_causal else None,
                                            scaling=32 ** -0.5)
        kw = {} if arg is None else {"is_causal": arg}
        got, _ = sdpa_with_sinks(module, q, k, v, None, scaling=32 ** -0.5, s_aux=module.sinks, **kw)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

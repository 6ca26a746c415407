"""Model families other than Llama: attention the hook must not serve from the pages (sliding windows given as an
attention argument, chunked attention) falls back to the materialized history and stays exact. Tiny random models,
no download."""

import pytest
import torch
import transformers as T
from transformers import DynamicCache

from kivi_cache import QuantizedPagedCache, cache_kwargs

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


def _generate(model, ids, mask, cache, n=8):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
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

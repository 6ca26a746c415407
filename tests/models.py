"""Tiny random models for the cache tests (no download)."""

import contextlib
from unittest import mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def tiny_llama(attn="sdpa", layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


def tiny_llama_d64(seed=0):
    """Grouped-query attention (2 query heads per KV head) with head_dim 64, which the Triton kernels accept."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(attn="sdpa", layers=2, seed=0):
    """Grouped-query attention: 8 query heads share 2 KV heads."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation=attn)
    return Qwen2ForCausalLM(cfg).eval()


# small groups and residual so a few dozen tokens already exercise pages and flushes
SMALL = dict(group_size=16, residual_length=16, page_size=32)


def decisive_prompt(model, length, new_tokens=32, margin=0.02, batch=1, tries=40, seed=0):
    """A random prompt whose greedy continuation (full-precision DynamicCache) never has a near-tie:
    at every step the top logit beats the runner-up by at least ``margin``. Chosen from the reference
    alone, so a cache that changes the tokens still fails."""
    from transformers import DynamicCache

    from kivi_cache import cache_kwargs

    gen = torch.Generator().manual_seed(seed)
    for _ in range(tries):
        ids = torch.randint(1, model.config.vocab_size, (batch, length), generator=gen)
        with torch.no_grad():
            out = model.generate(ids, **cache_kwargs(model, DynamicCache()), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        top2 = torch.stack(out.logits).topk(2, dim=-1).values
        if (top2[..., 0] - top2[..., 1]).min() > margin:
            return ids
    raise RuntimeError("no decisive prompt found")


def unbind_static(model) -> None:
    """Remove a StaticQuantizedPagedCache's binding (``_kivi_static``) from the attention modules of a model that
    later tests share (the SmolLM2 fixture, conftest.py)."""
    for module in model.modules():
        module.__dict__.pop("_kivi_static", None)


def steps_with_reorder(model, x, cache, prompt: int, reorder_at: int, rows):
    """Logits ``[B, steps, vocab]`` (float) of one-token steps over ``x`` ``[B, T]`` after a ``prompt``-token prefill,
    with ``cache.reorder_cache(rows)`` before step ``reorder_at``, after which row ``i`` continues on the tokens of
    ``x[rows[i]]``."""
    from kivi_cache import cache_kwargs

    out = []
    with torch.no_grad():
        model(x[:, :prompt], **cache_kwargs(model, cache))
        for t in range(prompt, x.shape[1]):
            if t == reorder_at:
                cache.reorder_cache(rows)
            ids = x[:, t:t + 1] if t < reorder_at else x[rows, t:t + 1]
            out.append(model(ids, **cache_kwargs(model, cache)).logits)
    return torch.cat(out, 1).float()


@contextlib.contextmanager
def window_written_by_copies(active: bool = True):
    """Meanwhile (if ``active``) every step's window write is two torch copies, never left to the decode op: the
    reference point of the fused write (``QuantizedPagedLayer.commit`` called with ``defer_write=False``)."""
    from kivi_cache.layer import QuantizedPagedLayer

    if not active:
        yield
        return
    real = QuantizedPagedLayer.commit

    def commit(self, step, valid=None, defer_write=False):
        return real(self, step, valid, defer_write=False)

    with mock.patch.object(QuantizedPagedLayer, "commit", commit):
        yield

"""Store a prompt in a cache with plain (uncompiled) forwards before ``generate``.

``generate`` compiles the forward of every prompt chunk when the cache is compileable
(:class:`~kivi_cache.StaticQuantizedPagedCache`; transformers' ``_prefill``). The chunks break their
graphs into our eager prompt path, and under CUDA graphs each piece keeps its own memory pool: at hundreds of
long sequences that is gigabytes, enough to run out of a memory budget that the eager cache fits. :func:`prefill`
stores all but the last prompt token eagerly, in chunks; ``generate`` then runs the last token and compiles only the
decode step::

    cache = StaticQuantizedPagedCache(model, max_cache_len=prompt_len + new_tokens)
    prefill(model, cache, ids, attention_mask=mask, chunk_size=512)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens)
"""

from __future__ import annotations

import inspect

import torch

from .compat import cache_kwargs


def prefill(model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            chunk_size: int | None = None) -> None:
    """Run ``input_ids[:, :-1]`` through ``model`` into ``cache`` (eager, no grad), ``chunk_size`` tokens per
    sequence and forward (all at once if None), with the position ids ``generate`` gives a left-padded batch.
    The cache must be empty; afterwards pass the whole ``input_ids`` (and mask) to ``generate`` with it."""
    if input_ids.ndim != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [batch, tokens] with at least 2 tokens, got {tuple(input_ids.shape)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    if cache.get_seq_length() != 0:
        raise ValueError("prefill needs an empty cache")
    n = input_ids.shape[1] - 1
    step = chunk_size or n
    if attention_mask is not None:  # as generate: positions count real tokens only, pads at 0
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    else:
        positions = torch.arange(n + 1, device=input_ids.device).expand(input_ids.shape[0], -1)
    trim = "logits_to_keep" in inspect.signature(model.forward).parameters  # no [batch, chunk, vocab] logits
    with torch.no_grad():
        for start in range(0, n, step):
            end = min(start + step, n)
            kw = dict(input_ids=input_ids[:, start:end], position_ids=positions[:, start:end], use_cache=True,
                      **cache_kwargs(model, cache))
            if attention_mask is not None:
                kw["attention_mask"] = attention_mask[:, :end]
            if trim:
                kw["logits_to_keep"] = 1
            model(**kw)

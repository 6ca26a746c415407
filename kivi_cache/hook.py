"""The attention hook: how a model's attention reads the quantized pages.

On import, kivi_cache wraps transformers' ``"sdpa"`` attention function and
registers a named implementation ``"kivi"`` (with the sdpa mask function).
The wrapper is a pass-through unless the keys it receives came from a
``QuantizedPagedCache`` (a :class:`~kivi_cache.handles.KVHandle`); then it
computes attention from the pages and the residual window. A sliding window,
whether the module holds it (Gemma, Qwen2) or passes it to the attention
function (Mistral, Phi3, Starcoder2), is served too: the layer keeps no
attention-sink tokens then and the kernels read only the pages the window
covers. Learned attention sinks (GPT-OSS passes ``s_aux``: one logit per query
head that joins every softmax and weighs no value) are served by the kernels'
merge; where plain sdpa would run (the prompt, the fallback, a model given
another cache) the sinks become one more key on extra channels
(:func:`sdpa_with_sinks`), since sdpa itself has no such argument and would
drop them. Cases it does not serve (soft-capping,
dropout, attention weights, a query that requires grad (the paged ops compute
no gradients), a layer whose ``config.layer_types`` entry is
neither full nor sliding attention such as Llama 4's chunked attention, a
floating mask that carries an additive bias such as ALiBi, a sliding window on
a layer already holding sink tokens once the sequence reaches the window) get
the materialized full-precision history and the original function: slower,
never wrong.
Any other implementation (``eager``, flash) materializes through the handle
the same way. In transformers' continuous batching over quantized pages the
cache's ``update`` leaves the forward's step in the kwargs (``kivi_cb``), and the
wrapper hands the layer to it (:mod:`kivi_cache.cb.step`). Attention over a handle is
host bookkeeping that ``torch.compile`` must not trace: it is
``torch.compiler.disable``'d (a compiled forward breaks its graph there and runs
it as plain Python); only a static cache's decode step is traced.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from . import reference, static
from .handles import KVHandle

NAME = "kivi"
_original_sdpa = None
_EMPTY: dict = {}


def _layer_type(module) -> str | None:
    """The model config's ``layer_types`` entry for this attention module (None if there is none). Chunked
    attention (Llama 4) says so only there: the mask carries the pattern, which the paged attention does not read."""
    d = getattr(module, "__dict__", _EMPTY)  # plain attributes (nn.Module.__getattr__ raises for missing ones)
    layer_types = getattr(d.get("config"), "layer_types", None)
    idx = d.get("layer_idx")
    if not layer_types or not isinstance(idx, int) or not 0 <= idx < len(layer_types):
        return None
    return layer_types[idx]


def _pattern(module, kwargs) -> tuple[bool, int | None]:
    """Whether the layer's pattern is one the paged attention computes, and its sliding window (None: none): plain
    causal, or causal within a window held by the module (Gemma, Qwen2) or passed as an argument (Mistral, Mixtral,
    Phi3, Starcoder2), which hides a key from a query once they are ``window`` positions apart (transformers'
    ``sliding_window_overlay``: visible while ``q - k < window``)."""
    layer_type = _layer_type(module)
    if layer_type == "full_attention":
        # the config's pattern builds this layer's mask without a window, whatever the module holds (EXAONE 4 keeps
        # config.sliding_window on its global layers too and passes sliding_window=None for them)
        return True, None
    # the argument, where the model passes one (what flash attention reads), else the module's attribute
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    if layer_type is not None and not (layer_type == "sliding_attention" and window is not None):
        return False, None  # chunked attention and anything else that only the mask describes
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        return False, None  # not a window size we know how to read
    return True, window


def _served(dropout, kwargs) -> bool:
    """Self-attention (the caller checks: causal, queries = the step's new tokens, the pattern) that the paged
    kernels compute."""
    return (
        not dropout
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and not kwargs.get("output_attentions", False)
    )


def _sink_logits(kwargs):
    """Learned attention sinks passed to the attention function (GPT-OSS: ``s_aux``, its module's ``sinks``
    parameter), or None."""
    sinks = kwargs.get("s_aux")
    return kwargs.get("sinks") if sinks is None else sinks


def sdpa_with_sinks(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """sdpa with learned attention sinks (``s_aux`` or ``sinks``: ``[Hq]``, one logit per query head in every
    softmax, weighing no value), as GPT-OSS's eager attention computes them, without a score matrix: the sink is one
    more key, first in line, on extra channels that only it and the queries fill
    (:func:`kivi_cache.reference.sink_channels`: its logit is the sink to fp32 accuracy; every other key's logit is
    unchanged) with a zero value. Without a mask, causal as transformers' sdpa (``is_causal``: aligned top-left;
    not for a module or call marked ``is_causal=False``, a bidirectional encoder: then every key is seen):
    for a square prompt one more query, first in line and discarded, keeps the causal shape square, so no mask is
    built; a mask gets a column for the sink. Returns
    ``([B, L, Hq, D], None)`` like transformers' attention functions."""
    sinks = _sink_logits(kwargs)
    bsz, hq, lq, d = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    if scaling is None:
        scaling = d ** -0.5
    e = d + reference.SINK_CHANNELS
    q_sink = reference.sink_channels(sinks.to(query.device), scaling, query.dtype)
    # causal as transformers' sdpa decides it: the is_causal argument, else the module's flag (a bidirectional
    # encoder with sinks, such as OpenAI's privacy filter, sets is_causal=False and gets no mask when nothing is padded)
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = attention_mask is None and lq > 1 and bool(is_causal)
    if causal and lq != lk:  # no mask means sdpa's is_causal (transformers' sdpa): aligned top-left, query i sees
        # keys 0..i (a prompt in a static buffer longer than it); transformers gives a mask wherever that is wrong
        rows = torch.arange(lq, device=query.device)[:, None]
        attention_mask = (torch.arange(lk, device=query.device)[None, :] <= rows)[None, None]
        causal = False
    extra = int(causal)  # the discarded first query
    q2 = query.new_zeros(bsz, hq, lq + extra, e)
    q2[:, :, extra:, :d] = query
    q2[:, :, :, d:] = q_sink[None, :, None]
    k2 = key.new_zeros(bsz, hkv, lk + 1, e)
    k2[:, :, 1:, :d] = key
    k2[:, :, 0, d:d + 2] = 1
    v2 = value.new_zeros(bsz, hkv, lk + 1, e)
    v2[:, :, 1:, :d] = value
    if hq != hkv:
        k2 = k2.repeat_interleave(hq // hkv, dim=1)
        v2 = v2.repeat_interleave(hq // hkv, dim=1)
    mask = None
    if attention_mask is not None:
        m = attention_mask[..., -lq:, :lk] if attention_mask.shape[-1] >= lk else attention_mask[..., -lq:, :]
        if m.dtype == torch.bool:
            first = torch.ones(*m.shape[:-1], 1, dtype=torch.bool, device=m.device)
        else:
            first = torch.zeros(*m.shape[:-1], 1, dtype=m.dtype, device=m.device)
        mask = torch.cat([first, m], dim=-1)
    out = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, dropout_p=dropout,
                                                           is_causal=causal, scale=float(scaling))
    return out[:, :, extra:, :d].transpose(1, 2).contiguous(), None


def kivi_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           **kwargs):
    """An attention function for transformers' ``AttentionInterface`` (same signature as sdpa's)."""
    cb_step = kwargs.get("kivi_cb")  # a forward of transformers' continuous batching over quantized pages
    if cb_step is not None:
        return _attend_cb(cb_step, module, query, key, value, scaling), None
    sinks = _sink_logits(kwargs)
    # a StaticQuantizedPagedCache bound to this model (an instance attribute it sets; a missing attribute through
    # nn.Module.__getattr__ would raise and catch an exception per layer and step)
    if getattr(module, "__dict__", _EMPTY).get("_kivi_static") is not None:
        layer = static.bound_layer(module, key)
        if layer is not None:
            window = _pattern(module, kwargs)[1]
            if window != layer.sliding_window:  # (the prompt's attention sets it: a constant when compiled)
                raise ValueError(f"StaticQuantizedPagedCache: layer {module.layer_idx}'s sliding window is {window} "
                                 f"but its prompt was stored for {layer.sliding_window}")
            if scaling is None:
                scaling = query.shape[-1] ** -0.5
            if torch.compiler.is_compiling():
                return layer.attend_static(query, scaling, sinks), None
            try:  # the step's token is stored: a failure leaves the later layers without it
                return layer.attend_static(query, scaling, sinks), None
            except BaseException as exc:
                layer.mark_unusable("attention", exc)
                raise
    if not isinstance(key, KVHandle):
        fn = _original_sdpa if sinks is None else sdpa_with_sinks
        return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return _attend_handle(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


@torch.compiler.disable
def _attend_cb(step, module, query, key, value, scaling):
    """A layer of a continuous-batching forward (:class:`kivi_cache.cb.step.Step`)."""
    return step.attend(module.layer_idx, query, key, value, query.shape[-1] ** -0.5 if scaling is None else scaling)


@torch.compiler.disable
def _attend_handle(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """Attention over a lazy handle: host bookkeeping (lists, commits, page allocation) that torch.compile must
    not trace (generate compiles a chunked prompt's forward too); a compiled forward runs it as plain Python. An
    exception here ends the forward with this layer's step stored or pending and the later layers' not: the cache
    is marked unusable (CacheUnusableError until reset())."""
    try:
        return _attend_step(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    except BaseException as exc:
        key.step.layer.mark_unusable("attention", exc)
        raise


def _attend_step(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    step = key.step
    sinks = _sink_logits(kwargs)
    sdpa = _original_sdpa if sinks is None else sdpa_with_sinks
    # causal self-attention: the queries are the step's new tokens. Cross-attention (new keys: the encoder's states)
    # is not, also where a module does not mark it with is_causal=False
    self_attention = step.key.shape[2] == query.shape[2] and getattr(module, "is_causal", True)
    served, window = _pattern(module, kwargs) if self_attention else (False, None)
    if served and window is not None and not step.layer.use_sliding_window(window):
        # a layer that already holds sink tokens (the window was not known before it stored them): a shorter
        # timeline than the window is unaffected by it and read from the pages; a longer one takes the fallback
        served, window = key.shape[-2] < window, None
    # a query that requires grad (a forward with autograd on) gets sdpa over the materialized history: the paged
    # ops compute no gradients
    if not served or not _served(dropout, kwargs) or query.requires_grad or step.layer.masks.adds_bias(attention_mask):
        # in self-attention the mask says which new tokens are pads: not stored, as on the served path.
        # Cross-attention stores every encoder token: its mask's padding (often on the right) must keep the
        # positions the mask was built for
        valid = step.layer.masks.valid_tokens(attention_mask, query.shape[2], step.layer.batch_size) if (
            self_attention) else None
        return sdpa(module, query, key.materialize(valid), value.materialize(valid), attention_mask,
                    dropout=dropout, scaling=scaling, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = step.layer.attend(step, query, attention_mask, scaling, sdpa, module, window=window, sink_logits=sinks,
                            **kwargs)
    return out, None


def install() -> None:
    """Wrap the global ``sdpa`` attention function and register ``kivi`` (idempotent)."""
    global _original_sdpa
    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if current is not kivi_attention_forward:
        _original_sdpa = current
        AttentionInterface.register("sdpa", kivi_attention_forward)
    AttentionInterface.register(NAME, kivi_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def uninstall() -> None:
    """Restore transformers' own ``sdpa`` function (the ``kivi`` name stays registered)."""
    if _original_sdpa is not None and ALL_ATTENTION_FUNCTIONS["sdpa"] is kivi_attention_forward:
        AttentionInterface.register("sdpa", _original_sdpa)

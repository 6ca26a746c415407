"""``QuantizedPagedCache``: the transformers ``Cache`` subclass, and its presets."""

from __future__ import annotations

import dataclasses
import functools

import torch
from transformers.cache_utils import Cache
from transformers.configuration_utils import PretrainedConfig

from . import checks
from .batch import repeat_index
from .config import PRESETS, QuantConfig, _check_int
from .layer import QuantizedPagedLayer, SharedState
from .memory import MemoryReport
from .pool import Budget


def _layer_windows(config) -> list:
    """Each layer's sliding window by the model config (None: full attention): for sizing pools only (the window a
    layer is served with comes from its attention module, through the hook). ``config``: a PretrainedConfig
    (checked by _check_model_config first)."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        window = None
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    n = getattr(text, "num_hidden_layers", 0) or 0
    return [window if getattr(text, "use_sliding_window", True) else None] * n


def _check_model_config(config) -> None:
    """Refuse model configurations whose attention the cache would get wrong: layer types other than full and
    sliding-window attention."""
    if not isinstance(config, PretrainedConfig):
        raise ValueError(f"config must be the model's configuration (a transformers PretrainedConfig, e.g. "
                         f"model.config) or None, got {type(config).__name__}")
    text = config.get_text_config()
    allowed = ("full_attention", "sliding_attention")
    unsupported = sorted({t for t in getattr(text, "layer_types", None) or [] if t not in allowed})
    if unsupported:
        raise ValueError(
            f"QuantizedPagedCache supports models whose layers are 'full_attention' or 'sliding_attention'; this "
            f"config has layer_types {unsupported}. Use transformers' DynamicCache for this model.")


def _check_layer_bits(layer_bits, base: QuantConfig) -> list:
    """``layer_bits`` as a list of ``(key_bits, value_bits)``, one per layer, each checked as a QuantConfig (``[]``
    for None)."""
    if layer_bits is None:
        return []
    if isinstance(layer_bits, (str, bytes)) or not hasattr(layer_bits, "__len__") or not len(layer_bits):
        raise ValueError(f"layer_bits must be a non-empty list of (key_bits, value_bits) pairs, one per layer, or "
                         f"None; got {layer_bits!r}")
    out = []
    for i, pair in enumerate(layer_bits):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"layer_bits[{i}] must be a (key_bits, value_bits) pair, got {pair!r}")
        try:
            dataclasses.replace(base, key_bits=pair[0], value_bits=pair[1])
        except ValueError as exc:
            raise ValueError(f"layer_bits[{i}]: {exc}") from None
        out.append((pair[0], pair[1]))
    return out


class QuantizedPagedCache(Cache):
    """A 2/4/8-bit quantized, paged KV cache (KIVI: keys per channel, values per token).

    Use it wherever transformers takes a cache::

        out = model.generate(ids, cache=QuantizedPagedCache(key_bits=2, value_bits=4))

    (``cache=`` on transformers >= 5.24, ``past_key_values=`` before; :func:`kivi_cache.cache_kwargs` picks the
    name.) A cache holds one batch of conversations: :meth:`reset` it, or make a new one, for another batch.

    Args:
        key_bits, value_bits: 2, 4 or 8.
        group_size: tokens per key group (per channel) and channels per value group (per token).
        residual_length: newest tokens kept in full precision.
        page_size: tokens per page (a multiple of group_size).
        num_pages: pages to preallocate per layer (0: grow on demand: the first time by exactly what the step
            needs, usually the prompt's pages, later by at least 1/8 of the pool). A cache that needs more still
            grows, and warns once.
        sink_length: first tokens of each sequence kept in full precision (attention sinks).
        rotate: ``"keys"``, ``"values"``, ``"both"`` (``True``) or ``"none"``: store them rotated by a Hadamard
            matrix (outlier channels spread before quantization; attention unchanged: :mod:`kivi_cache.rotation`).
        clip: ``"keys"``, ``"values"``, ``"both"`` (``True``) or ``"none"``: quantize each group with the narrowed
            range that reconstructs it best (:mod:`kivi_cache.quant`); costs only when groups are written.
        layer_bits: ``[(key_bits, value_bits), ...]``, one pair per model layer: each layer's own code widths (the
            other settings are shared; ``key_bits``/``value_bits`` are then unused). A model with more layers than pairs
            is refused at its first step.
        config: optional model config, checked up front for attention the cache does not support (layer types
            other than full and sliding-window attention, e.g. chunked attention or state-space layers); with
            ``max_batch_size``/``max_cache_len`` it also sizes the pools of sliding-window layers, which hold
            only the pages their window reaches (``QuantConfig.sliding_pages_per_sequence``).
        max_batch_size, max_cache_len: give both to preallocate exactly the pages ``max_batch_size``
            sequences of up to ``max_cache_len`` tokens (prompt + new) need (instead of ``num_pages``):
            what to do under a memory limit, as for transformers' ``StaticCache``. Longer or more
            sequences still work; the pool then grows, and the cache warns once.
    """

    def __init__(self, key_bits: int = 4, value_bits: int = 4, group_size: int = 32, residual_length: int = 128,
                 page_size: int = 64, num_pages: int = 0, sink_length: int = 0, config=None,
                 max_batch_size: int | None = None, max_cache_len: int | None = None, rotate: str | bool = "none",
                 layer_bits=None, clip: str | bool = "none"):
        if (max_batch_size is None) != (max_cache_len is None):
            raise ValueError("give max_batch_size and max_cache_len together (both or neither), got "
                             f"max_batch_size={max_batch_size!r}, max_cache_len={max_cache_len!r}")
        quant_config = QuantConfig(key_bits=key_bits, value_bits=value_bits, group_size=group_size,
                                   residual_length=residual_length, page_size=page_size, num_pages=num_pages,
                                   sink_length=sink_length, rotate=rotate, clip=clip)
        if max_batch_size is not None:
            if num_pages:
                raise ValueError(f"give either num_pages ({num_pages}) or max_batch_size/max_cache_len, not both")
            _check_int("max_batch_size", max_batch_size, 1)
            _check_int("max_cache_len", max_cache_len, 1)
            pages = max_batch_size * quant_config.pages_per_sequence(max_cache_len)
            quant_config = dataclasses.replace(quant_config, num_pages=pages)
        self.quant_config = quant_config
        self._layer_bits = _check_layer_bits(layer_bits, quant_config)  # per layer (key_bits, value_bits), or []
        self._layer_configs: list = []  # per layer, where it differs from quant_config (sliding layers' pools)
        self._record_past = False  # activate_past_recording was called (layers made later record too)
        # one per cache: its layers read each forward's mask once, fail together, warn once past the size budget
        budget = (f"max_batch_size={max_batch_size}, max_cache_len={max_cache_len}" if max_batch_size is not None
                  else f"num_pages={num_pages}" if num_pages else None)
        self._shared = SharedState(None if budget is None else Budget(budget))
        if config is not None:
            _check_model_config(config)
            layers = getattr(config.get_text_config(), "num_hidden_layers", None)
            if self._layer_bits and isinstance(layers, int) and len(self._layer_bits) != layers:
                raise ValueError(f"layer_bits gives {len(self._layer_bits)} layers' bits for a model of {layers} "
                                 f"layers: give one (key_bits, value_bits) per layer")
            if max_batch_size is not None:
                self._layer_configs = [
                    None if w is None else dataclasses.replace(
                        quant_config, num_pages=max_batch_size * quant_config.sliding_pages_per_sequence(
                            w, max_cache_len) + 1)  # + the zero page of released entries
                    for w in _layer_windows(config)]
        super().__init__(layers=[])

    def __repr__(self):
        c = self.quant_config
        return (f"{type(self).__name__}(key_bits={c.key_bits}, value_bits={c.value_bits}, group_size={c.group_size}, "
                f"residual_length={c.residual_length}, page_size={c.page_size}, sink_length={c.sink_length}, "
                f"layers={len(self.layers)})")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if type(layer_idx) is not int or layer_idx < 0:
            raise ValueError(f"layer_idx must be an int >= 0 (the model layer's index), got {layer_idx!r}")
        if layer_idx == 0 and len(self.layers) > 1:
            self._check_lengths()
        if layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized:
            checks.check_states(key_states, value_states)  # before any state changes
            self.quant_config.check_head_dim(key_states.shape[-1])
        if self._layer_bits and layer_idx >= len(self._layer_bits):
            exc = ValueError(f"layer_bits gives {len(self._layer_bits)} layers' bits, but the model has a layer "
                             f"{layer_idx}: give one (key_bits, value_bits) per layer (or config=model.config, "
                             f"which checks the count up front)")
            if layer_idx:  # the earlier layers stored this forward's tokens
                self._mark_unusable("a forward", exc)
            raise exc
        while len(self.layers) <= layer_idx:
            i = len(self.layers)
            self.layers.append(QuantizedPagedLayer(self.layer_config(i), self._shared))
            if self._record_past:
                self.layers[-1].activate_past_recording()
        return self._update_layer(layer_idx, key_states, value_states)

    def layer_config(self, i: int) -> QuantConfig:
        """Layer ``i``'s settings: ``quant_config`` with the layer's own bits (``layer_bits``) and pool size (a
        sliding-window layer's, with ``config`` and ``max_batch_size``)."""
        own = self._layer_configs[i] if i < len(self._layer_configs) else None
        cfg = own or self.quant_config
        if i < len(self._layer_bits):
            kb, vb = self._layer_bits[i]
            cfg = dataclasses.replace(cfg, key_bits=kb, value_bits=vb)
        return cfg

    def _check_lengths(self) -> None:
        """At a forward's first layer: every layer holds the same number of tokens, else the last forward stopped part
        way (an exception in the model after some layers stored its tokens): the cache is unusable."""
        seen = [layer.host_length() for layer in self.layers if layer.is_initialized]
        if seen and seen.count(seen[0]) != len(seen):
            self._mark_unusable("a forward", RuntimeError(f"its layers stored different lengths {seen}"))
            self._check_usable()

    def _update_layer(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        layer = self.layers[layer_idx]
        try:
            return layer.update(key_states, value_states)
        except BaseException as exc:
            # refused after earlier layers stored this forward's tokens: the layers now disagree on the length
            if any(other.host_length() != layer.host_length() for other in self.layers if other.is_initialized):
                self._mark_unusable(f"update of layer {layer_idx}", exc)
            raise

    # Cache-wide operations: every layer checks the arguments before any layer changes (transformers' Cache runs
    # them layer by layer, so a refusal by a later layer would leave the earlier ones changed).
    def _check_usable(self) -> None:
        for layer in self.layers:
            layer.check_usable()

    def _mark_unusable(self, what: str, exc: BaseException) -> None:
        for layer in self.layers:
            layer.mark_unusable(what, exc)

    def _change_all(self, what: str, changes) -> None:
        """Run ``changes`` (one no-argument callable per layer, None: nothing to do) after every layer's checks
        passed; a failure part way marks the whole cache unusable (its layers may now disagree)."""
        try:
            for change in changes:
                if change is not None:
                    change()
        except BaseException as exc:
            self._mark_unusable(what, exc)
            raise

    def _prepare(self) -> list:
        """The initialized layers, usable and with their pending steps stored (those count in every length)."""
        self._check_usable()
        layers = [layer for layer in self.layers if layer.is_initialized]
        self._change_all("storing a step", [layer._flush_pending for layer in layers])
        return layers

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens of every layer (``crop(-n)``: n tokens; see :meth:`QuantizedPagedLayer.crop`);
        nothing changes if any layer refuses."""
        layers = self._prepare()
        removes = [layer.check_crop(tokens_to_remove) for layer in layers]
        self._change_all("crop", [functools.partial(layer._crop, r) if r else None
                                  for layer, r in zip(layers, removes, strict=True)])

    def _select(self, index, name: str) -> None:
        layers = self._prepare()
        picks = [layer.check_index(index, name) for layer in layers]
        self._change_all("selecting sequences", [functools.partial(layer._select, pick)
                                                 for layer, pick in zip(layers, picks, strict=True)])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx, "beam_idx")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices, "indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        layers = self._prepare()
        picks = [layer.check_index(repeat_index(layer.batch_size, repeats), "repeats") for layer in layers]
        self._change_all("repeating sequences", [functools.partial(layer._select, pick)
                                                 for layer, pick in zip(layers, picks, strict=True)])

    def activate_past_recording(self, **kwargs) -> None:
        """transformers calls it before assisted decoding, which crops rejected candidates after each step: the
        sliding-window layers then store every token of a step (also those no later query sees), so that crop can
        take any of them back. Layers made later (this cache fills them lazily) record too. Keyword arguments (5.25
        passes ``recurrent_states_to_keep``, for state-space layers, which this cache has none of) are ignored."""
        self._record_past = True
        for layer in self.layers:
            layer.activate_past_recording()

    def __iter__(self):
        """``(keys, values, None)`` per layer, in full precision, as iterating a ``DynamicCache`` gives (the third
        item: its sliding-window length, None for full attention). Dequantizes every layer: for inspection."""
        for layer in self.layers:
            yield layer.keys, layer.values, None

    # Cache's state-layer API (convolution, Mamba, linear attention, sparse-attention indexers): not stored here
    def _unsupported_state(self, method: str):
        raise ValueError(
            f"{type(self).__name__} stores attention keys and values only; this model called Cache.{method}: it has "
            f"linear-attention, convolution or state-space layers (or an attention indexer), which kivi_cache does "
            f"not support. Use transformers' DynamicCache(config=model.config) for this model.")

    def has_previous_state(self, *args, **kwargs):
        self._unsupported_state("has_previous_state")

    def get_conv_state(self, *args, **kwargs):
        self._unsupported_state("get_conv_state")

    def update_conv_state(self, *args, **kwargs):
        self._unsupported_state("update_conv_state")

    def get_recurrent_state(self, *args, **kwargs):
        self._unsupported_state("get_recurrent_state")

    def update_recurrent_state(self, *args, **kwargs):
        self._unsupported_state("update_recurrent_state")

    def update_indexer(self, *args, **kwargs):
        self._unsupported_state("update_indexer")

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        sizes = {layer.batch_size for layer in self.layers if layer.is_initialized}
        return sizes.pop() if len(sizes) == 1 else -1

    def reset(self) -> None:
        """Empty the cache for another batch of conversations (any batch size, any model): every layer drops its
        tokens, and a cache marked unusable (:class:`~kivi_cache.CacheUnusableError`) is usable again. The pools
        keep their pages, which the next batch reuses."""
        super().reset()

    def memory_report(self) -> MemoryReport:
        """Bytes this cache holds (live) and allocated, by kind, each against a transformers ``DynamicCache`` of the
        same tokens in the model's dtype (:class:`~kivi_cache.MemoryReport`; ``print`` it for a summary)."""
        return MemoryReport.from_layers(self.layers)


INT4_PRESET = PRESETS["int4"]


class Int4PagedCache(QuantizedPagedCache):
    """4-bit keys and values, group 32, residual 128 (KIVI's setting) plus 4 attention-sink tokens in full
    precision (quality: docs and eval/perplexity.py)."""

    def __init__(self, **overrides):
        kw = dict(INT4_PRESET, **overrides)
        super().__init__(**kw)


class Int2PagedCache(QuantizedPagedCache):
    """The 2-bit memory class: 0.44 bytes per cached element (fp16: 2), spent as 4-bit keys and 2-bit
    values in groups of 64, residual 128, and 4 attention-sink tokens in full precision; key groups are
    clipped (``clip="keys"``: each group's best narrowed range, :mod:`kivi_cache.quant`).

    Keys keep 4 bits because retrieval (the needle test) needs their precision far more than the values'
    (perplexity and needle per setting: eval/perplexity.py, eval/needle.py, docs/quality.md). For the smallest
    cache use ``QuantizedPagedCache(key_bits=2, value_bits=2, sink_length=4, clip="keys")`` (0.375 bytes per
    element)."""

    def __init__(self, **overrides):
        super().__init__(**dict(PRESETS["int2"], **overrides))


class Int8PagedCache(QuantizedPagedCache):
    """8-bit keys and values: a reference point, practically lossless."""

    def __init__(self, **overrides):
        super().__init__(**dict(PRESETS["int8"], **overrides))

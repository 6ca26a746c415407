"""Cache configuration and its validation.

Every check raises ``ValueError`` naming the parameter and the allowed values,
and runs in ``QuantConfig.__post_init__``, before any cache state exists.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from .kernels.checks import ALLOWED_BITS  # the code widths the ops accept (one definition, with their checks)
from .rotation import ROTATE
from .rotation import check_head_dim as _check_rotation
from .window import window_append


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class QuantConfig:
    """How a :class:`~kivi_cache.QuantizedPagedCache` stores keys and values.

    key_bits, value_bits: code width, one of 2, 4, 8.
    group_size: keys are quantized per channel over groups of ``group_size``
        consecutive tokens; values per token over groups of ``group_size``
        channels (so head_dim must be divisible by it).
    residual_length: the newest tokens kept in full precision (R). Once a
        sequence is longer than R, between R and R + group_size - 1 tokens sit
        in the residual window; older tokens are flushed in whole key groups.
    page_size: tokens per page; a multiple of group_size.
    num_pages: pages to preallocate per layer (0 = grow on demand).
    sink_length: the first tokens of every sequence kept in full precision for
        good (attention sinks); they live at the front of the residual window.
    rotate: ``"none"``, ``"keys"``, ``"values"`` or ``"both"`` (``True``: both): store keys and/or values
        multiplied by a Hadamard matrix, which spreads outlier channels before quantization; attention is unchanged
        (:mod:`kivi_cache.rotation`).
    clip: ``"none"``, ``"keys"``, ``"values"`` or ``"both"`` (``True``: both): quantize each key and/or value group
        with the range, among 8 narrowings of its min/max range, that reconstructs it best (:mod:`kivi_cache.quant`).
        Costs only when groups are written.
    """

    key_bits: int = 4
    value_bits: int = 4
    group_size: int = 32
    residual_length: int = 128
    page_size: int = 64
    num_pages: int = 0
    sink_length: int = 0
    rotate: str = "none"
    clip: str = "none"

    def __post_init__(self) -> None:
        for name in ("rotate", "clip"):
            value = getattr(self, name)
            if value is True or value is False:
                object.__setattr__(self, name, "both" if value else "none")
            elif value not in ROTATE:
                raise ValueError(f"{name} must be one of {ROTATE} or a bool, got {value!r}")
        for name in ("key_bits", "value_bits"):
            value = getattr(self, name)
            if type(value) is not int or value not in ALLOWED_BITS:
                raise ValueError(f"{name} must be one of {ALLOWED_BITS}, got {value!r}")
        _check_int("group_size", self.group_size, 1)
        _check_int("residual_length", self.residual_length, 0)
        _check_int("page_size", self.page_size, 1)
        _check_int("num_pages", self.num_pages, 0)
        _check_int("sink_length", self.sink_length, 0)
        if self.page_size % self.group_size:
            raise ValueError(
                f"page_size must be a multiple of group_size ({self.group_size}), "
                f"got page_size={self.page_size}"
            )
        if self.group_size * self.value_bits < 32:  # value codes are stored in 32-bit words of tokens
            raise ValueError(
                f"group_size must be at least {32 // self.value_bits} with value_bits={self.value_bits} "
                f"(a group of values fills whole 32-bit words of tokens), got group_size={self.group_size}"
            )
        if self.group_size * self.value_bits % 32:
            raise ValueError(
                f"group_size must be a multiple of {32 // self.value_bits} with value_bits={self.value_bits} "
                f"(a group of values fills whole 32-bit words of tokens), got group_size={self.group_size}"
            )

    @property
    def clip_args(self) -> dict:
        """The ``clip_keys``/``clip_values`` keywords of the ops that write groups (``quantize_and_write``,
        ``append_and_flush``)."""
        return dict(clip_keys=self.clip in ("keys", "both"), clip_values=self.clip in ("values", "both"))

    def check_head_dim(self, head_dim: int) -> None:
        """Raise if this configuration cannot store heads of ``head_dim`` channels."""
        if head_dim % self.group_size:
            raise ValueError(
                f"group_size={self.group_size} must divide the model's head_dim={head_dim} "
                f"(values are grouped per token over channels); choose a group_size that divides {head_dim}"
            )
        if self.rotate != "none":
            _check_rotation(head_dim)
        for name in ("key_bits", "value_bits"):
            per_byte = 8 // getattr(self, name)
            if head_dim % per_byte:
                raise ValueError(
                    f"{name}={getattr(self, name)} packs {per_byte} codes per byte along head_dim, "
                    f"which must then be a multiple of {per_byte}; got head_dim={head_dim}"
                )

    def pages_per_sequence(self, max_len: int) -> int:
        """Pages one sequence of up to ``max_len`` cached tokens needs: the whole key groups beyond the
        sinks and the residual window (at least ``residual_length`` tokens stay there), in whole pages."""
        _check_int("max_len", max_len, 0)
        g = self.group_size
        quantized = max(0, max_len - self.residual_length - self.sink_length) // g * g
        return -(-quantized // self.page_size)

    def sliding_pages_per_sequence(self, window: int, max_len: int) -> int:
        """Pages one sequence of a sliding-window layer holds at most while decoding (no sinks there): the pages its
        window can reach beyond the residual window (at most ``window - residual_length`` stored tokens) and one
        more, partly hidden or partly filled; never more than a full-attention layer's :meth:`pages_per_sequence`.
        A flush takes a fresh page before the step's release
        (:meth:`~kivi_cache.layer.QuantizedPagedLayer._release_hidden_pages`) only when the older pages are full,
        so it needs none beyond these (tests/test_families.py: the peak over windows of every phase, padded batches,
        beam search and assisted decoding reaches this count and never exceeds it). A prompt stored at once or in
        chunks, or assisted decoding's candidates, keep what the chunk's first query sees until the step's release,
        so that crop can take the chunk back: they may need more, and the pool then grows."""
        _check_int("window", window, 1)
        full = replace(self, sink_length=0).pages_per_sequence(max_len)
        return min(full, -(-max(0, window - self.residual_length) // self.page_size) + 1)

    def bytes_per_element(self, dtype: torch.dtype = torch.float16) -> float:
        """Bytes per cached element (one channel of one key or value) of a quantized token, keys and values
        averaged, its share of the scales and zero points (in ``dtype``, the model's) included; to compare with
        ``dtype.itemsize``, what the element takes in full precision."""
        bits = (self.key_bits + self.value_bits) / 2
        return bits / 8 + 2 * _element_size(dtype) / self.group_size

    def live_bytes(self, tokens: int, head_dim: int, dtype: torch.dtype, num_heads: int = 1) -> int:
        """Bytes one sequence of ``tokens`` tokens holds in one full-attention layer of ``num_heads`` KV heads: the
        sinks and the residual window in ``dtype``, the whole key groups beyond them quantized (the rule of
        :func:`kivi_cache.window.window_append`). What :meth:`~kivi_cache.QuantizedPagedCache.memory_report` counts
        as live for such a sequence, per layer."""
        _check_int("tokens", tokens, 0)
        _check_int("num_heads", num_heads, 1)
        self.check_head_dim(head_dim)
        _, flushed = window_append(0, 0, tokens, sink_length=self.sink_length, residual_length=self.residual_length,
                                   group_size=self.group_size)
        elem = _element_size(dtype)
        g = self.group_size
        groups = flushed // g
        quantized = groups * (g * head_dim * (self.key_bits + self.value_bits) // 8 + 4 * head_dim * elem)
        return num_heads * (quantized + 2 * (tokens - flushed) * head_dim * elem)

    def to_dict(self) -> dict:
        return asdict(self)


def _element_size(dtype) -> int:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype (the model's, e.g. torch.float16), got "
                         f"{dtype!r}")
    return dtype.itemsize


#: the presets' settings, by name: the cache classes (``Int8PagedCache``, ``Int4PagedCache``, ``Int2PagedCache``) and
#: continuous batching (``enable_continuous_batching(model, preset=...)``) read them from here. int2 keeps 4-bit keys:
#: retrieval needs their precision far more than the values' (docs/quality.md).
PRESETS = {
    "int8": dict(key_bits=8, value_bits=8, group_size=32, residual_length=128, sink_length=4),
    "int4": dict(key_bits=4, value_bits=4, group_size=32, residual_length=128, sink_length=4),
    "int2": dict(key_bits=4, value_bits=2, group_size=64, residual_length=128, sink_length=4, clip="keys"),
}


def preset_config(name: str, **overrides) -> QuantConfig:
    """The :class:`QuantConfig` of preset ``name`` (one of :data:`PRESETS`), with ``overrides``."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {name!r}")
    return QuantConfig(**dict(PRESETS[name], **overrides))

"""Memory accounting for a quantized paged cache, against the cache the model would otherwise hold."""

from __future__ import annotations

from dataclasses import dataclass, fields
from fractions import Fraction

import torch

from .config import QuantConfig, _check_int, _element_size

_MiB = 1 << 20


@dataclass
class MemoryReport:
    """Bytes by kind, summed over layers, and the same tokens in a transformers ``DynamicCache`` (the baseline).

    ``codes``, ``scales``, ``zeros``: live quantized tokens (pages in use, counted by the tokens they hold; a page
    that beams share counted once); ``residual``: live full-precision tokens (the window), of which ``sinks`` are
    the attention-sink tokens (``sink_tokens`` token-layers); ``live``: their sum. ``allocated``: everything the
    cache allocated (page pools, free pages included, and window buffers); ``pool_slack``: ``allocated - live``.
    ``quantized_tokens``, ``residual_tokens``: token-layers (tokens times layers, over every sequence).

    The baseline is a ``DynamicCache`` of the same tokens in ``baseline_dtype``, the dtype of the cache's window,
    which is the model's: ``baseline_live`` counts the stored tokens (pads excluded), ``baseline_allocated`` the
    bytes of the tensors a ``DynamicCache`` allocates for the batch (every position of every sequence, pads
    included). A sliding-window layer counts as transformers' ``DynamicSlidingWindowLayer`` holds it: the last
    ``window - 1`` positions. ``live_ratio`` and ``allocated_ratio`` compare the two (below 1: this cache is
    smaller); :func:`break_even_tokens` says from which length they drop below 1 for a configuration.
    ``fp16_equivalent`` and ``compression`` compare the live bytes with the stored tokens in float16.
    ``layers``, ``batch_size``, ``seq_length``: initialized layers, sequences, positions per sequence (pads
    included).
    """

    quantized_tokens: int = 0
    residual_tokens: int = 0
    codes: int = 0
    scales: int = 0
    zeros: int = 0
    residual: int = 0
    sink_tokens: int = 0
    sinks: int = 0
    pool_slack: int = 0
    allocated: int = 0
    fp16_equivalent: int = 0
    pages_total: int = 0
    pages_in_use: int = 0
    baseline_dtype: str = ""
    baseline_live: int = 0
    baseline_allocated: int = 0
    layers: int = 0
    batch_size: int = 0
    seq_length: int = 0

    _SUMMED = ("quantized_tokens", "residual_tokens", "codes", "scales", "zeros", "residual", "sink_tokens", "sinks",
               "fp16_equivalent", "pages_total", "pages_in_use", "baseline_live", "baseline_allocated")

    @classmethod
    def from_layers(cls, layers) -> MemoryReport:
        r = cls()
        dtypes = []
        for layer in layers:
            s = layer.memory_stats()
            if not s:
                continue
            for name in cls._SUMMED:
                setattr(r, name, getattr(r, name) + s[name])
            r.allocated += s["pool_allocated"] + s["residual_allocated"]
            if s["batch_size"]:
                r.layers += 1
                r.batch_size = max(r.batch_size, s["batch_size"])
                r.seq_length = max(r.seq_length, s["seq_length"])
                if s["dtype"] not in dtypes:
                    dtypes.append(s["dtype"])
        r.baseline_dtype = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        r.pool_slack = r.allocated - r.live
        return r

    @property
    def live(self) -> int:
        return self.codes + self.scales + self.zeros + self.residual

    @property
    def live_ratio(self) -> float:
        """``live / baseline_live``: below 1, the stored tokens take less memory than in a ``DynamicCache``."""
        return self.live / self.baseline_live if self.baseline_live else float("nan")

    @property
    def allocated_ratio(self) -> float:
        """``allocated / baseline_allocated``: below 1, the cache allocated less than a ``DynamicCache`` would."""
        return self.allocated / self.baseline_allocated if self.baseline_allocated else float("nan")

    @property
    def compression(self) -> float:
        """float16 bytes of the stored tokens over the bytes that hold them (live)."""
        return self.fp16_equivalent / self.live if self.live else float("nan")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(live=self.live, live_ratio=self.live_ratio, allocated_ratio=self.allocated_ratio,
                 compression=self.compression)
        return d

    def __str__(self) -> str:
        def mib(n: int) -> str:
            return f"{n / _MiB:.3f}"

        def ratio(x: float) -> str:
            return "n/a" if x != x else f"{x:.2f}"

        seqs = "sequence" if self.batch_size == 1 else "sequences"
        dtype = self.baseline_dtype or "the model's dtype"
        return "\n".join([
            f"kivi_cache memory: {self.layers} layers, {self.batch_size} {seqs} x {self.seq_length} positions; "
            f"baseline: a DynamicCache of the same tokens in {dtype}",
            f"  live       {mib(self.live)} MiB = {ratio(self.live_ratio)} x the baseline's "
            f"{mib(self.baseline_live)} MiB",
            f"             codes {mib(self.codes)}, scales and zero points {mib(self.scales + self.zeros)}, "
            f"full-precision window {mib(self.residual)} (sinks {mib(self.sinks)}) MiB",
            f"  allocated  {mib(self.allocated)} MiB = {ratio(self.allocated_ratio)} x the baseline's "
            f"{mib(self.baseline_allocated)} MiB",
            f"             pools {self.pages_total} pages ({self.pages_in_use} in use); unused {mib(self.pool_slack)} "
            f"MiB (free pages, unfilled page and window slots)",
        ])


def break_even_tokens(config, head_dim: int, dtype: torch.dtype, ratio: float = 1.0) -> int:
    """The sequence length from which a configuration's cache holds less than ``ratio`` times a ``DynamicCache``.

    ``config``: a :class:`~kivi_cache.QuantConfig` or a cache (its ``quant_config``); ``head_dim``: the model's;
    ``dtype``: the model's (the cache's window and the ``DynamicCache`` hold it). Returns the smallest length ``n``
    such that, at ``n`` tokens and at every longer length, one sequence's live bytes in a full-attention layer
    (:meth:`QuantConfig.live_bytes`) are below ``ratio`` times the same tokens' bytes in a ``DynamicCache``
    (``MemoryReport.live_ratio`` of an unpadded batch). With ``ratio=1``: ``sink_length + residual_length +
    group_size``, where the first group leaves the window; below it both hold the same bytes. ValueError if the
    configuration never gets below ``ratio`` (its long-sequence limit, quantized bytes over ``dtype``'s, is at or
    above it).

    The ratio is not monotonic: it falls when a group leaves the window and rises while the window fills
    again; the length returned is where it stays below.
    """
    cfg = getattr(config, "quant_config", config)
    if not isinstance(cfg, QuantConfig):
        raise ValueError(f"config must be a QuantConfig or a kivi_cache cache, got {type(config).__name__}")
    _check_int("head_dim", head_dim, 1)
    cfg.check_head_dim(head_dim)
    elem = _element_size(dtype)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
    target = Fraction(ratio)
    limit = Fraction(cfg.key_bits + cfg.value_bits, 16 * elem) + Fraction(2, cfg.group_size)
    if target <= limit:
        raise ValueError(f"this configuration never gets below {ratio} x a {dtype} DynamicCache: long sequences "
                         f"approach {float(limit):.4f} x ({cfg.bytes_per_element(dtype)} bytes per element against "
                         f"{elem}); give a larger ratio")
    g, start = cfg.group_size, cfg.sink_length + cfg.residual_length

    def below(k: int) -> bool:  # every length with k groups quantized, up to the last before the next flush
        n = start + (k + 1) * g - 1
        return cfg.live_bytes(n, head_dim, dtype) < target * (2 * n * head_dim * elem)

    # between flushes the ratio rises with the length, and its value before each flush falls with k: the first k
    # whose whole stretch is below stays below; estimate it from the closed form, then settle it exactly
    k = max(1, int((1 - target) * (start + g - 1) / (g * (target - limit))))
    while k > 1 and below(k - 1):
        k -= 1
    while not below(k):
        k += 1
    return start + k * g

"""Memory accounting for a quantized paged cache."""

from __future__ import annotations

from dataclasses import dataclass, fields

_MiB = 1 << 20


@dataclass
class MemoryReport:
    """Bytes by kind, summed over layers.

    ``codes``, ``scales``, ``zeros``: live quantized tokens (pages in use, counted
    by the tokens they hold; a page that beams share counted once); ``residual``: live full-precision tokens, of which
    ``sinks`` are the attention-sink tokens (``sink_tokens`` token-layers);
    ``pool_slack``: allocated but unused bytes (free pages, unfilled page slots,
    unused residual slots); ``pool_allocated``: everything the cache allocated;
    ``fp16_equivalent``: an fp16 cache of the same tokens.
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

    @classmethod
    def from_layers(cls, layers) -> MemoryReport:
        r = cls()
        for layer in layers:
            s = layer.memory_stats()
            if not s:
                continue
            for name in ("quantized_tokens", "residual_tokens", "codes", "scales", "zeros", "residual",
                         "sink_tokens", "sinks", "fp16_equivalent", "pages_total", "pages_in_use"):
                setattr(r, name, getattr(r, name) + s[name])
            alloc = s["pool_allocated"] + s["residual_allocated"]
            r.allocated += alloc
        r.pool_slack = r.allocated - r.live
        return r

    @property
    def live(self) -> int:
        return self.codes + self.scales + self.zeros + self.residual

    @property
    def compression(self) -> float:
        """fp16 bytes of the stored tokens over the bytes that hold them (live)."""
        return self.fp16_equivalent / self.live if self.live else float("nan")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["live"] = self.live
        d["compression"] = self.compression
        return d

    def __str__(self) -> str:
        rows = [
            ("codes", self.codes), ("scales", self.scales), ("zero points", self.zeros),
            ("residual window (fp)", self.residual), ("  of which sinks", self.sinks),
            ("live total", self.live),
            ("pool slack", self.pool_slack), ("allocated", self.allocated),
            ("fp16 cache of same tokens", self.fp16_equivalent),
        ]
        lines = [f"  {name:<26}{n / _MiB:10.3f} MiB" for name, n in rows]
        lines.append(f"  {'compression vs fp16':<26}{self.compression:10.2f} x  "
                     f"({self.quantized_tokens} quantized + {self.residual_tokens} full-precision token-layers)")
        return "\n".join(lines)

"""Launch settings of the Triton kernels: one frozen dataclass per kernel family, with the policies' defaults.

Every field's default is what the library does. ``None`` means "the policy decides": the rule next to the kernel
that reads the field (named in its comment). A launcher takes ``tuning=None`` (the family's part of
:data:`DEFAULT`, read at each call) or an instance; the instance is part of the launcher's plan key, so two settings
never share a plan or a cached launch. Benchmarks and tests that compare settings pass instances (:func:`parse` turns
``field=value,...`` into one, for command lines); code that reaches the kernels through a cache (which passes no
tuning) runs under :data:`DEFAULT`, which a benchmark may replace (``tuning.DEFAULT = parse(...)``).

No environment variable is read here or by the launchers: ``KIVI_CHECK_INDICES`` (:mod:`.checks`, read
once at import) is the one debug switch, and it checks index values, it sets no launch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .unpack import EXACT, SRCMINS


class _Settings:
    """Base of the families: fields checked when an instance is made (``_check``), the hash computed once (the
    launchers hash their plan keys, which hold the instance, on every call)."""

    def __post_init__(self):
        self._check()
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self))))

    def __hash__(self):
        return self._hash


def _need(ok: bool, owner, name: str, want: str) -> None:
    if not ok:
        raise ValueError(f"{type(owner).__name__}.{name} must be {want}, got {getattr(owner, name)!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class DecodeTuning(_Settings):
    """Settings of the decode op (``paged_decode_attention``, ``DecodeRunner``): the split kernel, its merge and the
    context split. Policies in :mod:`.decode_plan`."""

    # warps per split-kernel program: one needs no cross-warp softmax reductions or barriers; two- and four-warp
    # programs decode slower (the occupancy they add costs more instructions than it hides)
    warps: int = 1
    # query-head rows per program (GP) at least this (a power of two): 1 rounds the group up to a power of two only,
    # as the transposed MMAs hold the query heads on their narrow side, which needs no padding to 16 rows
    gp_min: int = 1
    # at most this many tokens per step of the paged loop (whole key groups inside a page): 64-token steps pay the
    # softmax, rescale and scale loads half as often as 32-token ones
    step: int = 64
    # software-pipelining depth of the paged loop (PSTAGES, num_stages): the page index feeds the code loads, and
    # at fewer stages every step waits for all its copies instead of keeping the next step's in flight
    stages: int = 5
    # of the residual-window loop (RSTAGES): pipelined as deep as the paged loop it spills
    rstages: int = 1
    # register cap per thread (0: none); None: ``_maxnreg`` (128 for steps of at most 32 tokens, for more resident
    # programs; none for larger steps, which would spill under it)
    maxnreg: int | None = None
    # SRCMIN of the unpack (:func:`.unpack.field`): EXACT shifts every code to the top of the mantissa (outputs
    # equal to the exact unpack); 6 or 4 read codes in place with a coarser rounding of the folded zero points
    srcmin: int = EXACT
    # the paged loop's value-word offsets declared multiples of a step's words (VHINT); None: ``_vhint``
    vhint: bool | None = None
    # one load of the step's key scale and zero words for every key plane (KSZ); None: ``_ksz``
    ksz: bool | None = None
    # programs per SM the split rule counts on; None: read from the compiled kernel (registers, shared memory),
    # ``RESIDENT_DEFAULT`` until its first launch
    resident: int | None = None
    # at most this many programs per SM over all waves of the split kernel (three waves of the 8 one-warp programs an
    # SM holds at head_dim 128): enough splits to fill the SMs at large batches; more only add partials to merge
    fill: int = 24
    # context tokens per split when ``split_count`` counts the waves a context wants: long contexts get up to
    # ``fill`` waves of splits long enough to amortize each program's setup and partial
    split_long: int = 1024
    # no split shorter than this many tokens: shorter ones add partials to merge and per-program setup for little
    split_min: int = 256
    # window slots per window program (rounded up to whole steps); None: ``window_chunk``
    rchunk: int | None = None
    # the split kernel's last program of each (sequence, KV head) merges the partials (no merge kernel); None: where
    # the pairs are at most ``MERGE_PAIRS`` (small batches, whose eager steps are bound by the host: one launch fewer)
    fuse_merge: bool | None = None
    # at most this many partials per pair merged in the split kernel: one one-warp program merges them all; up to a
    # few hundred its GPU time hides behind the host in eager steps, which save the merge kernel's launch
    merge_max: int = 256
    # direct launches of the compiled kernels (:class:`._util.Launcher`, ``DecodeRunner``): the argument binding of
    # Triton's launch path costs tens of microseconds per launch; False: Triton's own launch every call
    fast_launch: bool = True
    # the dots' precision: "auto" multiplies in fp16/bf16 on a GPU (fp32 queries and Triton's interpreter, whose
    # fp16/bf16 dots are slow and bf16 arithmetic wrong, in fp32); "half": fp16/bf16 under the interpreter too (tests
    # of the GPU arithmetic on a CPU)
    dot: str = "auto"
    # the code unpack: "auto" is the inline-PTX unpack where it applies (2/4-bit codes, fp16/bf16 dots, a GPU);
    # "plain": plain Triton everywhere (the reference point of the PTX unpack in tests and benchmarks)
    unpack: str = "auto"

    __hash__ = _Settings.__hash__  # (dataclass would replace an inherited one)

    def _check(self):
        for name in ("warps", "gp_min", "step", "stages", "rstages", "fill", "split_long", "split_min", "merge_max"):
            v = getattr(self, name)
            _need(_is_int(v) and v >= 1, self, name, "an int >= 1")
        for name in ("warps", "gp_min"):
            v = getattr(self, name)
            _need(v & (v - 1) == 0, self, name, "a power of two")
        _need(self.maxnreg is None or (_is_int(self.maxnreg) and self.maxnreg >= 0), self, "maxnreg",
              "None (the policy) or an int >= 0 (0: no cap)")
        for name in ("resident", "rchunk"):
            v = getattr(self, name)
            _need(v is None or (_is_int(v) and v >= 1), self, name, "None (the policy) or an int >= 1")
        _need(self.srcmin in SRCMINS and _is_int(self.srcmin), self, "srcmin", f"one of {SRCMINS}")
        for name in ("vhint", "ksz", "fuse_merge"):
            v = getattr(self, name)
            _need(v is None or isinstance(v, bool), self, name, "None (the policy), True or False")
        _need(isinstance(self.fast_launch, bool), self, "fast_launch", "True or False")
        _need(self.dot in ("auto", "half"), self, "dot", "'auto' or 'half'")
        _need(self.unpack in ("auto", "plain"), self, "unpack", "'auto' or 'plain'")


@dataclass(frozen=True)
class QuantTuning(_Settings):
    """Settings of ``quantize_and_write`` and ``append_and_flush`` (which reads ``fast_launch`` only)."""

    # keys and values in separate programs (grid (N, H, 2)): the launch is latency-bound, and two programs halve
    # each one's chain of min/max, divisions and packing; False: one program quantizes both
    split: bool = True
    # warps per program: 8 is faster only at a few dozen programs and slower at many
    warps: int = 4
    # direct launches of the compiled kernel (:class:`._util.Launcher`), as ``DecodeTuning.fast_launch``
    fast_launch: bool = True

    __hash__ = _Settings.__hash__

    def _check(self):
        _need(isinstance(self.split, bool), self, "split", "True or False")
        _need(_is_int(self.warps) and self.warps >= 1 and self.warps & (self.warps - 1) == 0, self, "warps",
              "a power of two")
        _need(isinstance(self.fast_launch, bool), self, "fast_launch", "True or False")


@dataclass(frozen=True)
class Tuning:
    """Every family's settings: what :data:`DEFAULT` holds and :func:`parse` returns."""

    decode: DecodeTuning = DecodeTuning()
    quant: QuantTuning = QuantTuning()


DEFAULT = Tuning()

_FAMILIES = tuple(f.name for f in dataclasses.fields(Tuning))
_SHARED = ("fast_launch",)  # a bare name that sets every family's field


def _value(text: str, kind: str, where: str):
    """``text`` as a value of a field of type ``kind`` (the annotation's text)."""
    t = text.strip().lower()
    if "None" in kind and t in ("none", "auto"):
        return None
    if kind.startswith("bool"):
        if t in ("1", "true", "on", "yes"):
            return True
        if t in ("0", "false", "off", "no"):
            return False
        auto = ", auto" if "None" in kind else ""
        raise ValueError(f"{where}: {text!r} is not a switch (1/0, true/false, on/off{auto})")
    try:
        return int(t)
    except ValueError:
        raise ValueError(f"{where}: {text!r} is not an int{' or auto' if 'None' in kind else ''}") from None


def parse(spec: str, base: Tuning | None = None) -> Tuning:
    """``base`` (default :data:`DEFAULT`) with the fields of ``spec`` changed: ``"field=value,..."``, each field
    ``family.name`` (``decode.vhint``, ``quant.warps``) or a bare name that one family has (``vhint``; ``fast_launch``
    sets every family's). Values: ints, ``1``/``0`` (or true/false, on/off) for switches, ``auto`` (or ``none``) for
    None. ``""`` gives ``base``. E.g. ``parse("vhint=0,ksz=1")``, ``parse("quant.split=0,quant.warps=8")``."""
    out = DEFAULT if base is None else base
    fields = {fam: {f.name: f for f in dataclasses.fields(getattr(out, fam))} for fam in _FAMILIES}
    changes: dict = {fam: {} for fam in _FAMILIES}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, eq, text = item.partition("=")
        name = name.strip()
        if not eq:
            raise ValueError(f"tuning: {item!r} is not field=value")
        fam, dot, short = name.rpartition(".")
        if dot:
            if fam not in fields or short not in fields[fam]:
                raise ValueError(f"tuning: no field {name!r} (families {_FAMILIES})")
            owners = [fam]
        else:
            owners = [f for f in _FAMILIES if short in fields[f]]
            if not owners:
                raise ValueError(f"tuning: no field {short!r}; fields: "
                                 + "; ".join(f"{f}: {', '.join(fields[f])}" for f in _FAMILIES))
            if len(owners) > 1 and short not in _SHARED:
                raise ValueError(f"tuning: {short!r} is a field of {' and '.join(owners)}: write "
                                 + " or ".join(f"{f}.{short}" for f in owners))
        for f in owners:
            changes[f][short] = _value(text, str(fields[f][short].type), f"tuning {f}.{short}")
    changed = {f: dataclasses.replace(getattr(out, f), **c) for f, c in changes.items() if c}
    return dataclasses.replace(out, **changed) if changed else out


def overrides(t: Tuning) -> dict:
    """The fields of ``t`` that differ from the classes' defaults, as ``{"family.name": value}`` (for the records of
    a benchmark)."""
    out = {}
    for fam in _FAMILIES:
        part, default = getattr(t, fam), getattr(Tuning(), fam)
        for f in dataclasses.fields(part):
            if getattr(part, f.name) != getattr(default, f.name):
                out[f"{fam}.{f.name}"] = getattr(part, f.name)
    return out

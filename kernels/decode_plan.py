"""The decode op's plan: what a call derives from shapes, strides, dtypes and settings alone (:class:`_DecodePlan`:
the kernels' grids, compile-time settings and integer arguments), and the launch heuristics it applies.

The paged splits per (sequence, KV head), NS, come from ``B * Hkv`` against the SM count, the programs an SM holds
at once (:func:`resident_programs`, read from the compiled kernel and kept in ``_RESIDENT``) and the block table's
width (an upper bound of every sequence's page count; keep it trimmed): :func:`split_count`. The window's programs:
:func:`window_chunk`. The split kernel's (:mod:`.decode_split`) compile-time settings follow ``tuning.DecodeTuning``
and its policies: :func:`_step_tokens`, :func:`_maxnreg`, :func:`_stages`, :func:`_srcmin`, :func:`_vhint`,
:func:`_ksz`. Where the split kernel merges its own partials: ``MERGE_MAX``, ``MERGE_PAIRS``.
"""

from __future__ import annotations

import torch
import triton

from . import tuning as _tuning
from ._util import check_settings, interpreting, num_sms
from .decode_merge import _reduce_launch


def _use_asm(dtype, bits: int, dot_f32: bool) -> bool:
    """The inline-PTX unpack (GPU only) covers 2/4-bit codes with fp16/bf16 dots."""
    return not dot_f32 and not interpreting() and bits in (2, 4) and dtype in (torch.float16, torch.bfloat16)


def _decode_tuning(t: _tuning.DecodeTuning | None) -> _tuning.DecodeTuning:
    """``t``, or the default's decode settings (read at each call: a benchmark may replace ``tuning.DEFAULT``)."""
    return _tuning.DEFAULT.decode if t is None else t


def _step_tokens(page_size: int, group_size: int, interp: bool, t: _tuning.DecodeTuning | None = None) -> int:
    """Tokens per step of the paged loop: whole key groups inside one page, up to ``DecodeTuning.step`` (64). At
    head_dim 256 too, although that build spills under Triton 3.6: 32-token steps or two-warp programs, which do not
    spill, decode slower there."""
    cap = max(group_size, _decode_tuning(t).step)
    return max(g for g in (group_size * (1 << i) for i in range(8)) if g <= cap and page_size % g == 0)


def _maxnreg(interp: bool, step: int, t: _tuning.DecodeTuning | None = None) -> dict:
    """Register cap per thread (more resident warps per SM): 128 for 32-token steps, none for larger steps (they
    would spill); ``DecodeTuning.maxnreg`` overrides (0 = none)."""
    n = _decode_tuning(t).maxnreg
    if n is None:
        n = 128 if step <= 32 else 0
    return {} if interp or n <= 0 else {"maxnreg": n}


def _stages(interp: bool, t: _tuning.DecodeTuning | None = None) -> dict:
    """Software-pipelining depth of the paged loop (``PSTAGES`` and ``num_stages``: ``DecodeTuning.stages``, 5) and
    of the residual-window loop (``RSTAGES``: ``DecodeTuning.rstages``, 1). The paged loop's page index (block table)
    is itself a pipelined load that the code loads depend on, so with Triton 3.6 fewer than 5 stages make every step
    wait for *all* its copies (``cp.async.wait_group 0``: the load latency is exposed once per step); at 5 the next
    step's codes stay in flight during this step's math. The residual loop pipelined that deep spills, so it runs
    unpipelined. One stage of each under the interpreter."""
    if interp:
        return dict(PSTAGES=1, RSTAGES=1, num_stages=1)
    t = _decode_tuning(t)
    return dict(PSTAGES=t.stages, RSTAGES=t.rstages, num_stages=t.stages)


# programs per SM of each compiled decode kernel, keyed by device and compile-time settings: read from the
# kernel returned by its first launch (registers, shared memory, warps); until then RESIDENT_DEFAULT (the one-warp
# head_dim-128 kernel's count)
RESIDENT_DEFAULT = 8
_RESIDENT: dict = {}


def _srcmin(t: _tuning.DecodeTuning | None = None) -> dict:
    """``SRCMIN`` of the unpack (``DecodeTuning.srcmin``: 16 = exact, the default; 6 or 4 read codes in place from
    that mantissa bit up, with a larger rounding of the folded zero points: ``kernels.unpack.field``)."""
    return dict(SRCMIN=_decode_tuning(t).srcmin)


def _vhint(d: int, step: int, key_bits: int, value_bits: int, t: _tuning.DecodeTuning | None = None) -> dict:
    """``VHINT`` of the split kernel: its paged loop declares each step's offset into the value-word rows a multiple
    of the step's words (true: steps start at multiples of BLOCK). Triton 3.9 infers that and copies the value tiles
    in 16-byte pieces; 3.6 (the GPU image) copies them 4 bytes at a time without the hint, and with it builds what
    3.9 builds (the same cp.async widths) and decodes faster, with bit-equal outputs. Policy
    (``DecodeTuning.vhint=None``): on for 64-token steps at head_dim >= 128, and at head_dim 64 for 2- and 4-bit keys
    and values (faster there under 3.6, with and without KSZ); off for 32-token steps (3.6 then spills) and for 8-bit
    keys or values at head_dim 64 (no gain established there). Under 3.9 it changes no instruction. True/False force
    it."""
    v = _decode_tuning(t).vhint
    if v is None:
        v = step >= 64 and (d >= 128 or max(key_bits, value_bits) <= 4)
    return dict(VHINT=int(v))


_TRITON_36 = triton.__version__.startswith("3.6")  # the GPU image's Triton, under which _ksz's bf16 rule differs


def _ksz(d: int, key_bits: int, bf16: bool = False, t: _tuning.DecodeTuning | None = None) -> dict:
    """``KSZ`` of the split kernel (``DecodeTuning.ksz``: None, the policy, True or False; 2- and 4-bit keys with
    the inline-PTX unpack only): the step's key scale and zero words of every key plane in one [2, GPS, D/2] int32
    load (``_key_words``), split in registers, instead of two [GPS, D/2 NK] loads per plane. Those tiles are small at
    head_dim 64 and with 64-token groups, and Triton 3.6 copies them with 16-byte cp.async on a few lanes, each copy
    behind a branch: more SASS per step than 3.9 builds, and slower. With one load 3.6's build is as lean as 3.9's
    and decodes as fast, at head_dim 64 and 128 as fast or faster than with the per-plane loads; it loads the same
    words, so outputs are bit-equal where the split count is unchanged. Policy: on at head_dim 64; at 128 for fp16,
    and for bf16 under Triton 3.6 only (bf16 builds at head_dim 128 sit at the 255-register cap and the one load
    keeps more words live: they spill a few registers per step, faster anyway under 3.6, no faster under 3.9).
    At head_dim 256 every build spills with or without it: off."""
    v = _decode_tuning(t).ksz
    if v is None:
        v = d < 128 or (d == 128 and (not bf16 or _TRITON_36))
    return dict(KSZ=int(v and key_bits in (2, 4)))


def warps_by_registers(regs: int, sm_regs: int = 65536) -> int:
    """Warps an SM holds by registers alone (sm_80/sm_90): each of its 4 sub-partitions has a quarter of the
    register file, allocated per warp in units of 256 registers; at most 64."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(64, 4 * (sm_regs // 4 // per_warp)) if per_warp else 64


def resident_programs(regs: int, shared: int, warps: int, sm_regs: int = 65536, sm_shared: int = 233472,
                      sm_warps: int = 64, sm_blocks: int = 32) -> int:
    """Programs of ``warps`` warps an SM holds at once (sm_80/sm_90 limits): registers as
    :func:`warps_by_registers`, each program's shared memory costs 1 KB more (reserved by the driver)."""
    by_regs = warps_by_registers(regs, sm_regs) // warps
    by_shared = sm_shared // (shared + 1024)
    return max(1, min(by_regs, by_shared, sm_warps // warps, sm_blocks))


def _resident_of(kernel, device) -> int | None:
    try:
        limits = {}
        if device.type == "cuda":  # e.g. A100: 164 KB of shared memory per SM, H100/H200: 228 KB
            props = torch.cuda.get_device_properties(device)
            limits = dict(sm_shared=getattr(props, "shared_memory_per_multiprocessor", 233472),
                          sm_warps=getattr(props, "max_threads_per_multi_processor", 2048) // 32)
        return resident_programs(int(kernel.n_regs), int(kernel.metadata.shared), int(kernel.metadata.num_warps),
                                 **limits)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None


def _pick_splits(bsz: int, hkv: int, width_tokens: int, device, resident: int = RESIDENT_DEFAULT,
                 chunks: int = 1, t: _tuning.DecodeTuning | None = None) -> int:
    """Context splits per (sequence, KV head). The grid has ``bsz * hkv * (splits + chunks)`` one-warp programs
    (the last ``chunks`` of each read the residual window, :func:`window_chunk`); ``resident`` of them fit on an
    SM at once (from the compiled kernel's registers and shared memory: 8 for the one-warp d=128 kernel, 4 at d=256;
    ``DecodeTuning.resident`` overrides), so ``slots = SMs * resident`` programs make one wave.
    Waves: as many as splits of ``DecodeTuning.split_long`` (1024) tokens need, at most
    ``DecodeTuning.fill / resident`` (24 / 8 = 3); splits fill those waves, but none is shorter than
    ``DecodeTuning.split_min`` (256) tokens. So batch 1 x 8 KV heads at 128k runs one wave of 131 splits (faster
    than two or three waves of more), at 32k and 8k 256-token splits, and from batch 8 x 8 KV heads at >= 32k three
    waves. Two splits at most under the interpreter or off CUDA."""
    if interpreting() or device.type != "cuda":
        return max(1, min(2, width_tokens // 64))
    return split_count(bsz, hkv, width_tokens, num_sms(device), resident, chunks, t)


def split_count(bsz: int, hkv: int, width_tokens: int, sms: int, resident: int, chunks: int = 1,
                t: _tuning.DecodeTuning | None = None) -> int:
    """The rule of :func:`_pick_splits` for ``sms`` SMs holding ``resident`` programs each (``t``'s settings)."""
    t = _decode_tuning(t)
    resident = t.resident or resident
    slots = sms * resident
    pairs = max(1, bsz * hkv)
    max_waves = max(1, t.fill // resident)
    by_long = triton.cdiv(width_tokens, t.split_long)
    waves = min(max_waves, triton.cdiv(pairs * (by_long + chunks), slots))
    by_fill = max(1, waves * slots // pairs - chunks)
    by_len = triton.cdiv(width_tokens, t.split_min)
    return max(1, min(by_fill, by_len, 1024))


# window slots per program where the (sequence, KV head) pairs are few (window_chunk): the unpipelined window loop
# spread over a few programs instead of one that outlasts the paged splits
WINDOW_CHUNK = 64


def window_chunk(pairs: int, capacity: int, block_r: int, device, t: _tuning.DecodeTuning | None = None) -> int:
    """Window slots per program: the whole window (one program) unless the pairs are few (at most ``MERGE_PAIRS``,
    small batches on a GPU), where the window's one unpipelined program would be the split kernel's longest, the one
    every short context waits for: then ``WINDOW_CHUNK`` slots each. The plan keeps the chunks only where the split
    rule (:func:`split_count`) gives the paged splits the same count with them as with one window program (split
    length the bound: short contexts, batch 1 up to 32k); where they would move the rule to more waves (batch 8 x 8
    KV heads x 32k) they decode slower. ``DecodeTuning.rchunk`` overrides both (tokens, rounded up to whole
    ``block_r`` steps; also under the interpreter, for tests)."""
    rchunk = _decode_tuning(t).rchunk
    if rchunk:
        tokens = rchunk
    elif device.type == "cuda" and not interpreting() and pairs <= MERGE_PAIRS:
        tokens = WINDOW_CHUNK
    else:
        tokens = capacity
    return _whole_steps(tokens, capacity, block_r)


def _whole_steps(tokens: int, capacity: int, block_r: int) -> int:
    """``tokens`` (at most the window's ``capacity``) rounded up to whole ``block_r``-slot steps."""
    return max(block_r, triton.cdiv(max(1, min(tokens, capacity)), block_r) * block_r)


def _check_common(q_dim, k_codes, k_scale, key_bits, value_bits, group_size, op: str = ""):
    """The attention ops' shared checks: q's head_dim against the pool's, the configuration (``op``'s limits,
    :func:`.checks.kernel_limits`), the pool rows contiguous."""
    d = k_scale.shape[-1]
    if q_dim != d:
        raise ValueError(f"q head_dim={q_dim} does not match the pool's head_dim={d}")
    check_settings(d, key_bits, value_bits, group_size, k_codes.shape[2], op=op)
    for t in (k_codes, k_scale):
        if t.stride(-1) != 1:
            raise ValueError("pool tensors must have a contiguous last dimension")


# at most this many partials per (sequence, KV head) merged in the split kernel by default (DecodeTuning.merge_max;
# and only while GP x BM <= 1024)
MERGE_MAX = _tuning.DecodeTuning.merge_max
# the split kernel merges by default only where (sequences x KV heads) is at most this: small batches, whose eager
# steps are bound by the host (one launch fewer); larger ones are bound by the GPU, where the merge kernel costs less
MERGE_PAIRS = 64


class _DecodePlan:
    """What a decode call derives from shapes, strides, dtypes and settings alone (FlashInfer's plan/run split):
    checked once, then every call with the same key only allocates its workspace and launches."""

    __slots__ = ("meta", "grid", "reduce_grid", "reduce_meta", "rows", "nsp1", "rkey", "final", "ints", "merge_meta",
                 "pairs", "counters")

    def __init__(self, q, block_table, k_codes, k_scale, v_codes, v_scale, v_zero, res_k, res_v, key_bits,
                 value_bits, group_size, num_splits, newkv=False, sliding_window=None,
                 sink=False, tuning: _tuning.DecodeTuning | None = None):
        t = _decode_tuning(tuning)
        if not isinstance(t, _tuning.DecodeTuning):
            raise TypeError(f"tuning must be None or a kernels.tuning.DecodeTuning, got {type(t).__name__}")
        if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                       or num_splits < 1):
            raise ValueError(f"num_splits must be None (automatic) or an int >= 1 (context splits), got {num_splits!r}")
        bsz, hq, d = q.shape
        _check_common(d, k_codes, k_scale, key_bits, value_bits, group_size, op="paged_decode_attention")
        np_, hkv, p, _ = k_codes.shape
        if hq % hkv:
            raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
        group = hq // hkv
        gp = max(t.gp_min, triton.next_power_of_2(group))
        interp = interpreting()
        blk = _step_tokens(p, group_size, interp, t)
        blk_r = 64 if interp else (32 if d <= 128 else 16)
        dot_f32 = (interp and t.dot != "half") or q.dtype == torch.float32
        plain = t.unpack == "plain"
        kw = k_codes.view(torch.int32)
        vw = v_codes.view(torch.int32)
        if kw.stride(2) != kw.shape[3] or vw.stride(2) != vw.shape[3] or v_scale.stride(2) != v_scale.shape[3]:
            raise ValueError("pool tensors must be contiguous within a page (rows back to back)")
        if not dot_f32 and (v_scale.element_size() != 2 or any(
                x % 2 for t in (v_scale, v_zero) for x in (*t.stride()[:3], t.storage_offset()))):
            raise ValueError("fp16/bf16 decode reads value scales and zeros in pairs of tokens: they must be "
                             "fp16/bf16 with even strides and offsets (as the page pool allocates them)")
        meta = dict(GROUP=group, GP=gp, D=d, P=p, G=group_size, BLOCK=blk, BLOCK_R=blk_r,
                    KBITS=key_bits, VBITS=value_bits, DOT_F32=dot_f32,
                    KASM=not plain and _use_asm(q.dtype, key_bits, dot_f32),
                    VASM=not plain and _use_asm(q.dtype, value_bits, dot_f32), BF16=q.dtype == torch.bfloat16,
                    num_warps=t.warps, **_stages(interp, t), **_maxnreg(interp, blk, t),
                    **_srcmin(t), **_vhint(d, blk, key_bits, value_bits, t),
                    **_ksz(d, key_bits, q.dtype == torch.bfloat16, t),
                    **({"SLIDING": 1} if sliding_window else {}))
        rkey = (q.device.index, *meta.items())
        cap = res_k.shape[2]
        rch = window_chunk(bsz * hkv, cap, blk_r, q.device, t)
        chunks = max(1, triton.cdiv(cap, rch))
        if num_splits:
            ns = num_splits
        else:
            width, resident = block_table.shape[1] * p, _RESIDENT.get(rkey, RESIDENT_DEFAULT)
            if sliding_window:  # the pages a window spans
                width = min(width, (triton.cdiv(sliding_window, p) + 1) * p)
            ns = _pick_splits(bsz, hkv, width, q.device, resident, chunks, t)
            if chunks > 1 and not t.rchunk:
                ns1 = _pick_splits(bsz, hkv, width, q.device, resident, 1, t)
                if ns != ns1:  # the chunks would change the paged splits (and waves): one window program
                    rch, chunks, ns = _whole_steps(cap, cap, blk_r), 1, ns1
        self.meta = dict(meta, **({"NEWKV": 1} if newkv else {}))
        self.grid = (bsz * hkv, ns + chunks)
        self.rows, self.nsp1, self.rkey = bsz * hq, ns + chunks, rkey
        # the split kernel's integer arguments: fixed by the key (its strides, head counts, splits, window chunk)
        self.ints = (hkv, ns, rch, sliding_window or 0, q.stride(0), q.stride(1), block_table.stride(0), kw.stride(0),
                     kw.stride(1),
                     k_scale.stride(0), k_scale.stride(1), k_scale.stride(2), vw.stride(0), vw.stride(1),
                     v_scale.stride(0), v_scale.stride(1), *res_k.stride()[:3], *res_v.stride()[:3])
        self.reduce_grid, self.reduce_meta = _reduce_launch(self.rows, self.nsp1, d, sink)
        # the split kernel merges its own partials (no merge kernel) where a pair has at most merge_max of them (one
        # one-warp program merges them all: more GPU time than the merge kernel at a hundred partials, hidden behind
        # the host in eager steps) and, by default, where there are few pairs (MERGE_PAIRS: small batches, whose eager
        # steps are host-bound: one launch fewer). Never while a CUDA graph is captured (there the GPU time counts:
        # the merge kernel). DecodeTuning.fuse_merge True: at any batch; False: never.
        self.merge_meta = None
        fuse = t.fuse_merge
        bm = triton.next_power_of_2(self.nsp1)
        if ((fuse or (fuse is None and bsz * hkv <= MERGE_PAIRS)) and self.nsp1 <= t.merge_max
                and gp * bm <= 1024):  # the merging program holds all [GP, BM] partial maxima and sums in registers
            self.merge_meta = dict(self.meta, MERGE=1, BM=bm, BSM=max(1, min(bm, 2048 // (gp * d))),
                                   **({"SINK": 1} if sink else {}))
        self.pairs, self.counters = bsz * hkv, {}  # MERGE: arrival counts per stream, zero between calls
        self.final = interp or rkey in _RESIDENT  # else: planned again once the kernel's residency is known

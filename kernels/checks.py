"""Argument checks of the paged ops, shared by the Triton kernels, the torch reference and the torch path (installed as
``kivi_cache.kernels.checks``: torch only, no Triton, nothing from ``kivi_cache``; the cache imports it from here).

Every check raises ``ValueError`` naming the parameter and what it must be, before anything is written.
Shapes, dtypes and devices are always checked (no device work), as are the scalars (bits, group size; ``sm_scale``
finite and > 0, a tensor's value off a GPU only). The *values* of the index tensors are checked where that costs no
device sync (:func:`values_checked`): on tensors outside a GPU, or on a GPU with ``KIVI_CHECK_INDICES=1`` (one sync
per call; for debugging). On a GPU without it they are valid only by construction, as the cache builds them; another
caller's out-of-range values there read or write out of bounds. Every index an op reads or writes through, its check
and what builds it for the cache on a GPU:

* ``quantize_and_write``: ``pages`` in ``[0, NP)``, ``slots`` multiples of G in ``[0, P)`` (:func:`check_write`).
  Built by ``QuantizedPagedLayer._quantize``: pages of the layer's own tables (``PagePool.allocate``), slots from its
  host lengths (``_reserve``).
* ``dequantize_pages``: ``lengths`` in ``[0, W P]`` and the pages of each sequence's first ``ceil(lengths / P)``
  columns of ``block_table`` in ``[0, NP)`` (:func:`check_tables`). Built by ``QuantizedPagedLayer._device_state``
  (the host tables and lengths uploaded, ``-1`` past a sequence's pages).
* ``paged_decode_attention``, ``paged_prefix_attention``: as ``dequantize_pages``, and ``res_lengths`` in ``[0, C]``
  (:func:`check_attention`, :func:`attention_values`). Built by ``_device_state`` (the window lengths a row of
  ``_uniform_lengths``' constant table, or uploaded).
* ``append_and_flush``: as ``dequantize_pages``; ``res_lengths`` below the window's capacity; ``sink_lengths`` in
  ``[0, sink_length]``; for a sequence that flushes, its column ``lengths // P`` inside the table, the page there an
  id, the slot a multiple of G (:func:`check_flush`). Built by ``StaticQuantizedPagedLayer._to_static``: tables of
  ``pages_per_sequence(max_cache_len)`` columns, which hold every flush while ``seen <= max_cache_len``, refused by
  ``_update_static`` (eager) or asserted there (compiled: ``torch._assert_async``, after the step).
* ``DecodeRunner``: the kernels' checks everything on its first run (the op's call), later direct launches nothing
  (every run is the op's call with ``KIVI_CHECK_INDICES=1``); the cache's ``attend`` builds a new one when the block
  table is replaced. The torch path's checks the values of the block table and lengths on its first run and again
  after an in-place write to either (their ``_version``), ``res_lengths`` on every run.

Within :class:`own_state` (the cache's own calls) the values are not checked on the host either: they are built as
above.
"""

from __future__ import annotations

import math
import numbers
import os
import threading
from typing import NamedTuple

import torch

ALLOWED_BITS = (2, 4, 8)  # code widths: the cache's settings (kivi_cache.config) and the ops accept these
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INTS = (torch.int32, torch.int64)
POOL_NAMES = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
# the one debug switch, read here once (at import): index values checked on every call, on a GPU too (one sync per
# call); the kernels' launchers read it from here at each call (and so do tests that patch it)
CHECK_INDICES = os.environ.get("KIVI_CHECK_INDICES") == "1"


# the range search of clipping (kivi_cache.quant): a group's range is narrowed about its centre by CLIP_STEPS
# candidate cuts of i / 32 of its span from each end (i = 0 .. CLIP_STEPS - 1: ratios 1 - i / 16 of the span, 1 down
# to 0.5625; exact binary fractions, so every backend computes the same candidate ranges), the one with the lowest
# squared reconstruction error kept (the first of equal ones)
CLIP_STEPS = 8
ALLOWED_HEAD_DIMS = (64, 128, 256)  # head_dims the kernels' tiles cover (the torch path takes any)


def kernel_limits(op: str, head_dim: int, key_bits: int, value_bits: int, group_size: int, page_size: int,
                  interpreted: bool = False) -> str | None:
    """Why the Triton kernels do not cover a configuration, or None where they do: the one statement of their limits.
    ``kivi_cache.ops`` asks it to choose the backend up front (the torch path serves what the kernels do not); the
    kernels raise ``ValueError`` with the same text. ``op``: the op's name (``paged_decode_attention`` has limits
    of its own); ``interpreted``: Triton's interpreter runs the kernels (no GPU tile limit)."""
    d, g, p = head_dim, group_size, page_size
    if d not in ALLOWED_HEAD_DIMS:
        return f"head_dim={d} is not supported by the Triton kernels; allowed values: {ALLOWED_HEAD_DIMS}"
    for name, b in (("key_bits", key_bits), ("value_bits", value_bits)):
        if b not in ALLOWED_BITS:
            return f"{name}={b} is not supported; allowed values: {ALLOWED_BITS}"
    if g < 1 or g & (g - 1) or d % g:
        return f"group_size={g} must be a power of two dividing head_dim={d}"
    if p < 1 or p % g:
        return f"page_size={p} must be a multiple of group_size={g}"
    if not interpreted and p & -p < 32:
        # a kernel step is a power-of-two tile of tokens dividing the page; Triton 3.6 computes wrong results on the
        # GPU for tiles of fewer than 32 tokens
        return (f"page_size={p} with group_size={g} needs {max(p & -p, g)}-token tiles; the GPU kernels need "
                f"page_size divisible by 32 (e.g. 64)")
    if op == "paged_decode_attention":
        sub = min(g, 32)  # channels of one value sub-tile: one accumulator each, at most 8 per head
        if d // sub > 8 or sub < 16 or d * key_bits // 8 < 16 or p * value_bits % 32:
            return (f"decode kernel needs value sub-tiles min(group_size, 32) >= 16 and <= 8 of them per head, and "
                    f"pages of whole 32-bit words of value codes; got group_size={g}, head_dim={d}, page_size={p}, "
                    f"bits={key_bits}/{value_bits}")
        if d * key_bits // 8 % 4 or p * value_bits // 8 % 4:
            return "code rows must be a whole number of 32-bit words (head_dim * bits / 8 % 4 == 0)"
    return None


class PoolTensors(NamedTuple):
    """A page pool's six tensors, the one object the ops take (``kivi_cache.ops``; ``PagePool.args()`` builds it). The
    kernels and the torch reference take them as six arguments in this order (``*pool``). Shapes: ``NP`` pages, ``H``
    KV heads, ``P`` tokens per page, ``D`` head_dim, ``G`` group, ``kb``/``vb`` bits."""

    k_codes: torch.Tensor  # [NP, H, P, D * kb / 8] uint8: planar-packed key codes, one row per token
    k_scale: torch.Tensor  # [NP, H, P / G, D]: per channel, per key group
    k_zero: torch.Tensor  # as k_scale
    v_codes: torch.Tensor  # [NP, H, D, P * vb / 8] uint8: value codes, one row per channel packed along tokens
    v_scale: torch.Tensor  # [NP, H, D / G, P]: per token, per channel group
    v_zero: torch.Tensor  # as v_scale


def pool_tensors(pool) -> PoolTensors:
    """``pool`` (a :class:`PoolTensors` or any sequence of the six tensors) as a :class:`PoolTensors`, else
    ValueError naming it."""
    if isinstance(pool, PoolTensors):
        return pool
    if isinstance(pool, torch.Tensor) or not isinstance(pool, (tuple, list)) or len(pool) != len(POOL_NAMES):
        size = "" if isinstance(pool, torch.Tensor) or not hasattr(pool, "__len__") else f" of {len(pool)}"
        raise ValueError(f"pool must be the page pool's six tensors {POOL_NAMES} (a PoolTensors or a tuple), got "
                         f"{type(pool).__name__}{size}")
    return PoolTensors(*pool)


def pool_config(pool) -> tuple[int, int] | None:
    """``(head_dim, page_size)`` of a pool (:class:`PoolTensors`): the key scales' last dim and the key codes' third
    (``[NP, H, P, D * kb / 8]``); None where those tensors are not 4-d (the ops' checks then name the problem)."""
    kc, ks = pool[0], pool[1]
    if not (isinstance(kc, torch.Tensor) and isinstance(ks, torch.Tensor) and kc.dim() == 4 and ks.dim() == 4):
        return None
    return ks.shape[-1], kc.shape[2]


def shape_of(name: str, t, dims: int) -> tuple:
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dims}-d tensor, got {got}")
    return tuple(t.shape)


def check_dtype(name: str, t: torch.Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} must have dtype in {allowed}, got {t.dtype}")


def check_device(device: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}; every tensor of the op must be on {device} (the pool's)")


def check_pool(pool, key_bits: int, value_bits: int, group_size: int) -> tuple:
    """The six pool tensors against each other, the bits and the group (layout in :mod:`kivi_cache.reference`):
    returns ``(NP, H, P, D)``."""
    if len(pool) != 6:
        raise ValueError(f"the pool is 6 tensors {POOL_NAMES}, got {len(pool)}")
    np_, h, p, _ = shape_of("k_codes", pool[0], 4)
    d = shape_of("k_scale", pool[1], 4)[-1]
    g = group_size
    for name, b in (("key_bits", key_bits), ("value_bits", value_bits)):
        if not _is_int(b) or b not in ALLOWED_BITS:
            raise ValueError(f"{name} must be one of {ALLOWED_BITS}, got {b!r}")
    if not _is_int(g) or g < 1:
        raise ValueError(f"group_size must be an int >= 1 (tokens/channels per scale), got {g!r}")
    if d % g or p % g:
        raise ValueError(f"group_size={g!r} must divide head_dim={d} and page_size={p}")
    want = ((np_, h, p, d * key_bits // 8), (np_, h, p // g, d), (np_, h, p // g, d),
            (np_, h, d, p * value_bits // 8), (np_, h, d // g, p), (np_, h, d // g, p))
    for name, t, w in zip(POOL_NAMES, pool, want, strict=True):
        if shape_of(name, t, 4) != w:
            raise ValueError(f"{name} must be {list(w)} ([NP, H, P={p}, D={d}] pool, key_bits={key_bits}, "
                             f"value_bits={value_bits}, group_size={g}), got {list(t.shape)}")
    for name, t in zip(POOL_NAMES, pool, strict=True):
        check_dtype(name, t, (torch.uint8,) if name.endswith("codes") else FLOATS)
    for a, b in ((1, 2), (4, 5)):
        if pool[a].dtype != pool[b].dtype:
            raise ValueError(f"{POOL_NAMES[b]} must have {POOL_NAMES[a]}'s dtype {pool[a].dtype}, got {pool[b].dtype}")
    check_device(pool[0].device, **dict(zip(POOL_NAMES, pool, strict=True)))
    return np_, h, p, d


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_sm_scale(sm_scale) -> None:
    """The attention ops' softmax scale: a finite real number > 0, or a one-element tensor of one (its value checked
    off a GPU only: reading it there would sync; a Triton launch reads it anyway, the torch paths multiply by it)."""
    if isinstance(sm_scale, bool) or not (isinstance(sm_scale, numbers.Real) or (
            isinstance(sm_scale, torch.Tensor) and sm_scale.numel() == 1)):
        raise ValueError(f"sm_scale must be a real number (the softmax scale, e.g. 1 / sqrt(head_dim)), got "
                         f"{sm_scale!r}")
    if isinstance(sm_scale, torch.Tensor) and (sm_scale.is_cuda or sm_scale.is_meta):
        return
    x = float(sm_scale)
    if not (math.isfinite(x) and x > 0):  # 0 or below gives a uniform or reversed softmax, nan or inf NaN outputs
        raise ValueError(f"sm_scale must be a finite number > 0 (the softmax scale, e.g. 1 / sqrt(head_dim)), got "
                         f"{x!r}")


def values_checked(t: torch.Tensor) -> bool:
    """Whether the values of index tensor ``t`` are checked (no device sync and not :class:`own_state`, or asked
    for)."""
    return CHECK_INDICES or (not t.is_cuda and not t.is_meta and not getattr(_OWN, "on", False))


_OWN = threading.local()


class own_state:  # noqa: N801  (used as a function: ``with checks.own_state():``)
    """Within it (this thread), the index values are not checked, as on a GPU: for the cache's calls on its own
    block tables and lengths, valid by construction (the by-value checks synchronize with the device and cost host
    time per layer and step). Shapes, dtypes and devices are still checked; ``KIVI_CHECK_INDICES=1`` checks the
    values anyway."""

    def __enter__(self):
        self.prev = getattr(_OWN, "on", False)
        _OWN.on = True

    def __exit__(self, *exc):
        _OWN.on = self.prev


def check_write(k, v, pages, slots, pool, key_bits: int, value_bits: int, group_size: int) -> None:
    """quantize_and_write's arguments: k, v ``[N, H, G, D]``; pages, slots ``[N]`` integers, page ids in
    ``[0, NP)`` and slots multiples of G in ``[0, P)``."""
    np_, h, p, d = check_pool(pool, key_bits, value_bits, group_size)
    n = shape_of("k", k, 4)[0]
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (n, h, group_size, d):
            raise ValueError(f"{name} must be [N, H={h}, group_size={group_size}, D={d}] like the pool, got "
                             f"{list(t.shape)}")
        check_dtype(name, t, FLOATS)
    for name, t in (("pages", pages), ("slots", slots)):
        if shape_of(name, t, 1) != (n,):
            raise ValueError(f"{name} must be [N={n}] (one per group of k), got {list(t.shape)}")
        check_dtype(name, t, INTS)
    check_device(pool[0].device, k=k, v=v, pages=pages, slots=slots)
    if n and values_checked(pages):
        if bool(((pages < 0) | (pages >= np_)).any()):
            raise ValueError(f"pages must be page ids in [0, {np_}), got {pages.tolist()}")
        if bool(((slots < 0) | (slots >= p) | (slots % group_size != 0)).any()):
            raise ValueError(f"slots must be multiples of group_size={group_size} in [0, page_size={p}), got "
                             f"{slots.tolist()}")


def check_tables(block_table, lengths, np_: int, p: int, values: bool = True, device=None) -> int:
    """block_table ``[B, W]`` and lengths ``[B]`` integers (on ``device``, the pool's, where given); by value
    (``values`` and :func:`values_checked`): ``0 <= lengths[b] <= W * P`` and the pages of a sequence's tokens (its
    first ``ceil(lengths[b] / P)`` entries) in ``[0, NP)``. Returns B."""
    bsz, width = shape_of("block_table", block_table, 2)
    check_dtype("block_table", block_table, INTS)
    if shape_of("lengths", lengths, 1) != (bsz,):
        raise ValueError(f"lengths must be [B={bsz}] (one per block-table row), got {list(lengths.shape)}")
    check_dtype("lengths", lengths, INTS)
    if device is not None:
        check_device(device, block_table=block_table, lengths=lengths)
    if values:
        table_values(block_table, lengths, np_, p)
    return bsz


def table_values(block_table, lengths, np_: int, p: int) -> None:
    """The by-value part of :func:`check_tables` (where :func:`values_checked`)."""
    width = block_table.shape[1]
    if lengths.numel() and values_checked(lengths):
        ln = lengths.long()
        if bool(((ln < 0) | (ln > width * p)).any()):
            raise ValueError(f"lengths must be in [0, block_table width {width} x page_size {p} = {width * p}], "
                             f"got {lengths.tolist()}")
        used = torch.arange(width, device=ln.device)[None, :] < (ln[:, None] + p - 1) // p
        bt = block_table.to(ln.device)
        if bool((used & ((bt < 0) | (bt >= np_))).any()):
            raise ValueError(f"block_table entries holding a sequence's tokens must be page ids in [0, {np_}) "
                             f"(-1 only past ceil(lengths / page_size)); got {block_table.tolist()}")


def check_max_len(max_len) -> None:
    """dequantize_pages' ``max_len``: None (the longest sequence's length) or an int >= 0."""
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0):
        raise ValueError(f"max_len must be None or an int >= 0 (the output's tokens per sequence), got {max_len!r}")


def check_dequant_out(out, shape: tuple, device) -> tuple:
    """dequantize_pages' ``out``: a pair ``(k, v)`` of floating tensors of ``shape`` ``[B, H, T, D]`` on ``device``,
    last dimension contiguous and the same strides (views of a larger buffer allowed). Returns the pair."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(o, torch.Tensor) for o in out)):
        raise ValueError(f"out must be a pair (k, v) of tensors, got {type(out).__name__}")
    k_out, v_out = out
    if tuple(k_out.shape) != tuple(shape) or tuple(v_out.shape) != tuple(shape):
        raise ValueError(f"out tensors must be [B, H, T, D] = {tuple(shape)}, got {list(k_out.shape)} and "
                         f"{list(v_out.shape)}")
    if k_out.stride(-1) != 1 or v_out.stride(-1) != 1 or k_out.stride() != v_out.stride():
        raise ValueError("out tensors must share strides and have a contiguous last dimension")
    if any(o.dtype not in FLOATS or o.device != device for o in (k_out, v_out)):
        raise ValueError(f"out tensors must be floating ({FLOATS}) on the pool's device {device}, got {k_out.dtype} "
                         f"on {k_out.device} and {v_out.dtype} on {v_out.device}")
    return k_out, v_out


def check_window(bsz: int, h: int, d: int, res_k, res_v, res_lengths, values: bool = True, device=None) -> None:
    """res_k, res_v ``[B, H, C, D]`` floats; res_lengths ``[B]`` integers in ``[0, C]`` (by value, as in
    :func:`check_tables`); all on ``device`` where given."""
    c = shape_of("res_k", res_k, 4)[2]
    for name, t in (("res_k", res_k), ("res_v", res_v)):
        if tuple(t.shape) != (bsz, h, c, d):
            raise ValueError(f"{name} must be [B={bsz}, H={h}, C, D={d}] (the pool's heads and head_dim), got "
                             f"{list(t.shape)} (res_k {list(res_k.shape)})")
        check_dtype(name, t, FLOATS)
    if shape_of("res_lengths", res_lengths, 1) != (bsz,):
        raise ValueError(f"res_lengths must be [B={bsz}], got {list(res_lengths.shape)}")
    check_dtype("res_lengths", res_lengths, INTS)
    if device is not None:
        check_device(device, res_k=res_k, res_v=res_v, res_lengths=res_lengths)
    if values:
        window_values(res_lengths, c)


def window_values(res_lengths, capacity: int, listed: list | None = None) -> None:
    """The by-value part of :func:`check_window`; ``listed``: ``res_lengths.tolist()`` where the caller has it
    (checked then with no tensor operation)."""
    if res_lengths.numel() and values_checked(res_lengths):
        if (min(listed) < 0 or max(listed) > capacity) if listed is not None else bool(
                ((res_lengths < 0) | (res_lengths > capacity)).any()):
            raise ValueError(f"res_lengths must be in [0, window capacity {capacity}], got {res_lengths.tolist()}")


def check_attention(q, block_table, lengths, pool, res_k, res_v, res_lengths, key_bits: int, value_bits: int,
                    group_size: int, values: bool = True) -> None:
    """The decode (q ``[B, Hq, D]``) and prefix (q ``[B, Hq, L, D]``) ops' shared arguments; ``values=False``: shapes,
    dtypes and devices only (:func:`attention_values` then checks the values)."""
    np_, h, p, d = check_pool(pool, key_bits, value_bits, group_size)
    bsz = check_tables(block_table, lengths, np_, p, values, pool[0].device)
    if q.dim() not in (3, 4) or q.shape[0] != bsz or q.shape[-1] != d or q.shape[1] % max(h, 1):
        raise ValueError(f"q must be [B={bsz}, Hq (a multiple of KV heads {h}), (L,) D={d}], got {list(q.shape)}")
    check_dtype("q", q, FLOATS)
    check_device(pool[0].device, q=q)
    check_window(bsz, h, d, res_k, res_v, res_lengths, values, pool[0].device)


def check_sliding_window(sliding_window) -> None:
    """The attention ops' ``sliding_window``: None (every stored token visible) or an int >= 1."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1 (a query sees the last sliding_window "
                         f"positions, its own included), got {sliding_window!r}")


def check_sink_logits(sink_logits, q) -> None:
    """The attention ops' ``sink_logits``: None, or learned attention sinks (GPT-OSS's ``sinks``): a 1-d floating
    tensor of one logit per query head (``[Hq]``) on q's device, a softmax column with no value."""
    if sink_logits is None:
        return
    hq = q.shape[1]
    if not isinstance(sink_logits, torch.Tensor) or tuple(sink_logits.shape) != (hq,):
        got = list(sink_logits.shape) if isinstance(sink_logits, torch.Tensor) else type(sink_logits).__name__
        raise ValueError(f"sink_logits must be None or a [Hq={hq}] tensor (one logit per query head), got {got}")
    check_dtype("sink_logits", sink_logits, FLOATS)
    check_device(q.device, sink_logits=sink_logits)


def check_decode(q, block_table, lengths, pool, res_k, res_v, res_lengths, key_bits: int, value_bits: int,
                 group_size: int, sm_scale, sliding_window, sink_logits, new_k, new_v) -> None:
    """Every argument of the torch paths' ``paged_decode_attention`` (q ``[B, Hq, D]``)."""
    check_attention(q, block_table, lengths, pool, res_k, res_v, res_lengths, key_bits, value_bits, group_size)
    check_sliding_window(sliding_window)
    check_sm_scale(sm_scale)
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {list(q.shape)}")
    check_sink_logits(sink_logits, q)
    check_new_token(new_k, new_v, q, pool[0])


def check_prefix(q, block_table, lengths, pool, res_k, res_v, res_lengths, new_k, new_v, new_mask, key_bits: int,
                 value_bits: int, group_size: int, sm_scale, sliding_window, sink_logits) -> None:
    """Every argument of the torch paths' ``paged_prefix_attention`` (q ``[B, Hq, L, D]``)."""
    check_attention(q, block_table, lengths, pool, res_k, res_v, res_lengths, key_bits, value_bits, group_size)
    check_prefix_chunk(q, new_k, new_v, new_mask, pool[0].shape[1])
    check_sliding_window(sliding_window)
    check_sm_scale(sm_scale)
    check_sink_logits(sink_logits, q)


def check_new_token(new_k, new_v, q, k_codes) -> None:
    """paged_decode_attention's step token: neither, or both of new_k, new_v ``[B, Hkv, D]`` (or ``[B, Hkv, 1, D]``)
    floats on the pool's device (``k_codes``: ``[NP, Hkv, P, D * bits // 8]``)."""
    if new_k is None and new_v is None:
        return
    if new_k is None or new_v is None:
        raise ValueError(f"new_k and new_v must be given together (the step's token), got "
                         f"{'new_k' if new_v is None else 'new_v'} only")
    want = (q.shape[0], k_codes.shape[1], q.shape[-1])
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (new_k, new_v)]
    if shapes[0] not in (want, (*want[:2], 1, want[2])) or shapes[1] != shapes[0]:
        raise ValueError(f"new_k/new_v must be [B={want[0]}, Hkv={want[1]}, D={want[2]}] (or both [B, Hkv, 1, D]); "
                         f"got {shapes[0]} and {shapes[1]}")
    check_dtype("new_k", new_k, FLOATS)
    check_dtype("new_v", new_v, FLOATS)
    check_device(k_codes.device, new_k=new_k, new_v=new_v)


def attention_values(block_table, lengths, k_codes, res_k, res_lengths) -> None:
    """The by-value part of :func:`check_attention` (where :func:`values_checked`)."""
    table_values(block_table, lengths, k_codes.shape[0], k_codes.shape[2])
    window_values(res_lengths, res_k.shape[2])


def check_prefix_chunk(q, new_k, new_v, new_mask, kv_heads: int) -> None:
    """paged_prefix_attention's chunk: new_k, new_v ``[B, Hkv, L, D]`` floats (``kv_heads``: the pool's Hkv),
    new_mask ``[B, L, L]`` bool, on q's device."""
    bsz, _, ql, d = shape_of("q", q, 4)
    for name, t in (("new_k", new_k), ("new_v", new_v)):
        if shape_of(name, t, 4) != (bsz, kv_heads, ql, d):
            raise ValueError(f"{name} must be [B={bsz}, Hkv={kv_heads}, L={ql}, D={d}] like q and the pool, "
                             f"got {list(t.shape)}")
        check_dtype(name, t, FLOATS)
    if shape_of("new_mask", new_mask, 3) != (bsz, ql, ql) or new_mask.dtype != torch.bool:
        raise ValueError(f"new_mask must be a bool [B={bsz}, L={ql}, L={ql}] tensor, got {list(new_mask.shape)} "
                         f"{new_mask.dtype}")
    check_device(q.device, new_k=new_k, new_v=new_v, new_mask=new_mask)


def check_flush(new_k, new_v, res_k, res_v, res_lengths, sink_lengths, lengths, block_table, pool, key_bits: int,
                value_bits: int, group_size: int, residual_length: int, sink_length: int) -> None:
    """append_and_flush's arguments (shapes, dtypes, devices; values as in :func:`check_tables`): a window of capacity
    at least ``sink_length + residual_length + group_size``, written at ``res_lengths``, so those must be below its
    capacity; ``0 <= sink_lengths <= sink_length``; and for each sequence that flushes this step, the page it writes
    (``block_table[b, lengths[b] // P]``: that column must exist) a page id, at a slot ``lengths[b] % P`` that is a
    multiple of G."""
    np_, h, p, d = check_pool(pool, key_bits, value_bits, group_size)
    bsz = check_tables(block_table, lengths, np_, p, device=pool[0].device)
    check_window(bsz, h, d, res_k, res_v, res_lengths, device=pool[0].device)
    for name, t in (("new_k", new_k), ("new_v", new_v)):
        if tuple(t.shape) not in ((bsz, h, d), (bsz, h, 1, d)):
            raise ValueError(f"{name} must be [B={bsz}, H={h}, D={d}] (or [B, H, 1, D]), got {list(t.shape)}")
        check_dtype(name, t, FLOATS)
    if new_v.shape != new_k.shape:
        raise ValueError(f"new_v must be [B={bsz}, H={h}, D={d}] like new_k (or both [B, H, 1, D]), got "
                         f"{list(new_v.shape)} and new_k {list(new_k.shape)}")
    if shape_of("sink_lengths", sink_lengths, 1) != (bsz,):
        raise ValueError(f"sink_lengths must be [B={bsz}], got {list(sink_lengths.shape)}")
    check_dtype("sink_lengths", sink_lengths, INTS)
    check_device(pool[0].device, new_k=new_k, new_v=new_v, res_k=res_k, res_v=res_v, res_lengths=res_lengths,
                 sink_lengths=sink_lengths, lengths=lengths, block_table=block_table)
    for name, n in (("residual_length", residual_length), ("sink_length", sink_length)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    cap = res_k.shape[2]
    if cap < sink_length + residual_length + group_size:
        raise ValueError(f"res_k/res_v must be [B, H, >= sink_length + residual_length + group_size = "
                         f"{sink_length + residual_length + group_size}, D]; got {list(res_k.shape)}")
    if not bsz or not values_checked(res_lengths):
        return
    if bool((res_lengths >= cap).any()):
        raise ValueError(f"res_lengths must be below the window capacity {cap} (the step's token is "
                         f"written there), got {res_lengths.tolist()}")
    if bool(((sink_lengths < 0) | (sink_lengths > sink_length)).any()):
        raise ValueError(f"sink_lengths must be in [0, sink_length={sink_length}], got {sink_lengths.tolist()}")
    s = sink_lengths.long()
    s = torch.where(s < sink_length, s + 1, s)
    full = res_lengths.long() + 1 - s >= residual_length + group_size  # the sequences that flush this step
    if not bool(full.any()):
        return
    ln = lengths.long()
    if bool((full & (ln % group_size != 0)).any()):
        raise ValueError(f"lengths of the sequences that flush this step must be multiples of group_size={group_size} "
                         f"(the group goes to slot lengths % page_size), got {lengths[full].tolist()}")
    col, width = ln // p, block_table.shape[1]
    over = (full & (col >= width)).nonzero()
    if over.numel():  # the last column instead would overwrite the sequence's own newest page
        b = int(over[0, 0])
        raise ValueError(f"block_table has no column for the group sequence {b} flushes this step: lengths[{b}] // "
                         f"page_size = {int(col[b])} must be below the block_table width {width} (a flushing "
                         f"sequence needs lengths < {width * p}), got lengths {lengths.tolist()}")
    page = block_table.long().gather(1, col.clamp(max=width - 1)[:, None])[:, 0]  # (rows that do not flush: unused)
    bad = (full & ((page < 0) | (page >= np_))).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"the block_table entry a flush writes (sequence {b}, column {int(col[b])} = lengths // "
                         f"page_size) must be a page id in [0, {np_}), got {int(page[b])}")

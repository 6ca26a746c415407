"""The decode op, ``paged_decode_attention``, and :class:`DecodeRunner` (the op planned once for many calls).

A call attends one query token per sequence over the quantized pages and the full-precision window with two kernels:
the split kernel (:mod:`.decode_split`, grid ``(B * Hkv, NS + NR)``) writes one partial per program into an fp32
workspace, the merge kernel (:mod:`.decode_merge`, grid ``(B * Hq, D / DB)``) merges them into ``out``; or with one,
where the split kernel's last program of each (sequence, KV head) merges them. What depends only on shapes, dtypes
and settings is planned once per key (:class:`.decode_plan._DecodePlan`, kept in ``_PLANS``); the kernels launch
through :class:`._util.Launcher` (``_SPLIT``, ``_REDUCE``), directly once a plan's kernel is compiled.
"""

from __future__ import annotations

import torch

from . import checks, decode_plan
from . import tuning as _tuning
from ._util import Launcher, check_pool_strides, interpreting, no_launch_hooks
from .decode_merge import _decode_reduce_kernel
from .decode_plan import RESIDENT_DEFAULT, _decode_tuning, _DecodePlan, _resident_of
from .decode_split import _decode_split_kernel

LOG2E = 1.4426950408889634

_PLANS: dict = {}  # plan key -> _DecodePlan; the 32 layers of a decode step share one (same shapes)
_SPLIT = Launcher(_decode_split_kernel)
_REDUCE = Launcher(_decode_reduce_kernel)


def _check_new_token(new_k, new_v, q, res_k, res_v):
    """``new_k``/``new_v`` as ``[B, Hkv, D]`` views with a contiguous last dim (checked by
    :func:`.checks.check_new_token`); the window they are written into checked."""
    if new_k.dim() == 4:
        new_k, new_v = new_k.select(2, 0), new_v.select(2, 0)
    if res_k.stride(-1) != 1 or res_v.stride(-1) != 1:
        raise ValueError("with new_k/new_v the window (res_k/res_v) is written in place: its last dim must be "
                         "contiguous")
    return (new_k if new_k.stride(-1) == 1 else new_k.contiguous(),
            new_v if new_v.stride(-1) == 1 else new_v.contiguous())


def _plan_key(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v, res_lengths,
              out, key_bits, value_bits, group_size, num_splits, new_k, new_v,
              sliding_window=None, sink_logits=None, tuning=None):
    # every tensor's device (each checked on a new key only; new_k/new_v, sink_logits and out on every call)
    return (out.stride(), q.device, block_table.device, lengths.device, res_lengths.device, k_codes.device,
            k_scale.device, k_zero.device, v_codes.device, v_scale.device, v_zero.device, res_k.device, res_v.device,
            q.dtype, q.shape, q.stride(), block_table.shape, block_table.stride(),
            block_table.dtype, lengths.shape, lengths.dtype, res_lengths.shape, res_lengths.dtype, k_codes.shape,
            k_codes.stride(), k_codes.dtype, k_scale.shape, k_scale.stride(), k_scale.dtype, k_zero.shape,
            k_zero.stride(), k_zero.dtype, v_codes.shape, v_codes.stride(), v_scale.shape, v_scale.stride(),
            v_scale.dtype, v_scale.storage_offset() % 2, v_zero.shape, v_zero.stride(), v_zero.dtype,
            v_zero.storage_offset() % 2, res_k.shape, res_k.stride(), res_k.dtype, res_v.shape, res_v.stride(),
            res_v.dtype, key_bits, value_bits, group_size, num_splits,
            type(key_bits), type(value_bits), type(group_size),  # 4.0 == 4: a float is checked (and rejected)
            None if new_k is None else (new_k.stride(), new_k.dtype, new_v.stride(), new_v.dtype), tuning,
            sliding_window, None if sink_logits is None else (sink_logits.dtype, sink_logits.stride()))


_SHARED_WS: dict = {}  # (device index, stream, floats) -> the workspace that DecodeRunners launching there share


def _workspace(plan: _DecodePlan, d: int, device, shared: bool = False):
    """One fp32 workspace for a call: partial outputs first (16-byte aligned), then maxima and sums, each padded to
    4 floats (so all three are 16-byte aligned). ``shared``: one buffer per device, stream and size, kept for the
    :class:`DecodeRunner` s that launch on that stream only (their kernels run one after another there, each
    reading its partials before the next writes them), so a runner's step allocates none."""
    rows, nsp1 = plan.rows, plan.nsp1
    pad = -(-rows * nsp1 // 4) * 4
    n = rows * nsp1 * d + 2 * pad
    if shared:
        stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
        key = (device.index, stream, n)
        ws = _SHARED_WS.get(key)
        if ws is None:
            if len(_SHARED_WS) > 64:  # shapes seen by a long-lived process: keep it bounded (runners keep theirs)
                _SHARED_WS.clear()
            ws = _SHARED_WS[key] = torch.empty(n, dtype=torch.float32, device=device)
    else:
        ws = torch.empty(n, dtype=torch.float32, device=device)
    ws_o = ws[:rows * nsp1 * d].view(rows, nsp1, d)
    ws_m = ws[rows * nsp1 * d:rows * nsp1 * d + rows * nsp1].view(rows, nsp1)
    ws_l = ws[rows * nsp1 * d + pad:rows * nsp1 * d + pad + rows * nsp1].view(rows, nsp1)
    return ws_m, ws_l, ws_o


def _counts(plan: _DecodePlan, device):
    """The merge's arrival counts for the current stream (a kernel leaves them at zero)."""
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    cnt = plan.counters.get(stream)
    if cnt is None:
        cnt = plan.counters[stream] = torch.zeros(plan.pairs, dtype=torch.int32, device=device)
    return cnt


# positions in _split_args' tuple of the tensors that change from call to call (DecodeRunner fills them in)
_A_Q, _A_RLEN, _A_WSM, _A_WSL, _A_WSO, _A_NK, _A_NV, _A_OUT, _A_CNT, _A_SINK = 0, 11, 12, 13, 14, 15, 16, 17, 18, 19


def _split_args(plan, q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v,
                res_lengths, ws_m, ws_l, ws_o, new_k, new_v, out, cnt, sm_scale, sink_logits=None) -> tuple:
    """The split kernel's runtime arguments, in its parameter order (placeholders for the pointers it does not
    read: the window for a missing step token, the window lengths for the merge's counts, the sequence lengths for
    missing sink logits)."""
    return (q, block_table, lengths, k_codes.view(torch.int32), k_scale, k_zero, v_codes.view(torch.int32), v_scale,
            v_zero, res_k, res_v, res_lengths, ws_m, ws_l, ws_o,
            res_k if new_k is None else new_k, res_v if new_k is None else new_v, out, cnt,
            lengths if sink_logits is None else sink_logits, float(sm_scale) * LOG2E,
            *plan.ints,
            *((0, 0, 0, 0) if new_k is None else (new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1))),
            out.stride(0), out.stride(1))


def _reduce_args(plan, ws_m, ws_l, ws_o, out, hq: int, sink_logits=None) -> tuple:
    return (ws_m, ws_l, ws_o, out, ws_m if sink_logits is None else sink_logits, plan.nsp1, out.stride(0),
            out.stride(1), hq)


def paged_decode_attention(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                           res_k, res_v, res_lengths, key_bits: int, value_bits: int, group_size: int,
                           sm_scale: float, *, num_splits: int | None = None, out=None, new_k=None, new_v=None,
                           merge: bool = True, sliding_window: int | None = None, sink_logits=None,
                           tuning: _tuning.DecodeTuning | None = None):
    """Triton twin of :func:`kivi_cache.reference.paged_decode_attention`.

    ``sliding_window``: attention over the last ``sliding_window`` stored tokens only (the splits share only the pages
    holding them; the others are not read). ``sink_logits`` (``[Hq]``): learned attention sinks, added where the
    partials are merged (the split kernel's loop is the same).

    ``new_k``/``new_v`` (``[B, Hkv, D]`` or ``[B, Hkv, 1, D]``): the step's own token, which the kernel writes into the
    window at ``res_lengths[b] - 1`` (the lengths already count it) before attending (the cache's decode step then
    needs no separate window writes).

    q ``[B, Hq, D]``; returns ``[B, Hq, D]`` in q's dtype. ``num_splits`` (an int >= 1)
    overrides the automatic context split (for tests/benchmarks); ``out``
    (``[B, Hq, D]``, q's dtype, last dim contiguous) is written in place if given.
    ``tuning`` (a :class:`~kivi_cache.kernels.tuning.DecodeTuning`; None: ``tuning.DEFAULT.decode``, read at each
    call): the launch settings and policies (the dots' precision and the unpack among them). Everything that depends
    only on shapes and settings is planned once per key
    (:class:`_DecodePlan`, the tuning part of the key); a call then allocates one workspace and makes two launches, or
    one where the split kernel's last program of each (sequence, KV head) merges the partials: at most
    ``merge_max`` (``MERGE_MAX``) of them and, unless ``fuse_merge`` is True (False: never), at most ``MERGE_PAIRS``
    pairs; not while a CUDA graph is captured, nor with ``merge=False``. The in-kernel merge keeps one small tensor of
    arrival counts per plan and stream (allocated by its first call): a caller whose allocations must not outlive the
    call passes ``merge=False``, e.g. a step compiled by ``torch.compile`` with CUDA graphs, whose warm-up runs
    allocate from the graphs' private pool and whose recording fails on a tensor of that pool kept alive
    (``StaticQuantizedPagedCache`` does).
    :class:`DecodeRunner` plans once for many calls.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {list(q.shape)}")
    t = _tuning.DEFAULT.decode if tuning is None else tuning
    checks.check_sliding_window(sliding_window)
    checks.check_sm_scale(sm_scale)
    if sink_logits is not None:
        checks.check_sink_logits(sink_logits, q)
        if sink_logits.stride(-1) != 1:
            sink_logits = sink_logits.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    token = (new_k, new_v)  # checked after the plan's checks (checks.check_new_token)
    if new_k is not None or new_v is not None:
        if new_k is None or new_v is None:
            checks.check_new_token(new_k, new_v, q, k_codes)  # raises: one without the other
        new_k, new_v = _check_new_token(new_k, new_v, q, res_k, res_v)
    if res_k.stride(-1) != 1:
        res_k = res_k.contiguous()
    if res_v.stride(-1) != 1:
        res_v = res_v.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if lengths.stride(-1) != 1:
        lengths = lengths.contiguous()
    if res_lengths.stride(-1) != 1:
        res_lengths = res_lengths.contiguous()
    bsz, hq, d = q.shape
    if out is None:
        out = torch.empty(bsz, hq, d, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != (bsz, hq, d) or out.dtype != q.dtype or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"out must be [B, Hq, D] in q's dtype on q's device with a contiguous last dimension, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}, strides {tuple(out.stride())}")
    key = _plan_key(q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v,
                    res_lengths, out, key_bits, value_bits, group_size, num_splits, new_k,
                    new_v, sliding_window, sink_logits, t)
    plan = _PLANS.get(key)
    if plan is None:  # shapes, dtypes and devices: once per key (their values below, where that needs no sync)
        pool = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
        checks.check_attention(q, block_table, lengths, pool, res_k, res_v, res_lengths, key_bits, value_bits,
                               group_size, values=False)
        check_pool_strides(pool)
        plan = _DecodePlan(q, block_table, k_codes, k_scale, v_codes, v_scale, v_zero, res_k, res_v, key_bits,
                           value_bits, group_size, num_splits, new_k is not None,
                           sliding_window, sink_logits is not None, t)
        if plan.final:
            if len(_PLANS) > 4096:  # shapes seen by a long-lived process: keep the cache bounded
                _PLANS.clear()
            _PLANS[key] = plan
    if not q.is_cuda or checks.CHECK_INDICES:
        checks.attention_values(block_table, lengths, k_codes, res_k, res_lengths)
    if token[0] is not None or token[1] is not None:
        checks.check_new_token(*token, q, k_codes)
    if bsz == 0 or hq == 0:
        return out
    ws_m, ws_l, ws_o = _workspace(plan, d, q.device)
    merge = merge and plan.merge_meta is not None and not (q.is_cuda and torch.cuda.is_current_stream_capturing())
    cnt = _counts(plan, q.device) if merge else res_lengths  # res_lengths: a placeholder pointer unless merging
    fast_key = (key, merge) if plan.final and t.fast_launch else None
    kernel = _SPLIT(fast_key, plan.grid, _split_args(
        plan, q, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v, res_lengths,
        ws_m, ws_l, ws_o, new_k, new_v, out, cnt, sm_scale, sink_logits), plan.merge_meta if merge else plan.meta)
    if not plan.final:
        # through the module: the one table that _DecodePlan reads
        decode_plan._RESIDENT.setdefault(plan.rkey, _resident_of(kernel, q.device) or RESIDENT_DEFAULT)
    if not merge:
        _REDUCE(fast_key, plan.reduce_grid, _reduce_args(plan, ws_m, ws_l, ws_o, out, hq, sink_logits),
                plan.reduce_meta)
    return out


def _cuda_index(t: torch.Tensor) -> int:
    """The CUDA device index of ``t``, -1 on the CPU."""
    return t.get_device()


class _Ready:
    """What :class:`DecodeRunner` keeps from a first run to launch the same kernels again."""

    __slots__ = ("qshape", "qstride", "dtype", "index", "stream", "scale", "tuning", "new", "nk", "nv", "rl_dtype",
                 "align", "split", "reduce", "grid", "reduce_grid", "oshape", "keep", "sink")


class DecodeRunner:
    """The decode op split into plan and run (FlashInfer's style), for a caller that attends over the same pages
    again and again: the cache's layer between two changes of its block table, i.e. every decode step but a flush.

    Built for one block table, lengths, page pool and window (``res_k``/``res_v``); :meth:`run` takes what changes
    per step: the queries, the window lengths, the softmax scale and optionally the step's token (``new_k``/
    ``new_v``) and learned sink logits (``sink_logits``), as in :func:`paged_decode_attention`. The first run is an
    ordinary call of :func:`paged_decode_attention` (it plans, compiles and checks everything). Later runs with the
    same shapes, strides, dtypes, settings, stream and pointer alignment launch the compiled kernels directly with
    the first run's argument list, only the changing pointers replaced: no plan key, no checks of the fixed tensors.
    Otherwise (a CUDA graph being captured, a profiler's launch hook, the interpreter, ``fast_launch`` off,
    ``KIVI_CHECK_INDICES=1``, a change, of the default tuning too) a run is the ordinary call. ``tuning``: as in
    :func:`paged_decode_attention` (None: ``tuning.DEFAULT.decode`` at each run). The fixed tensors may be written
    to, not replaced or resized: build a new runner then (the cache does, whenever its block table or pool tensors
    change).
    """

    def __init__(self, block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v,
                 key_bits: int, value_bits: int, group_size: int, sliding_window: int | None = None, *,
                 tuning: _tuning.DecodeTuning | None = None):
        checks.check_sliding_window(sliding_window)
        self.fixed = (block_table, lengths, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, res_k, res_v)
        self.bits = (key_bits, value_bits, group_size)
        self.sliding_window = sliding_window
        self.tuning = tuning
        # the first runs' launches, one with and one without the step's token (the cache's decode steps pass it, its
        # flush steps do not: one template would be replaced, with an ordinary call, twice per flush)
        self._ready: dict[tuple, _Ready] = {}
        self.fast_runs = 0  # for tests

    def run(self, q, res_lengths, sm_scale: float, new_k=None, new_v=None, sink_logits=None):
        """Attention of one query token per sequence, ``q`` ``[B, Hq, D]``; returns ``[B, Hq, D]``."""
        which = (new_k is None, sink_logits is None)
        t = _tuning.DEFAULT.decode if self.tuning is None else self.tuning
        r = self._ready.get(which)
        if r is not None and r.tuning is t:
            out = self._launch(r, q, res_lengths, sm_scale, new_k, new_v, sink_logits)
            if out is not None:
                return out
        bt, ql, kc, ks, kz, vc, vs, vz, rk, rv = self.fixed
        out = paged_decode_attention(q, bt, ql, kc, ks, kz, vc, vs, vz, rk, rv, res_lengths, *self.bits, sm_scale,
                                     new_k=new_k, new_v=new_v, sliding_window=self.sliding_window,
                                     sink_logits=sink_logits, tuning=t)
        r = self._prepare(q, res_lengths, sm_scale, new_k, new_v, out, sink_logits, t)
        if r is None:
            self._ready.pop(which, None)
        else:
            self._ready[which] = r
        return out

    def _launch(self, r: _Ready, q, rl, sm_scale, new_k, new_v, sink=None):
        """The direct launch, or None where the first run's kernels and arguments do not apply."""
        if (q.shape != r.qshape or q.stride() != r.qstride or q.dtype != r.dtype or sm_scale != r.scale
                or rl.dtype != r.rl_dtype or rl.stride(-1) != 1 or (new_k is None) != (r.new is None)
                or (new_v is None) != (r.new is None) or _cuda_index(rl) != r.index):
            return None  # (a tensor on another device goes the ordinary way, whose checks name it)
        if (sink is None) != (r.sink is None) or (sink is not None and (
                sink.dtype != r.sink[0] or sink.shape != r.sink[1] or sink.stride(-1) != 1
                or _cuda_index(sink) != r.index)):
            return None
        if new_k is not None and (new_v is None or new_k.shape != r.new or new_v.shape != r.new
                                  or new_k.stride() != r.nk or new_v.stride() != r.nv or new_k.dtype != r.dtype
                                  or new_v.dtype != r.dtype or _cuda_index(new_k) != r.index
                                  or _cuda_index(new_v) != r.index):
            return None
        if (torch.cuda.current_device() != r.index or _cuda_index(q) != r.index
                or torch.cuda.is_current_stream_capturing() or not no_launch_hooks()):
            return None
        stream = torch._C._cuda_getCurrentRawStream(r.index)
        if stream != r.stream:
            return None
        qp, rp = q.data_ptr(), rl.data_ptr()
        nkp, nvp = (new_k.data_ptr(), new_v.data_ptr()) if new_k is not None else (0, 0)
        sp = sink.data_ptr() if sink is not None else 0
        if (qp % 16 == 0, rp % 16 == 0, nkp % 16 == 0, nvp % 16 == 0, sp % 16 == 0) != r.align:
            return None
        out = torch.empty(r.oshape, dtype=r.dtype, device=q.device)
        op = out.data_ptr()
        kernel, call, consts = r.split  # the workspace pointers are fixed (the shared workspace of r.stream)
        call[_A_Q], call[_A_RLEN], call[_A_OUT] = qp, rp, op
        if new_k is not None:
            call[_A_NK], call[_A_NV] = nkp, nvp
        if sink is not None:
            call[_A_SINK] = sp
        g0, g1 = r.grid
        kernel.run(g0, g1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *call, *consts)
        if r.reduce is not None:
            kernel, call, consts = r.reduce
            call[3] = op
            if sink is not None:
                call[4] = sp
            g0, g1 = r.reduce_grid
            kernel.run(g0, g1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *call, *consts)
        self.fast_runs += 1
        return out

    def _prepare(self, q, rl, sm_scale, new_k, new_v, out, sink=None, t=None) -> _Ready | None:
        """After an ordinary run under the decode settings ``t``: the compiled kernels and argument lists it used,
        when a direct launch can repeat it (else None: every run stays ordinary)."""
        index = _cuda_index(q)
        t = _decode_tuning(t)
        if (not t.fast_launch or checks.CHECK_INDICES or interpreting() or index < 0
                or torch.cuda.is_current_stream_capturing()):
            return None  # (KIVI_CHECK_INDICES=1: the index values are checked by the ordinary call, on every run)
        bt, ql, kc, ks, kz, vc, vs, vz, rk, rv = self.fixed
        nk3, nv3 = new_k, new_v
        if new_k is not None and new_k.dim() == 4:
            nk3, nv3 = new_k.select(2, 0), new_v.select(2, 0)
        contiguous = (q, bt, ql, rk, rv, rl) + (() if new_k is None else (nk3, nv3)) + (() if sink is None else (sink,))
        if any(t.stride(-1) != 1 for t in contiguous) or index != torch.cuda.current_device():
            return None  # the ordinary call made contiguous copies: nothing to repeat
        key = _plan_key(q, bt, ql, kc, ks, kz, vc, vs, vz, rk, rv, rl, out, *self.bits, None, nk3, nv3,
                        self.sliding_window, sink, t)
        plan = _PLANS.get(key)
        if plan is None or not plan.final or q.shape[0] == 0 or q.shape[1] == 0:
            return None
        merge = plan.merge_meta is not None
        d = q.shape[2]
        ws_m, ws_l, ws_o = _workspace(plan, d, q.device, shared=True)
        cnt = _counts(plan, q.device) if merge else rl
        args = _split_args(plan, q, bt, ql, kc, ks, kz, vc, vs, vz, rk, rv, rl, ws_m, ws_l, ws_o, nk3, nv3, out, cnt,
                           sm_scale, sink)
        split = _SPLIT.compiled((key, merge), args)
        rargs = _reduce_args(plan, ws_m, ws_l, ws_o, out, q.shape[1], sink)
        red = None if merge else _REDUCE.compiled((key, merge), rargs)
        if split is None or (red is None and not merge):
            return None
        r = _Ready()
        r.qshape, r.qstride, r.dtype, r.index = q.shape, q.stride(), q.dtype, index
        r.stream = torch._C._cuda_getCurrentRawStream(r.index)
        r.scale, r.tuning, r.rl_dtype, r.oshape = sm_scale, t, rl.dtype, out.shape
        r.new = None if new_k is None else new_k.shape
        r.nk, r.nv = (None, None) if new_k is None else (new_k.stride(), new_v.stride())
        nkp, nvp = (new_k.data_ptr(), new_v.data_ptr()) if new_k is not None else (0, 0)
        sp = sink.data_ptr() if sink is not None else 0
        r.align = (q.data_ptr() % 16 == 0, rl.data_ptr() % 16 == 0, nkp % 16 == 0, nvp % 16 == 0, sp % 16 == 0)
        r.sink = None if sink is None else (sink.dtype, sink.shape)
        r.keep = (cnt, ws_o)  # the merge's counts and the workspace: their addresses are in the argument lists
        r.grid, r.reduce_grid = plan.grid, plan.reduce_grid

        def template(launch, launch_args):  # the argument list with every tensor as its address
            positions, kernel, consts = launch
            call = list(launch_args)
            for i in positions:
                call[i] = call[i].data_ptr()
            return kernel, call, consts

        r.split = template(split, args)
        r.reduce = None if merge else template(red, rargs)
        return r

"""kernels._util.Launcher (direct launches of a compiled kernel; on unless the tuning's ``fast_launch`` is off)
without a GPU: the argument list it rebuilds is the one Triton's own launch passes, and the decode op's call sites fit
the kernels' parameter layout. On a GPU, tests/test_gpu.py::test_cached_launches_give_the_full_launch_paths_outputs
compares outputs."""

import inspect

import pytest
import torch
import triton

from kivi_cache.kernels import _util as U
from kivi_cache.kernels import decode as D
from kivi_cache.kernels import decode_merge as M
from kivi_cache.kernels import decode_plan as P
from kivi_cache.kernels import decode_split as S
from kivi_cache.kernels import tuning as T


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default


class _Compiled:
    function, packed_metadata = "fn-handle", "packed"

    def __init__(self):
        self.calls = []

    def run(self, *a):
        self.calls.append(a)


class _JIT:
    """Stands in for a JITFunction: params x, n (runtime), BLOCK (constexpr), FLAG (constexpr, default 0)."""

    def __init__(self):
        self.params = [_Param("x"), _Param("n"), _Param("BLOCK"), _Param("FLAG", 0)]
        self.compiled = _Compiled()
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append((grid, args, meta))
            return self.compiled
        return launch


@pytest.fixture
def gpu_like(monkeypatch):
    """The launcher's GPU-only parts made to run here: no interpreter, a fake current stream."""
    monkeypatch.setattr(U, "interpreting", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 1234, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_launcher_launches_the_cached_kernel_with_triton_s_argument_list(gpu_like):
    jit = _JIT()
    launch = U.Launcher(jit)
    x = torch.zeros(8)
    assert launch("plan", (3,), (x, 5), dict(BLOCK=16, num_warps=1)) is jit.compiled  # first: Triton's own launch
    assert len(jit.launches) == 1 and not jit.compiled.calls
    launch("plan", (3, 2), (x, 5), dict(BLOCK=16, num_warps=1))
    assert len(jit.launches) == 1 and launch.fast_launches == 1
    # JITFunction.run ends with kernel.run(grid x 3, stream, function, packed metadata, launch metadata, hooks,
    # *every parameter's value in order: runtime arguments, then constexprs with their defaults); a tensor goes as its
    # address (an int: Triton's launcher then skips its data_ptr call and the driver's pointer query)
    assert jit.compiled.calls == [(3, 2, 1, 1234, "fn-handle", "packed", None, None, None, x.data_ptr(), 5, 16, 0)]
    y = torch.zeros(8)  # another tensor of the same specialization: its own address
    launch("plan", (3,), (y, 7), dict(BLOCK=16, num_warps=1))
    assert jit.compiled.calls[-1][9:] == (y.data_ptr(), 7, 16, 0) and launch.fast_launches == 2


def test_installed_triton_launches_as_the_fast_path_assumes():
    """The direct launch repeats the call ``JITFunction.run`` ends with (Triton 3.6 to 3.9): ``kernel.run(grid x 3,
    stream, function, packed metadata, launch metadata, enter hook, exit hook, *every bound argument)``. Read from
    the installed Triton's source, so a Triton that changes it fails here (the GPU path is not in CI)."""
    import re

    from triton.runtime.jit import JITFunction

    src = re.sub(r"\s+", " ", inspect.getsource(JITFunction.run))
    assert ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, "
            "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())") in src
    assert "bound_args, specialization, options = binder(*args, **kwargs)" in src  # every parameter, in order


def test_launcher_goes_through_triton_for_a_new_key_a_misaligned_pointer_or_a_hook(gpu_like, monkeypatch):
    jit = _JIT()
    launch = U.Launcher(jit)
    x = torch.zeros(8)
    launch("plan", (1,), (x, 5), dict(BLOCK=16))
    launch("other plan", (1,), (x, 5), dict(BLOCK=16))  # another key: Triton's launch, then cached
    odd = torch.zeros(9)[1:]  # 4 bytes past an aligned block: another specialization
    launch("plan", (1,), (odd, 5), dict(BLOCK=16))
    assert len(jit.launches) == 3 and launch.fast_launches == 0
    launch(None, (1,), (x, 5), dict(BLOCK=16))  # no plan: never cached
    assert len(jit.launches) == 4
    from triton import knobs

    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # Triton 3.6+: a chain of hooks; one added (a profiler) disables the direct path
        def profiler_hook(meta):
            return None

        hook.add(profiler_hook)
        try:
            launch("plan", (1,), (x, 5), dict(BLOCK=16))
        finally:
            hook.remove(profiler_hook)
        assert len(jit.launches) == 5 and launch.fast_launches == 0
    launch("plan", (1,), (x, 5), dict(BLOCK=16))
    assert launch.fast_launches == 1


def test_launcher_is_on_by_default_and_off_under_the_interpreter():
    assert T.DEFAULT.decode.fast_launch and T.DEFAULT.quant.fast_launch  # on unless a tuning turns it off
    assert U.interpreting() and not isinstance(S._decode_split_kernel, triton.runtime.JITFunction)
    jit = _JIT()
    launch = U.Launcher(jit)
    x = torch.zeros(8)
    for _ in range(2):
        launch("plan", (1,), (x, 5), dict(BLOCK=16))
    assert len(jit.launches) == 2 and launch.fast_launches == 0  # the tests run under TRITON_INTERPRET=1


def _runtime_params(fn):
    params = list(inspect.signature(fn.fn).parameters.values())
    const = ["constexpr" in str(p.annotation) for p in params]
    n = const.index(True)
    assert not any(const[:n]) and all(const[n:]), "constexprs must follow every runtime parameter"
    return n


def _stored_layer(batch: int):
    """An Int4PagedCache layer holding a 300-token prompt of ``batch`` sequences (2 KV heads, d 64), committed."""
    from kivi_cache import Int4PagedCache

    cache = Int4PagedCache()
    k = torch.randn(batch, 2, 300, 64)
    cache.update(k, k, 0)
    layer = cache.layers[0]
    layer.commit(layer.pending)
    return layer


def test_decode_call_sites_pass_every_runtime_parameter_positionally(monkeypatch):
    """The launcher rebuilds the constexpr values from the parameters after the positional arguments: the decode
    op must pass exactly the runtime parameters positionally and the kernels must declare them first."""
    seen = {}

    def recorder(name):
        def record(plan_key, grid, args, meta):
            seen[name] = (args, meta)
        return record

    monkeypatch.setattr(D, "_SPLIT", recorder("split"))
    monkeypatch.setattr(D, "_REDUCE", recorder("reduce"))
    monkeypatch.setattr(D, "_resident_of", lambda kernel, device: None)
    layer = _stored_layer(1)
    bt, ql, rl = layer._device_state()
    D.paged_decode_attention(torch.randn(1, 4, 64), bt, ql, *layer.pool.args(), layer.res_k, layer.res_v, rl, 4, 4,
                             32, 0.125,  # both kernels (batch 1 merges in the split kernel by default)
                             tuning=T.DecodeTuning(fuse_merge=False))
    for name, fn in (("split", S._decode_split_kernel), ("reduce", M._decode_reduce_kernel)):
        args, meta = seen[name]
        n = _runtime_params(fn)
        assert len(args) == n, (name, len(args), n)
        names = list(inspect.signature(fn.fn).parameters)
        assert set(names[n:]) - set(meta) <= {"NEWKV", "MERGE", "BM", "BSM", "SLIDING", "SINK"}, (name, names[n:], meta)


def test_quantize_call_site_passes_every_runtime_parameter_positionally(monkeypatch):
    from kivi_cache.kernels import quantize as Q

    seen = {}

    def record(plan_key, grid, args, meta):
        seen["q"] = (plan_key, grid, args, meta)

    monkeypatch.setattr(Q, "_QUANT", record)
    from kivi_cache import Int4PagedCache

    cache = Int4PagedCache()
    k = torch.randn(1, 2, 300, 64)
    cache.update(k, k, 0)
    layer = cache.layers[0]
    layer.commit(layer.pending)
    pool = layer.pool.args()
    g = torch.randn(3, 2, 32, 64)
    pages = torch.tensor([0, 1, 2], dtype=torch.int32)
    Q.quantize_and_write(g, g, pages, pages * 0, *pool, 4, 4, 32)
    key, grid, args, meta = seen["q"]
    n = _runtime_params(Q._quantize_write_kernel)
    assert len(args) == n and grid == (3, 2, 2)
    names = list(inspect.signature(Q._quantize_write_kernel.fn).parameters)
    assert set(names[n:]) == set(meta) - {"num_warps"}
    strided = g[:, :, :, :]  # another call with the same shapes and strides has the same key; other strides another
    Q.quantize_and_write(strided, g, pages, pages * 0, *pool, 4, 4, 32)
    assert seen["q"][0] == key
    Q.quantize_and_write(torch.randn(2, 3, 32, 64)[:, :2], g[:2], pages[:2], pages[:2] * 0, *pool, 4, 4, 32)
    assert seen["q"][0] != key
    # the tuning's settings: one program for keys and values, 8 warps (another compiled kernel: another key); with
    # direct launches off, no key (Triton's own launch every call)
    Q.quantize_and_write(g, g, pages, pages * 0, *pool, 4, 4, 32, tuning=T.QuantTuning(split=False, warps=8))
    other, grid, _, meta = seen["q"]
    assert grid == (3, 2, 1) and meta["SPLIT"] == 0 and meta["num_warps"] == 8 and other not in (None, key)
    Q.quantize_and_write(g, g, pages, pages * 0, *pool, 4, 4, 32, tuning=T.QuantTuning(fast_launch=False))
    assert seen["q"][0] is None and seen["q"][1] == (3, 2, 2)
    with pytest.raises(TypeError, match="QuantTuning"):
        Q.quantize_and_write(g, g, pages, pages * 0, *pool, 4, 4, 32, tuning=T.DecodeTuning())


def _fake_decode_kernels(monkeypatch) -> dict:
    """The decode op's split and merge kernels replaced by fake JIT functions with their real parameter lists behind
    the direct launcher, the op's GPU-only host parts made to run here, no plans or residency cached yet. Returns
    the fakes by name ("split", "reduce"): their ``compiled.calls`` hold every direct launch's argument list."""
    jits = {}
    for name, fn in (("split", S._decode_split_kernel), ("reduce", M._decode_reduce_kernel)):
        jit = _JIT()
        jit.params = [_Param(p.name, p.default) for p in inspect.signature(fn.fn).parameters.values()]
        jits[name] = jit
        monkeypatch.setattr(D, "_SPLIT" if name == "split" else "_REDUCE", U.Launcher(jit))
    monkeypatch.setattr(P, "interpreting", lambda: False)  # the plan (_DecodePlan, _use_asm, the split rules)
    monkeypatch.setattr(D, "interpreting", lambda: False)  # DecodeRunner._prepare
    monkeypatch.setattr(D, "_cuda_index", lambda t: 0)
    monkeypatch.setattr(D, "_resident_of", lambda kernel, device: None)
    monkeypatch.setattr(D, "_PLANS", {})
    monkeypatch.setattr(P, "_RESIDENT", {})  # read by _DecodePlan, filled by paged_decode_attention
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return jits


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("new", [False, True])
def test_decode_runner_launches_the_argument_list_of_the_op_s_own_direct_launch(gpu_like, monkeypatch, new, merge):
    """kernels.DecodeRunner's direct launch (a template of the first call's arguments, the changing pointers
    replaced) passes the split and merge kernels exactly what the op's own cached launch passes for the same call,
    the workspace (the one shared by runners on that stream) and the fresh output aside; a changed query layout,
    window-length dtype or setting goes through the ordinary call. On a GPU,
    tests/test_gpu.py::test_decode_runner_equals_the_op_call_for_call compares outputs."""
    jits = _fake_decode_kernels(monkeypatch)
    t = T.DecodeTuning(fuse_merge=merge)  # True: the split kernel merges (no merge kernel launched)
    layer = _stored_layer(2)
    bt, ql, rl = layer._device_state()
    fixed = (bt, ql, *layer.pool.args(), layer.res_k, layer.res_v)
    q = torch.randn(2, 4, 64)
    extra = dict(new_k=torch.randn(2, 2, 1, 64), new_v=torch.randn(2, 2, 1, 64)) if new else {}
    for _ in range(2):  # planned (not final: residency unknown), then planned and cached by the launchers
        D.paged_decode_attention(q, *fixed, rl, 4, 4, 32, 0.125, tuning=t, **extra)
    D.paged_decode_attention(q, *fixed, rl, 4, 4, 32, 0.125, tuning=t, **extra)  # the op's own direct launch
    split = jits["split"].compiled.calls[-1]
    reduce = jits["reduce"].compiled.calls[-1] if not merge else None
    assert len(jits["split"].compiled.calls) == 1 and len(jits["split"].launches) == 2
    assert not jits["reduce"].launches + jits["reduce"].compiled.calls if merge else reduce is not None
    run = D.DecodeRunner(*fixed, 4, 4, 32, tuning=t)
    run.run(q, rl, 0.125, **extra)  # the ordinary call (the launchers' direct path), then prepared
    run.run(q, rl, 0.125, **extra)
    assert run.fast_runs == 1 and len(jits["split"].compiled.calls) == 3
    mine = jits["split"].compiled.calls[-1]
    lead = 9  # grid x 3, stream, function, metadata, three hooks
    fresh = {lead + D._A_WSM, lead + D._A_WSL, lead + D._A_WSO, lead + D._A_OUT}
    assert len(mine) == len(split)
    for i, (x, y) in enumerate(zip(split, mine, strict=True)):
        if i not in fresh:
            assert x == y, i
    # the workspace's three parts at the op's offsets, the merge kernel reading them and writing the new output
    assert mine[lead + D._A_WSM] - mine[lead + D._A_WSO] == split[lead + D._A_WSM] - split[lead + D._A_WSO]
    assert mine[lead + D._A_WSL] - mine[lead + D._A_WSO] == split[lead + D._A_WSL] - split[lead + D._A_WSO]
    if not merge:
        mine_r = jits["reduce"].compiled.calls[-1]
        assert mine_r[lead:lead + 4] == (mine[lead + D._A_WSM], mine[lead + D._A_WSL], mine[lead + D._A_WSO],
                                         mine[lead + D._A_OUT])
        assert mine_r[lead + 4] == mine_r[lead]  # no sink logits: the partial maxima stand in for them (unread)
        assert mine_r[:lead] == reduce[:lead] and mine_r[lead + 5:] == reduce[lead + 5:]
    else:  # the arrival counts: the plan's, as in the op's own launch (compared above); no merge kernel
        assert not jits["reduce"].launches + jits["reduce"].compiled.calls
    q2, rl2 = torch.randn(2, 4, 64), rl.clone()  # another query, window lengths, token: their own addresses
    extra2 = {k: torch.randn_like(v) for k, v in extra.items()}
    run.run(q2, rl2, 0.125, **extra2)
    last = jits["split"].compiled.calls[-1]
    assert run.fast_runs == 2 and last[lead + D._A_Q] == q2.data_ptr() and last[lead + D._A_RLEN] == rl2.data_ptr()
    # the workspace: the same shared buffer every run (and for another runner of the same shapes)
    assert [last[lead + i] for i in (D._A_WSM, D._A_WSL, D._A_WSO)] == [mine[lead + i] for i in
                                                                        (D._A_WSM, D._A_WSL, D._A_WSO)]
    shared = {t.data_ptr() for t in D._SHARED_WS.values()}
    assert mine[lead + D._A_WSO] in shared
    other = D.DecodeRunner(*fixed, 4, 4, 32, tuning=t)
    other.run(q, rl, 0.125, **extra)
    other.run(q, rl, 0.125, **extra)
    assert other.fast_runs == 1 and jits["split"].compiled.calls[-1][lead + D._A_WSO] == mine[lead + D._A_WSO]
    if new:
        assert (last[lead + D._A_NK], last[lead + D._A_NV]) == (extra2["new_k"].data_ptr(), extra2["new_v"].data_ptr())
    for changed in (dict(q=torch.randn(2, 64, 4).transpose(1, 2)), dict(rl=rl.long()), dict(scale=0.5)):
        n = len(jits["split"].launches) + len(jits["split"].compiled.calls)
        run.run(changed.get("q", q), changed.get("rl", rl), changed.get("scale", 0.125), **extra)
        assert run.fast_runs == 2, changed  # the ordinary call
        assert len(jits["split"].launches) + len(jits["split"].compiled.calls) == n + 1
    if new:
        run.run(q, rl, 0.125)  # without the token: another plan (the ordinary call), then its own template
        assert run.fast_runs == 2
        run.run(q, rl, 0.125)
        assert run.fast_runs == 3 and jits["split"].compiled.calls[-1][lead + D._A_NK] != extra["new_k"].data_ptr()
        run.run(q, rl, 0.5, **extra)  # with the token again: its template (the last one, scale 0.5) kept
        assert run.fast_runs == 4 and jits["split"].compiled.calls[-1][lead + D._A_NK] == extra["new_k"].data_ptr()


@pytest.mark.parametrize("merge", [False, True])
def test_decode_runner_replaces_the_sink_logits_pointer(gpu_like, monkeypatch, merge):
    """With learned sink logits the runner's direct launch passes the call's sink tensor to the kernel that merges
    (the split kernel's last program, or the merge kernel), compiled with SINK; runs without sinks keep their own
    template (no SINK)."""
    jits = _fake_decode_kernels(monkeypatch)
    layer = _stored_layer(2)
    bt, ql, rl = layer._device_state()
    fixed = (bt, ql, *layer.pool.args(), layer.res_k, layer.res_v)
    q = torch.randn(2, 4, 64)
    run = D.DecodeRunner(*fixed, 4, 4, 32, tuning=T.DecodeTuning(fuse_merge=merge))
    merger = jits["split" if merge else "reduce"]
    slot = D._A_SINK if merge else 4
    lead = 9
    for _ in range(3):  # planned, cached by the launchers, then prepared
        run.run(q, rl, 0.125, sink_logits=torch.zeros(4))
    sinks = torch.randn(4)
    fast = run.fast_runs
    run.run(q, rl, 0.125, sink_logits=sinks)
    assert run.fast_runs == fast + 1
    fn = S._decode_split_kernel if merge else M._decode_reduce_kernel
    flag = lead + list(inspect.signature(fn.fn).parameters).index("SINK")  # constexprs follow the runtime arguments
    call = merger.compiled.calls[-1]
    assert call[lead + slot] == sinks.data_ptr() and call[flag] == 1
    run.run(q, rl, 0.125)  # without sinks: the ordinary call, its own plan without SINK
    run.run(q, rl, 0.125)
    assert merger.compiled.calls[-1][flag] == 0
    run.run(q, rl, 0.125, sink_logits=sinks.half())  # another dtype: the ordinary call (a new plan)
    assert run.fast_runs == fast + 2


def test_decode_runner_follows_the_default_tuning_and_fast_launch_off_launches_through_triton(gpu_like, monkeypatch):
    """A runner built without a tuning runs under ``tuning.DEFAULT`` as it is at each run: a changed default goes
    through the ordinary call (planned under the new settings), then direct again. ``fast_launch=False`` (the op's
    tuning or the runner's): every launch through Triton's own path, no cached kernel, no direct run."""
    jits = _fake_decode_kernels(monkeypatch)
    layer = _stored_layer(2)
    bt, ql, rl = layer._device_state()
    fixed = (bt, ql, *layer.pool.args(), layer.res_k, layer.res_v)
    q = torch.randn(2, 4, 64)
    monkeypatch.setattr(T, "DEFAULT", T.Tuning(decode=T.DecodeTuning(fuse_merge=False)))
    run = D.DecodeRunner(*fixed, 4, 4, 32)
    for _ in range(3):  # planned (residency unknown), planned and prepared, then direct
        run.run(q, rl, 0.125)
    assert run.fast_runs == 1 and jits["reduce"].compiled.calls  # the default's setting: the merge kernel
    monkeypatch.setattr(T, "DEFAULT", T.Tuning(decode=T.DecodeTuning(fuse_merge=True)))
    n = len(jits["reduce"].launches) + len(jits["reduce"].compiled.calls)
    run.run(q, rl, 0.125)
    assert run.fast_runs == 1  # the ordinary call under the new default: the split kernel merges
    assert len(jits["reduce"].launches) + len(jits["reduce"].compiled.calls) == n
    assert any(pl.merge_meta is not None and key[-3] is T.DEFAULT.decode for key, pl in D._PLANS.items())
    run.run(q, rl, 0.125)
    assert run.fast_runs == 2 and len(jits["reduce"].launches) + len(jits["reduce"].compiled.calls) == n
    off = T.DecodeTuning(fast_launch=False)
    for runner_tuning in (None, off):  # off through the default, then through the runner's own tuning
        monkeypatch.setattr(T, "DEFAULT", T.Tuning(decode=off if runner_tuning is None else T.DecodeTuning()))
        slow = D.DecodeRunner(*fixed, 4, 4, 32, tuning=runner_tuning)
        direct, triton_launches = len(jits["split"].compiled.calls), len(jits["split"].launches)
        for i in range(3):
            slow.run(q, rl, 0.125)
            D.paged_decode_attention(q, *fixed, rl, 4, 4, 32, 0.125, tuning=off)
            assert len(jits["split"].launches) == triton_launches + 2 * (i + 1)
        assert slow.fast_runs == 0 and len(jits["split"].compiled.calls) == direct
    with pytest.raises(TypeError, match="DecodeTuning"):
        D.paged_decode_attention(q, *fixed, rl, 4, 4, 32, 0.125, tuning=T.Tuning())

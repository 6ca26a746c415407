"""Bad arguments to the op API (kivi_cache.kernels and kivi_cache.reference alike): a ValueError naming the parameter,
raised before anything is written (kivi_cache.kernels.checks). Unchecked, the kernels would write out of bounds (heap
corruption for a pool with fewer heads than k), read past the block table or the window, or give a silent wrong
answer."""

from __future__ import annotations

import os

import pytest
import torch

from kivi_cache import reference as R
from kivi_cache.kernels import api as K

D, G, P = 64, 32, 64
DT = torch.float16
I32 = torch.int32
# KIVI_TEST_GPU=1 (no interpreter): every tensor on CUDA, so the good-argument calls that set a test up reach the real
# launcher with device pointers (CPU tensors there fail the setup with Triton's "cpu tensor?"). The cases'
# module-level tensors move in the tests (dev); meta tensors stay on meta.
DEV = "cuda" if os.environ.get("KIVI_TEST_GPU") == "1" else "cpu"


@pytest.fixture(autouse=True)
def _on_the_test_device(monkeypatch):
    """Tensors built on DEV; on CUDA with the index values checked as under ``KIVI_CHECK_INDICES=1`` (without it a
    GPU checks shapes, dtypes and devices only: kivi_cache.kernels.checks). Without it a page past the pool would go
    unchecked, and the reference's out-of-bounds index would fire a device assert that fails every later test."""
    if DEV == "cuda":
        from kivi_cache.kernels import checks

        monkeypatch.setattr(checks, "CHECK_INDICES", True)  # the one switch, read by the kernels and the torch side
    with torch.device(DEV):
        yield


def dev(x):
    """``x`` (a tensor, or a tuple/dict of them) on the test device; meta tensors and other values unchanged."""
    if isinstance(x, torch.Tensor):
        return x if x.is_meta else x.to(DEV)
    if isinstance(x, tuple):
        return tuple(dev(t) for t in x)
    if isinstance(x, dict):
        return {k: dev(v) for k, v in x.items()}
    return x


def pool(np_=3, h=1, kb=4, vb=4):
    return [torch.randint(0, 256, (np_, h, P, D * kb // 8), dtype=torch.uint8),
            torch.rand(np_, h, P // G, D).to(DT), torch.randn(np_, h, P // G, D).to(DT),
            torch.randint(0, 256, (np_, h, D, P * vb // 8), dtype=torch.uint8),
            torch.rand(np_, h, D // G, P).to(DT), torch.randn(np_, h, D // G, P).to(DT)]


def unchanged(before, after):
    return all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def ints(*xs):
    return torch.tensor(xs, dtype=I32)


WRITE_CASES = {  # name: (k heads, pages, slots, pool bits, k dtype) -> the parameter named
    "heads": ((2, ints(0), ints(0), 4, DT), "k must be"),
    "page_past_pool": ((1, ints(3), ints(0), 4, DT), "pages must be page ids in \\[0, 3\\)"),
    "page_minus_1": ((1, ints(-1), ints(0), 4, DT), "pages must be page ids"),
    "slot_misaligned": ((1, ints(0), ints(16), 4, DT), "slots must be multiples of group_size=32"),
    "slot_past_page": ((1, ints(0), ints(64), 4, DT), "slots must be"),
    "pages_per_group": ((1, ints(0, 1), ints(0, 0), 4, DT), "pages must be \\[N=1\\]"),
    "pool_bits": ((1, ints(0), ints(0), 2, DT), "k_codes must be"),
    "k_dtype": ((1, ints(0), ints(0), 4, torch.int32), "k must have dtype"),
    "pages_dtype": ((1, ints(0).float(), ints(0), 4, DT), "pages must have dtype"),
}


@pytest.mark.parametrize("mod", [K, R], ids=["kernels", "reference"])
@pytest.mark.parametrize("case", list(WRITE_CASES))
def test_quantize_and_write_rejects_bad_arguments_before_writing(mod, case):
    (h, pages, slots, bits, dtype), match = dev(WRITE_CASES[case])
    pl = pool(kb=bits, vb=bits)
    before = [t.clone() for t in pl]
    kv = torch.randn(pages.shape[0] if case != "pages_per_group" else 1, h, G, D).to(dtype)
    with pytest.raises(ValueError, match=match):
        mod.quantize_and_write(kv, kv, pages, slots, *pl, 4, 4, G)
    assert unchanged(before, pl)


def decode_args(**over):
    a = dict(q=torch.randn(2, 2, D).to(DT), block_table=ints(0, 1, 2, -1).view(2, 2), lengths=ints(96, 32),
             pool=pool(4), res_k=torch.randn(2, 1, 8, D).to(DT), res_v=torch.randn(2, 1, 8, D).to(DT),
             res_lengths=ints(3, 5))
    a.update(over)
    return a


DECODE_CASES = {
    "length_past_table": (dict(block_table=ints(0, 2).view(2, 1)), "lengths must be in \\[0, block_table width 1"),
    "minus_1_inside_length": (dict(block_table=ints(0, -1, 2, -1).view(2, 2)), "block_table entries"),
    "negative_length": (dict(lengths=ints(96, -5)), "lengths must be in"),
    "window_length_past_capacity": (dict(res_lengths=ints(3, 12)), "res_lengths must be in \\[0, window capacity 8"),
    "window_heads": (dict(res_k=torch.randn(2, 2, 8, D).to(DT), res_v=torch.randn(2, 2, 8, D).to(DT)), "res_k must"),
    "lengths_per_row": (dict(lengths=ints(96)), "lengths must be \\[B=2\\]"),
    "window_lengths_per_row": (dict(res_lengths=ints(3)), "res_lengths must be \\[B=2\\]"),
    "pool_bits": (dict(pool=pool(4, kb=2, vb=2)), "k_codes must be"),
    "q_device": (dict(q=torch.randn(2, 2, D, device="meta").to(DT)), "q is on meta"),
    "table_device": (dict(block_table=ints(0, 1, 2, -1).view(2, 2).to("meta")), "block_table is on meta"),
    "window_device": (dict(res_lengths=ints(3, 5).to("meta")), "res_lengths is on meta"),
}


@pytest.mark.parametrize("mod", [K, R], ids=["kernels", "reference"])
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_rejects_bad_arguments_before_writing(mod, case):
    over, match = DECODE_CASES[case]
    a = decode_args(**dev(over))
    new = torch.randn(2, a["res_k"].shape[1], D).to(DT)
    before = [a["res_k"].clone(), a["res_v"].clone()]
    with pytest.raises(ValueError, match=match):
        mod.paged_decode_attention(a["q"], a["block_table"], a["lengths"], *a["pool"], a["res_k"], a["res_v"],
                                   a["res_lengths"], 4, 4, G, 0.125, new_k=new, new_v=new)
    assert unchanged(before, [a["res_k"], a["res_v"]]), "the window was written before the error"


@pytest.mark.parametrize("mod", [K, R], ids=["kernels", "reference"])
def test_prefix_and_dequantize_reject_bad_arguments(mod):
    a = decode_args()
    q = torch.randn(2, 2, 3, D).to(DT)
    new = torch.randn(2, 1, 3, D).to(DT)
    mask = torch.ones(2, 3, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="new_mask must be a bool \\[B=2, L=3, L=3\\]"):
        mod.paged_prefix_attention(q, a["block_table"], a["lengths"], *a["pool"], a["res_k"], a["res_v"],
                                   a["res_lengths"], new, new, mask, 4, 4, G, 0.125)
    with pytest.raises(ValueError, match="lengths must be in"):
        mod.dequantize_pages(a["block_table"], ints(-32, 0), *a["pool"], 4, 4, G)
    with pytest.raises(ValueError, match="block_table is on meta"):  # not NotImplementedError from reading it
        mod.dequantize_pages(a["block_table"].to("meta"), a["lengths"], *a["pool"], 4, 4, G)


@pytest.mark.parametrize("mod", [K, R], ids=["kernels", "reference"])
@pytest.mark.parametrize("which", [2, 5], ids=["k_zero", "v_zero"])
def test_zero_points_must_have_their_scales_dtype(mod, which):
    a = decode_args()
    pl = list(a["pool"])
    pl[which] = pl[which].float()
    name, scale = ("k_zero", "k_scale") if which == 2 else ("v_zero", "v_scale")
    with pytest.raises(ValueError, match=f"{name} must have {scale}'s dtype"):
        mod.dequantize_pages(a["block_table"], a["lengths"], *pl, 4, 4, G)


@pytest.mark.parametrize("mod", [K, R], ids=["kernels", "reference"])
@pytest.mark.parametrize("heads", [2, 3])
def test_prefix_chunk_heads_must_be_the_pools(mod, heads):
    """new_k/new_v carry the pool's KV heads (1 here): 2 (which Hq=2 divides) or 3 (which it does not) are refused by
    name (not with torch's RuntimeError from inside the op)."""
    a = decode_args()
    q = torch.randn(2, 2, 3, D).to(DT)
    new = torch.randn(2, heads, 3, D).to(DT)
    mask = torch.ones(2, 3, 3, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="new_k must be \\[B=2, Hkv=1, L=3, D=64\\]"):
        mod.paged_prefix_attention(q, a["block_table"], a["lengths"], *a["pool"], a["res_k"], a["res_v"],
                                   a["res_lengths"], new, new, mask, 4, 4, G, 0.125)


@pytest.mark.parametrize("mod", [K, R], ids=["kernels", "reference"])
def test_dequantize_out_tensors_must_share_strides(mod):
    a = decode_args()
    k = torch.empty(2, 1, 96, D, dtype=DT)
    v = torch.empty(2, 1, 104, D, dtype=DT)[:, :, :96]  # same shape, another token stride
    with pytest.raises(ValueError, match="out tensors must share strides"):
        mod.dequantize_pages(a["block_table"], a["lengths"], *a["pool"], 4, 4, G, out=(k, v))


@pytest.mark.skipif(DEV != "cpu", reason="about CPU tensors without the interpreter")
def test_triton_backend_on_cpu_without_the_interpreter_says_why(monkeypatch):
    """set_backend('triton') with CPU tensors and no interpreter: a clear error, not Triton's '0 active drivers'."""
    from kivi_cache import ops

    monkeypatch.setattr(ops._load_kernels(), "interpreting", lambda: False)  # as where the kernels were built for a GPU
    a = decode_args()
    ops.set_backend("triton")
    try:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            ops.paged_decode_attention(a["q"], a["block_table"], a["lengths"], a["pool"], res_k=a["res_k"],
                                       res_v=a["res_v"], res_lengths=a["res_lengths"], key_bits=4, value_bits=4,
                                       group_size=G, sm_scale=0.125)
    finally:
        ops.set_backend("auto")


def zero_points_strided_apart(pl, which):
    """``pl`` with its key (``which=2``) or value (``which=5``) zero points a view of a tensor of two heads: the same
    values and shape as before, other strides than their scales'."""
    pl = list(pl)
    pl[which] = torch.cat([pl[which], torch.zeros_like(pl[which])], dim=1)[:, :1]
    return pl


@pytest.mark.parametrize("which", [2, 5], ids=["k_zero", "v_zero"])
def test_kernels_reject_zero_points_strided_unlike_their_scales(which):
    """The kernels index each zero-point tensor with its scales' strides, so a k_zero/v_zero view strided otherwise
    is refused: it would give a silent wrong answer (decode, dequantize) or be written in the wrong places
    (quantize_and_write; the same with the scales the wider one: heap corruption)."""
    name = ("k_zero", "v_zero")[which == 5]
    pl = zero_points_strided_apart(pool(4), which)
    a = decode_args(pool=pl)
    with pytest.raises(ValueError, match=f"{name} must have .*strides"):
        K.paged_decode_attention(a["q"], a["block_table"], a["lengths"], *pl, a["res_k"], a["res_v"],
                                 a["res_lengths"], 4, 4, G, 0.125)
    with pytest.raises(ValueError, match=f"{name} must have .*strides"):
        K.dequantize_pages(a["block_table"], a["lengths"], *pl, 4, 4, G)
    before = [t.clone() for t in pl]
    kv = torch.randn(1, 1, G, D).to(DT)
    with pytest.raises(ValueError, match=f"{name} must have .*strides"):
        K.quantize_and_write(kv, kv, ints(0), ints(0), *pl, 4, 4, G)
    assert unchanged(before, pl)


@pytest.mark.parametrize("which", range(6), ids=["k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"])
def test_kernels_reject_a_pool_tensor_without_a_contiguous_last_dim(which):
    """Every kernel reads the pool's rows as contiguous: a tensor that is not raises a ValueError naming it
    (unchecked, dequantize_pages would give a silent wrong answer and decode a RuntimeError of ``view`` or an unnamed
    message)."""
    name = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")[which]
    pl = pool(4)
    pl[which] = pl[which].transpose(2, 3).contiguous().transpose(2, 3)
    a = decode_args(pool=pl)
    with pytest.raises(ValueError, match=f"{name} must have a contiguous last dimension"):
        K.dequantize_pages(a["block_table"], a["lengths"], *pl, 4, 4, G)
    with pytest.raises(ValueError, match=f"{name} must have a contiguous last dimension"):
        K.paged_decode_attention(a["q"], a["block_table"], a["lengths"], *pl, a["res_k"], a["res_v"],
                                 a["res_lengths"], 4, 4, G, 0.125)


NEW_TOKEN_CASES = {  # name: (new_k, new_v) -> the error
    "new_v_missing": (lambda n: (n, None), "new_k and new_v must be given together"),
    "new_k_missing": (lambda n: (None, n), "new_k and new_v must be given together"),
    "int_dtype": (lambda n: (n.int(), n.int()), "new_k must have dtype"),
    "new_v_dtype": (lambda n: (n, n.to(torch.float64)), "new_v must have dtype"),
    "head_dim": (lambda n: (n[..., :32], n[..., :32]), "new_k/new_v must be \\[B=2, Hkv=1, D=64\\]"),
    "device": (lambda n: (n.to("meta"), n.to("meta")), "new_k is on meta"),
    "mixed_dims": (lambda n: (n[:, :, None], n), "new_k/new_v must be"),
}


@pytest.mark.parametrize("mod", [K, R], ids=["kernels", "reference"])
@pytest.mark.parametrize("case", list(NEW_TOKEN_CASES))
def test_decode_rejects_a_bad_step_token_before_writing(mod, case):
    """paged_decode_attention's new_k/new_v (the step's token, written into the window): checked like the other
    arguments: a missing half, another dtype or device, or a wrong shape is a ValueError naming it, from the kernels
    and the reference alike, raised before the window is written."""
    make, match = NEW_TOKEN_CASES[case]
    a = decode_args()
    new_k, new_v = make(torch.randn(2, 1, D).to(DT))
    before = [a["res_k"].clone(), a["res_v"].clone()]
    with pytest.raises(ValueError, match=match):
        mod.paged_decode_attention(a["q"], a["block_table"], a["lengths"], *a["pool"], a["res_k"], a["res_v"],
                                   a["res_lengths"], 4, 4, G, 0.125, new_k=new_k, new_v=new_v)
    assert unchanged(before, [a["res_k"], a["res_v"]]), "the window was written before the error"


def test_ops_pass_a_lone_new_v_on():
    """kivi_cache.ops (op and DecodeRunner): new_v without new_k reaches the checks (dropped, the step's value would
    never be written, with no error)."""
    from kivi_cache import ops

    a = decode_args()
    new = torch.randn(2, 1, D).to(DT)
    kw = dict(res_k=a["res_k"], res_v=a["res_v"], key_bits=4, value_bits=4, group_size=G)
    with pytest.raises(ValueError, match="new_k and new_v must be given together"):
        ops.paged_decode_attention(a["q"], a["block_table"], a["lengths"], a["pool"], res_lengths=a["res_lengths"],
                                   sm_scale=0.125, new_v=new, **kw)
    run = ops.DecodeRunner(a["block_table"], a["lengths"], a["pool"], **kw)
    with pytest.raises(ValueError, match="new_k and new_v must be given together"):
        run(a["q"], a["res_lengths"], 0.125, new_v=new)


@pytest.mark.parametrize("name", ["block_table", "lengths", "res_lengths", "res_k", "k_zero", "out"])
def test_decode_kernel_checks_devices_also_when_it_reuses_a_plan(name):
    """The kernels' decode op plans once per key (shapes, strides, dtypes, settings) and checks on a new key only:
    the key held q's device alone, so after a good call a block table, lengths, window or pool tensor (or ``out``) on
    another device reached the kernel unchecked (here NotImplementedError; on a GPU a host pointer)."""
    a = decode_args()
    args = dict(q=a["q"], block_table=a["block_table"], lengths=a["lengths"], res_k=a["res_k"], res_v=a["res_v"],
                res_lengths=a["res_lengths"])
    pl = list(a["pool"])

    def call(**kw):
        return K.paged_decode_attention(args["q"], args["block_table"], args["lengths"], *pl, args["res_k"],
                                        args["res_v"], args["res_lengths"], 4, 4, G, 0.125, **kw)

    call(out=torch.empty_like(a["q"]))  # plans
    kw = {}
    if name == "out":
        kw["out"] = torch.empty_like(a["q"], device="meta")
    elif name == "k_zero":
        pl[2] = pl[2].to("meta")
    else:
        args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=f"{name} .*meta"):
        call(**kw)


def flush_args(**over):
    """append_and_flush's arguments: window capacity 42 = sinks 2 + residual 8 + group 32; sequence 0's window is full
    after this step's token (a flush into page block_table[0, lengths[0] // P] at slot lengths[0] % P)."""
    cap = 2 + 8 + G
    new = torch.randn(2, 1, D).to(DT)
    a = dict(new_k=new, new_v=new, res_k=torch.randn(2, 1, cap, D).to(DT),
             res_v=torch.randn(2, 1, cap, D).to(DT), res_lengths=ints(cap - 1, 5), sink_lengths=ints(2, 2),
             lengths=ints(96, 32), block_table=ints(0, 1, -1, 2, -1, -1).view(2, 3), pool=pool(4))
    a.update(over)
    return a


FLUSH_CASES = {
    # the flushing sequence's next page entry is -1: unchecked, the kernel would write at page -1 (heap corruption)
    # and the reference write the window, then raise
    "page_minus_1": (dict(lengths=ints(128, 32)), "block_table entry .*sequence 0.*column 2.* -1"),
    # a flush at slot lengths % P = 36, no multiple of G: the kernel would write the group across the page's end
    "misaligned": (dict(lengths=ints(100, 32)), "lengths .*flush.* multiples of group_size=32.*\\[100\\]"),
    # a negative sink count: the flush read and moved window rows before the window's start
    "negative_sinks": (dict(sink_lengths=ints(-5, 2)), "sink_lengths must be in \\[0, sink_length=2\\]"),
    # more sinks than sink_length: the flush would keep rows past the sinks' place in the window as sinks
    "sinks_past_sink_length": (dict(sink_lengths=ints(5, 2)), "sink_lengths must be in \\[0, sink_length=2\\]"),
    # the reference took a window too small for its sinks, residual and group
    "capacity": (dict(res_k=torch.randn(2, 1, 41, D).to(DT), res_v=torch.randn(2, 1, 41, D).to(DT),
                      res_lengths=ints(3, 5)), "res_k/res_v must be \\[B, H, >= sink_length \\+ residual_length"),
    # new_k [B, H, 1, D], new_v [B, H, D]: the reference wrote res_k, then failed on res_v with torch's RuntimeError;
    # the kernels named the shapes after dropping new_k's token axis from both ([2, 1] for new_v)
    "token_shapes": (dict(new_k=torch.randn(2, 1, 1, D).to(DT)), "new_v must be \\[B=2, H=1, D=64\\] like new_k"),
}


@pytest.mark.parametrize("mod", [K, R], ids=["kernels", "reference"])
@pytest.mark.parametrize("case", list(FLUSH_CASES))
def test_append_and_flush_checks_where_it_flushes_before_writing(mod, case):
    over, match = FLUSH_CASES[case]
    a = flush_args(**dev(over))
    state = [*a["pool"], a["res_k"], a["res_v"]]
    before = [t.clone() for t in state]
    with pytest.raises(ValueError, match=match):
        mod.append_and_flush(a["new_k"], a["new_v"], a["res_k"], a["res_v"], a["res_lengths"], a["sink_lengths"],
                             a["lengths"], a["block_table"], *a["pool"], 4, 4, G, 8, 2)
    assert unchanged(before, state), "written before the error"


SCALAR_CASES = {  # unchecked, the reference would fail inside torch (NotImplementedError: "rshift_cpu" not implemented
    # for 'Float'; TypeError), the kernels take 4.0 and 32.0 silently on a plan made for 4 and 32, or say "could not
    # convert string to float", and group_size=32.0 be said not to divide head_dim 64
    "key_bits_float": (dict(key_bits=4.0), "key_bits must be one of \\(2, 4, 8\\), got 4.0"),
    "value_bits_str": (dict(value_bits="4"), "value_bits must be one of \\(2, 4, 8\\), got '4'"),
    "group_size_float": (dict(group_size=32.0), "group_size must be an int >= 1 .*got 32.0"),
    "sm_scale_str": (dict(sm_scale="0.125"), "sm_scale must be a real number"),
    "sm_scale_none": (dict(sm_scale=None), "sm_scale must be a real number"),
}


@pytest.mark.parametrize("mod", [K, R], ids=["kernels", "reference"])
@pytest.mark.parametrize("case", list(SCALAR_CASES))
def test_attention_rejects_bad_scalar_arguments(mod, case):
    over, match = SCALAR_CASES[case]
    a = decode_args()
    s = dict(key_bits=4, value_bits=4, group_size=G, sm_scale=0.125)
    head = (a["q"], a["block_table"], a["lengths"], *a["pool"], a["res_k"], a["res_v"], a["res_lengths"])
    mod.paged_decode_attention(*head, *s.values())  # a plan for the good arguments (the kernels)
    s.update(over)
    with pytest.raises(ValueError, match=match):
        mod.paged_decode_attention(*head, *s.values())
    q = a["q"][:, :, None]
    new = torch.randn(2, 1, 1, D).to(DT)
    with pytest.raises(ValueError, match=match):
        mod.paged_prefix_attention(q, *head[1:], new, new, torch.ones(2, 1, 1, dtype=torch.bool), *s.values())


@pytest.mark.parametrize("case", ["dtype", "device"])
def test_kernel_dequantize_pages_checks_its_out_tensors(case):
    """kernels.dequantize_pages(out=(k, v)): floating tensors on the pool's device, else a ValueError naming out
    (unchecked, integer outputs would be filled with truncated values, and outputs on another device raise
    NotImplementedError here, on a GPU Triton's error about a CPU pointer)."""
    a = decode_args()
    bad = dict(dtype=dict(dtype=torch.int8), device=dict(dtype=DT, device="meta"))[case]
    out = (torch.empty(2, 1, 96, D, **bad), torch.empty(2, 1, 96, D, **bad))
    with pytest.raises(ValueError, match="out tensors must be"):
        K.dequantize_pages(a["block_table"], a["lengths"], *a["pool"], 4, 4, G, out=out)


@pytest.mark.parametrize("mod", [K, R], ids=["kernels", "reference"])
@pytest.mark.parametrize("name", ["new_k", "new_v", "new_mask"])
def test_prefix_checks_the_chunks_devices(mod, name):
    """paged_prefix_attention's chunk (new_k, new_v, new_mask) on another device: a ValueError naming it (not torch's
    RuntimeError from torch.cat in the reference, nor, in the kernels, a copy across devices or, here,
    NotImplementedError)."""
    a = decode_args()
    chunk = dict(new_k=torch.randn(2, 1, 3, D).to(DT), new_v=torch.randn(2, 1, 3, D).to(DT),
                 new_mask=torch.ones(2, 3, 3, dtype=torch.bool))
    chunk[name] = chunk[name].to("meta")
    with pytest.raises(ValueError, match=f"{name} is on meta"):
        mod.paged_prefix_attention(torch.randn(2, 2, 3, D).to(DT), a["block_table"], a["lengths"], *a["pool"],
                                   a["res_k"], a["res_v"], a["res_lengths"], *chunk.values(), 4, 4, G, 0.125)


def test_auto_backend_reports_a_bad_argument_as_such(monkeypatch):
    """kivi_cache.ops in "auto" on a GPU chooses the backend before the call (by the configuration,
    ``checks.kernel_limits``), so a bad argument is the chosen backend's ValueError alone: no fallback warning, and no
    second try on the torch path. A pool laid out otherwise than the kernels read it (zero points strided apart from
    their scales) is such an argument for the kernels: a ValueError naming the tensor, while the torch path takes it.
    (The kernels under the interpreter stand in for CUDA here.)"""
    import warnings

    from kivi_cache import ops, torch_ops

    monkeypatch.setattr(ops, "_impl", lambda device_type, *config: K)
    monkeypatch.setattr(ops, "_warned", set())
    a = decode_args(res_lengths=ints(3, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="res_lengths must be in"):
            ops.paged_decode_attention(a["q"], a["block_table"], a["lengths"], a["pool"], res_k=a["res_k"],
                                       res_v=a["res_v"], res_lengths=a["res_lengths"], key_bits=4, value_bits=4,
                                       group_size=G, sm_scale=0.125)
        pl = zero_points_strided_apart(pool(4), 2)
        a = decode_args(pool=pl)
        with pytest.raises(ValueError, match="must have .*'s strides"):
            ops.paged_decode_attention(a["q"], a["block_table"], a["lengths"], pl, res_k=a["res_k"],
                                       res_v=a["res_v"], res_lengths=a["res_lengths"], key_bits=4, value_bits=4,
                                       group_size=G, sm_scale=0.125)
    assert not ops._warned
    args = (a["q"], a["block_table"], a["lengths"], *pl, a["res_k"], a["res_v"], a["res_lengths"], 4, 4, G, 0.125)
    out = torch_ops.paged_decode_attention(*args)  # the torch path takes any strides
    ref = R.paged_decode_attention(*args)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-3


def test_own_state_skips_index_values_only_there(monkeypatch):
    """checks.own_state (the cache's calls on its own tables) skips the by-value index checks, in its thread only,
    and restores the previous state on the way out (an exception included); shapes are still checked there, and
    KIVI_CHECK_INDICES (checks.CHECK_INDICES) checks the values anyway."""
    import threading

    import kivi_cache.checks
    from kivi_cache.kernels import checks

    assert kivi_cache.checks.own_state is checks.own_state  # the public name (README) is the checks' own switch
    if DEV == "cuda":  # (the fixture turns CHECK_INDICES on there)
        monkeypatch.setattr(checks, "CHECK_INDICES", False)
    lengths = torch.tensor([40], dtype=I32, device="cpu")
    bad_table = torch.tensor([[7]], dtype=I32, device="cpu")  # page 7 of a 3-page pool
    with pytest.raises(ValueError, match="block_table entries"):
        checks.check_tables(bad_table, lengths, 3, P)
    seen = []
    with checks.own_state():
        checks.check_tables(bad_table, lengths, 3, P)  # not checked by value
        with pytest.raises(ValueError, match="lengths must be"):
            checks.check_tables(bad_table, lengths[:0], 3, P)  # shapes still are
        other = threading.Thread(target=lambda: seen.append(checks.values_checked(lengths)))
        other.start()
        other.join()
        monkeypatch.setattr(checks, "CHECK_INDICES", True)
        with pytest.raises(ValueError, match="block_table entries"):
            checks.check_tables(bad_table, lengths, 3, P)
        monkeypatch.setattr(checks, "CHECK_INDICES", False)
    assert seen == [True]  # another thread checks as before
    with pytest.raises(RuntimeError), checks.own_state():
        raise RuntimeError
    with pytest.raises(ValueError, match="block_table entries"):
        checks.check_tables(bad_table, lengths, 3, P)


@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
def test_append_and_flush_refuses_a_flush_past_the_block_table(backend):
    """Sequence 0 (192 tokens, 3 pages, a 3-column table) flushes a group into column 192 // P = 3, which its table
    lacks: refused by every backend ("auto" on the CPU: the torch path), nothing written. Writing into the last column
    instead would replace 32 stored tokens of the sequence's own newest page, with no error."""
    from kivi_cache import ops

    a = flush_args(lengths=ints(192, 32), block_table=ints(0, 1, 3, 2, -1, -1).view(2, 3))
    state = [*a["pool"], a["res_k"], a["res_v"]]
    before = [t.clone() for t in state]

    def flush(lengths):
        ops.append_and_flush(a["new_k"], a["new_v"], a["res_k"], a["res_v"], a["res_lengths"], a["sink_lengths"],
                             lengths, a["block_table"], a["pool"], key_bits=4, value_bits=4, group_size=G,
                             residual_length=8, sink_length=2)

    ops.set_backend(backend)
    try:
        with pytest.raises(ValueError, match="block_table has no column .*sequence 0.*lengths\\[0\\] // page_size = 3 "
                                             "must be below the block_table width 3"):
            flush(a["lengths"])
        assert unchanged(before, state), "written before the error"
        flush(ints(160, 32))  # column 2 (page 3, slot 32): the table's last column, there to be written
    finally:
        ops.set_backend("auto")
    assert not unchanged(before, state)


BAD_SCALES = {"zero": 0.0, "negative": -1.0, "nan": float("nan"), "inf": float("inf"), "minus_inf": -float("inf"),
              "tensor_zero": torch.tensor(0.0, device="cpu")}


@pytest.mark.parametrize("mod", [K, "torch_ops", R], ids=["kernels", "torch_ops", "reference"])
@pytest.mark.parametrize("case", list(BAD_SCALES))
def test_attention_refuses_an_sm_scale_not_finite_and_positive(mod, case):
    """sm_scale 0, negative, nan or inf (the kernels' output would be all NaN, the torch paths' finite garbage):
    refused by the decode op (before writing the step's token), the prefix op and the runners (after a good first
    run: the torch path's later runs skip the fixed tensors' checks)."""
    from kivi_cache import torch_ops

    mod = torch_ops if mod == "torch_ops" else mod
    scale = BAD_SCALES[case]
    a = decode_args()
    head = (a["q"], a["block_table"], a["lengths"], *a["pool"], a["res_k"], a["res_v"], a["res_lengths"])
    new = torch.randn(2, 1, D).to(DT)
    before = [a["res_k"].clone(), a["res_v"].clone()]
    match = "sm_scale must be a finite number > 0"
    with pytest.raises(ValueError, match=match):
        mod.paged_decode_attention(*head, 4, 4, G, scale, new_k=new, new_v=new)
    assert unchanged(before, [a["res_k"], a["res_v"]]), "the window was written before the error"
    chunk = torch.randn(2, 1, 1, D).to(DT)
    with pytest.raises(ValueError, match=match):
        mod.paged_prefix_attention(a["q"][:, :, None], *head[1:], chunk, chunk, torch.ones(2, 1, 1, dtype=torch.bool),
                                   4, 4, G, scale)
    if mod is not R:
        run = mod.DecodeRunner(*head[1:-1], 4, 4, G)
        run.run(a["q"], a["res_lengths"], 0.125)
        with pytest.raises(ValueError, match=match):
            run.run(a["q"], a["res_lengths"], scale)


@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
def test_ops_decode_runner_refuses_an_sm_scale_not_finite_and_positive(backend):
    """kivi_cache.ops.DecodeRunner, whichever runner or op it holds, after a good first run."""
    from kivi_cache import ops

    a = decode_args()
    ops.set_backend(backend)
    try:
        run = ops.DecodeRunner(a["block_table"], a["lengths"], a["pool"], res_k=a["res_k"], res_v=a["res_v"],
                               key_bits=4, value_bits=4, group_size=G)
        run(a["q"], a["res_lengths"], 0.125)
        for scale in BAD_SCALES.values():
            with pytest.raises(ValueError, match="sm_scale must be a finite number > 0"):
                run(a["q"], a["res_lengths"], scale)
    finally:
        ops.set_backend("auto")
    run(a["q"], a["res_lengths"], torch.tensor(0.125, device="cpu"))  # a one-element tensor: its value checked


@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_torch_path_runner_checks_its_table_again_after_an_in_place_write(monkeypatch, inference):
    """The torch path's DecodeRunner checks its block table and lengths once, then again on the run after an in-place
    write to either (their version counter; inference tensors keep none: every run), without an error for a valid
    one (the cache's flush advances the lengths with add_); the window lengths on every run. Unchecked, an invalid
    page id fails inside torch (IndexError), and a length past the table or a window length past the window's
    capacity reads the wrong tokens."""
    from kivi_cache import torch_ops

    with torch.inference_mode(inference):
        _runner_after_in_place_writes(monkeypatch, torch_ops)


def _runner_after_in_place_writes(monkeypatch, torch_ops):
    a = decode_args()
    bt, ln, rl, q = a["block_table"], a["lengths"], a["res_lengths"], a["q"]
    run = torch_ops.DecodeRunner(bt, ln, *a["pool"], a["res_k"], a["res_v"], 4, 4, G)
    op = torch_ops.paged_decode_attention

    def same_as_the_op():
        out = run.run(q, rl, 0.125)
        return torch.equal(out, op(q, bt, ln, *a["pool"], a["res_k"], a["res_v"], rl, 4, 4, G, 0.125))

    assert same_as_the_op()
    # every later run is the runner's own (no ordinary call, whose checks would see the values anyway)
    monkeypatch.setattr(torch_ops, "paged_decode_attention", None)
    ln.add_(32)  # [128, 64]: inside the table
    assert same_as_the_op()
    bt[0, 1] = 7  # page 7 of a 4-page pool
    with pytest.raises(ValueError, match="block_table entries .* page ids in \\[0, 4\\)"):
        run.run(q, rl, 0.125)
    bt[0, 1] = 1
    ln.add_(32)  # [160, 96]: past the 2-column table
    with pytest.raises(ValueError, match="lengths must be in \\[0, block_table width 2"):
        run.run(q, rl, 0.125)
    ln.sub_(32)
    assert same_as_the_op()
    with pytest.raises(ValueError, match="res_lengths must be in \\[0, window capacity 8\\]"):
        run.run(q, ints(3, 12), 0.125)
    assert run.fast_runs == 2


@pytest.mark.skipif(DEV != "cuda", reason="the kernels' direct launches run on a GPU only")
def test_kernel_runner_checks_every_run_with_the_debug_switch():
    """KIVI_CHECK_INDICES=1 (the fixture's setting on CUDA) checks the index values of every call: the kernels'
    DecodeRunner then makes each run the op's ordinary call, so a length written in place past the table is refused
    on the next run (a direct launch checks nothing and would read the next row's pages)."""
    a = decode_args()
    run = K.DecodeRunner(a["block_table"], a["lengths"], *a["pool"], a["res_k"], a["res_v"], 4, 4, G)
    run.run(a["q"], a["res_lengths"], 0.125)
    run.run(a["q"], a["res_lengths"], 0.125)
    a["lengths"][0] = 160  # column 2 of a 2-column table
    with pytest.raises(ValueError, match="lengths must be in \\[0, block_table width 2"):
        run.run(a["q"], a["res_lengths"], 0.125)
    assert run.fast_runs == 0


def test_ops_take_the_pool_as_one_object():
    """``kivi_cache.ops`` takes the pool's six tensors as one argument (a PoolTensors or a tuple); anything else is a
    ValueError naming ``pool``, before anything runs."""
    from kivi_cache import ops
    from kivi_cache.kernels.checks import PoolTensors

    a = decode_args()
    kw = dict(res_k=a["res_k"], res_v=a["res_v"], res_lengths=a["res_lengths"], key_bits=4, value_bits=4,
              group_size=G, sm_scale=0.125)
    named = ops.paged_decode_attention(a["q"], a["block_table"], a["lengths"], PoolTensors(*a["pool"]), **kw)
    assert torch.equal(named, ops.paged_decode_attention(a["q"], a["block_table"], a["lengths"], tuple(a["pool"]),
                                                         **kw))
    for bad in (tuple(a["pool"])[:5], a["pool"][0], None):
        with pytest.raises(ValueError, match="pool must be the page pool's six tensors"):
            ops.paged_decode_attention(a["q"], a["block_table"], a["lengths"], bad, **kw)
        with pytest.raises(ValueError, match="pool must be the page pool's six tensors"):
            ops.DecodeRunner(a["block_table"], a["lengths"], bad, res_k=a["res_k"], res_v=a["res_v"], key_bits=4,
                             value_bits=4, group_size=G)

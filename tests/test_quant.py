import pytest
import torch
from kernel_cases import DEV, make_pool

from kivi_cache import quant
from kivi_cache import reference as ref
from kivi_cache.kernels import api as K


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip_and_documented_layout(bits):
    d = 64
    codes = torch.randint(0, 1 << bits, (3, 7, d), dtype=torch.uint8)
    packed = quant.pack(codes, bits)
    assert packed.shape == (3, 7, d * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack(packed, bits), codes)
    n = 8 // bits
    # byte j holds channel j + k * D / n in bits [k*bits, (k+1)*bits)
    for k in range(n):
        chunk = (packed.to(torch.int32) >> (k * bits)) & ((1 << bits) - 1)
        assert torch.equal(chunk.to(torch.uint8), codes[..., k * d // n:(k + 1) * d // n])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_tokens_roundtrip_and_documented_layout(bits):
    n, t = 8 // bits, 64
    codes = torch.randint(0, 1 << bits, (3, 5, t), dtype=torch.uint8)  # [..., channel, token]
    packed = quant.pack_tokens(codes, bits)
    assert packed.shape == (3, 5, t * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack_tokens(packed, bits), codes)
    # byte p of word w, bits [k*bits, (k+1)*bits), holds token 4n w + 2 (p % 2 + 2 k) + p // 2
    for w in range(t // (4 * n)):
        for p in range(4):
            byte = packed[..., 4 * w + p].to(torch.int32)
            for k in range(n):
                tok = 4 * n * w + 2 * (p % 2 + 2 * k) + p // 2
                assert torch.equal(((byte >> (k * bits)) & ((1 << bits) - 1)).to(torch.uint8), codes[..., tok])


def _step_bound(x, deq, scale, expand):
    err = (x.float() - deq.float()).abs()
    half_step = expand(scale.float()) / 2
    # scale and zero are rounded to the storage dtype; allow that rounding on top of half a step
    eps = torch.finfo(scale.dtype).eps
    slack = eps * (x.float().abs() + expand(scale.float())) * 4
    return err, half_step + slack


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_key_roundtrip_within_half_step(dtype, bits):
    g = 32
    k = (torch.randn(2, 3, 96, 64) * 3 + torch.randn(1, 1, 1, 64) * 5).to(dtype)
    codes, scale, zero = quant.quantize_keys(k, bits, g)
    assert scale.shape == zero.shape == (2, 3, 3, 64) and scale.dtype == dtype
    deq = quant.dequantize_keys(codes, scale, zero, g)
    err, bound = _step_bound(k, deq, scale, lambda s: s.repeat_interleave(g, dim=-2))
    assert (err <= bound).all(), (err - bound).max()
    assert err.max() > 0  # the test can fail: quantization is lossy at these widths


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_value_roundtrip_within_half_step(dtype, bits):
    g = 32
    v = (torch.randn(2, 3, 17, 64) * 2).to(dtype)
    codes, scale, zero = quant.quantize_values(v, bits, g)
    assert scale.shape == (2, 3, 17, 2)
    deq = quant.dequantize_values(codes, scale, zero, g)
    err, bound = _step_bound(v, deq, scale, lambda s: s.repeat_interleave(g, dim=-1))
    assert (err <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_constant_groups_are_exact_and_finite(dtype):
    k = torch.full((1, 2, 32, 64), 0.3, dtype=dtype)
    k[0, 1] = -7.25
    for bits in (2, 4, 8):
        c, s, z = quant.quantize_keys(k, bits, 32)
        assert torch.equal(quant.dequantize_keys(c, s, z, 32), k)
        c, s, z = quant.quantize_values(k, bits, 32)
        out = quant.dequantize_values(c, s, z, 32)
        assert torch.isfinite(out).all() and torch.equal(out, k)


@pytest.mark.parametrize("store", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_into_a_coarser_store_dtype(store, bits):
    """fp32 data stored with fp16/bf16 scales and zero points (what ``quantize_and_write`` accepts): the zero point
    rounds to the store dtype, possibly above the group's minimum, so codes must still be clamped to ``[0, qmax]``
    (no uint8 wrap-around), scales are never negative, and the error stays within half a step plus the zero's
    rounding. A group within the zero's rounding of a constant gets scale 0."""
    qm = quant.qmax(bits)
    c, s, z = quant.quantize_keys(torch.tensor([[1000.3], [1001.0]]), 4, 2, torch.float16)
    assert c.flatten().tolist() == [0, 15]  # 1000.3 - zero (1000.5) is below zero: code 0, not a wrapped 250
    c, s, z = quant.quantize_keys(torch.tensor([[1000.3], [1000.4]]), 4, 2, torch.float16)
    assert s.item() == 0.0 and z.item() == 1000.5
    x = torch.randn(3, 64, 64, generator=torch.Generator().manual_seed(bits)) * 0.3 + 1000.0
    for fn, deq, dim in ((quant.quantize_keys, quant.dequantize_keys, -2),
                         (quant.quantize_values, quant.dequantize_values, -1)):
        codes, scale, zero = fn(x, bits, 32, store)
        assert scale.dtype == zero.dtype == store and int(codes.max()) <= qm and (scale >= 0).all()
        out = deq(codes, scale, zero, 32, torch.float32)
        groups = x.unflatten(dim, (-1, 32))
        below = (zero.float() - groups.amin(dim=dim)).clamp_min(0)  # how far the zero rounded above the minimum
        bound = ((scale.float() / 2 + below).repeat_interleave(32, dim=dim)) + 1e-3
        assert ((x - out).abs() <= bound).all()


def _edge_groups(dtype, big, g=32, d=64):
    """``[2, 2, G, D]`` random data with key channels and value tokens reaching +-big: spanning ``[-big, big]``,
    from 0 up to big, near -big, and random in ``[0, big]``."""
    x = torch.randn(2, 2, g, d, device=DEV) * 3
    x[0, 0, :, 0] = big * (-1.0) ** torch.arange(g)
    x[0, 0, :, 1] = big * torch.linspace(0, 1, g)
    x[0, 1, :, 2] = -big * (1 - torch.rand(g) / 100)
    x[0, 1, :, 3] = big * torch.rand(g)
    x[1, 0, 4] = big * (-1.0) ** torch.arange(d)
    x[1, 0, 5] = big * torch.linspace(-0.5, 1, d)
    x[1, 1, 6] = big * torch.rand(d)
    return x.to(dtype)


def _roundtrips(x, bits, store=None, g=32):
    """(dequantized, scale broadcast to the input) of ``x`` quantized as keys and as values (reference)."""
    c, s, z = quant.quantize_keys(x, bits, g, store)
    yield quant.dequantize_keys(c, s, z, g), s.repeat_interleave(g, dim=-2)
    c, s, z = quant.quantize_values(x, bits, g, store)
    yield quant.dequantize_values(c, s, z, g), s.repeat_interleave(g, dim=-1)


@pytest.mark.parametrize("dtype,store,big", [(torch.float16, torch.float16, 65504.0),
                                             (torch.float32, torch.float32, 3e38),
                                             (torch.bfloat16, torch.bfloat16, 3e38),
                                             (torch.float32, torch.float16, 1e6)])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_groups_past_the_range_bound_saturate_finite(dtype, store, big, bits):
    """Groups reaching +-65504 in fp16 (the scale rounded up put the top code past 65504), spanning +-3e38 (max - min
    overflows fp32), or fp32 data past fp16's range stored with fp16 scales: clamped to +-C (``quant.range_bound``
    of the store dtype), then within half a step (+ roundings) of the clamped input; finite everywhere, and so is
    the decode kernel's folded zero point ``zero - 2**bits * scale`` in the store dtype."""
    bounds = [quant.range_bound(t) for t in (torch.float16, torch.bfloat16, torch.float32)]
    assert bounds == [2.0**14, 2.0**126, 2.0**126]
    x = _edge_groups(dtype, big)
    c = quant.range_bound(store)
    for deq, scale in _roundtrips(x, bits, store):
        assert torch.isfinite(deq).all() and (deq.float().abs() <= 3 * c).all()
        err, bound = _step_bound(x.float().clamp(-c, c), deq, scale, lambda s: s)
        assert (err <= bound).all(), (err - bound).max()
    for fn in (quant.quantize_keys, quant.quantize_values):
        _, scale, zero = fn(x, bits, 32, store)
        assert (zero.to(store) - scale.to(store) * 2**bits).isfinite().all()


def _write_both(k, v, kb, vb, g=32):
    """k, v ``[N, H, G, D]`` written into pages ``0 .. N - 1`` (one group a page) by the Triton kernel and by the
    reference: asserts the two pools hold the same bytes (NaN where NaN); returns each pool's (k, v) as its own
    backend dequantizes them (kernel first)."""
    n, h, _, d = k.shape
    base = tuple(t.fill_(float("nan")) if t.is_floating_point() else t
                 for t in make_pool(n, h, g, d, g, kb, vb, k.dtype))
    pages, slots = torch.arange(n, device=DEV), torch.zeros(n, dtype=torch.long, device=DEV)
    bt, lengths = torch.arange(n, dtype=torch.int32, device=DEV)[:, None], torch.full((n,), g, device=DEV)
    pools, out = [], []
    for mod in (K, ref):
        pools.append(tuple(t.clone() for t in base))
        mod.quantize_and_write(k, v, pages, slots, *pools[-1], kb, vb, g)
        out.append(mod.dequantize_pages(bt, lengths, *pools[-1], kb, vb, g))
    for a, b in zip(*pools, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    return out


@pytest.mark.parametrize("dtype,big", [(torch.float16, 65504.0), (torch.bfloat16, 3e38), (torch.float32, 3e38)])
@pytest.mark.parametrize("kb,vb", [(2, 4), (8, 2), (4, 8)])
def test_kernel_matches_reference_at_the_range_edges(dtype, big, kb, vb):
    """The Triton quantize_and_write clamps as the reference: the same bytes, finite outputs."""
    x = _edge_groups(dtype, big)
    for deq_k, deq_v in _write_both(x, x.flip(2), kb, vb):
        assert torch.isfinite(deq_k).all() and torch.isfinite(deq_v).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_non_finite_inputs_make_exactly_their_groups_nan_on_every_backend(dtype):
    """A NaN or +-inf element makes its group NaN (keys: its channel's G tokens; values: its token's G channels),
    in the reference and the Triton kernel alike; every other group stays finite."""
    g = 32
    x = torch.randn(2, 2, g, 64, device=DEV).to(dtype)
    x[0, 0, 3, 5] = float("nan")
    x[0, 1, 31, 40] = float("inf")
    x[1, 0, 0, 63] = -float("inf")
    x[1, 1, 10, 0] = float("nan")
    x[1, 1, 10, 1] = float("inf")
    bad = ~x.isfinite()
    keys = bad.any(2, keepdim=True).expand_as(x)
    values = bad.unflatten(-1, (-1, g)).any(-1, keepdim=True).expand(*x.shape[:-1], -1, g).flatten(-2)
    for bits in (2, 4, 8):
        for deq_k, deq_v in _write_both(x, x, bits, bits):
            assert torch.equal(deq_k.isnan(), keys) and torch.equal(deq_v.isnan(), values)
            assert deq_k[~keys].isfinite().all() and deq_v[~values].isfinite().all()
        c, s, z = quant.quantize_keys(x, bits, g)
        assert torch.equal(quant.dequantize_keys(c, s, z, g).isnan(), keys) and not c[keys].any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sink_channels_carry_the_sink_to_fp32(dtype):
    """A learned sink carried as a key on extra channels: ``hi + lo`` times ``sm_scale`` gives the sink to fp32
    accuracy (``hi`` alone, rounded to fp16/bf16, would not), the other channels are zeros."""
    sinks = torch.randn(9, generator=torch.Generator().manual_seed(1)) * 4
    for sm_scale in (0.125, 1 / 96**0.5):
        ch = ref.sink_channels(sinks, sm_scale, dtype)
        assert ch.shape == (9, ref.SINK_CHANNELS) and ch.dtype == dtype and not ch[:, 2:].any()
        err = ((ch[:, 0].float() + ch[:, 1].float()) * sm_scale - sinks).abs()
        assert (err <= 1e-5 * sinks.abs().clamp_min(1)).all(), err.max()
        assert ((ch[:, 0].float() * sm_scale - sinks).abs() > 1e-5 * sinks.abs().clamp_min(1)).any()


def test_codes_use_full_range():
    x = torch.linspace(-1, 1, 32).repeat(1, 1, 64, 1).transpose(-1, -2).contiguous()  # [1,1,32,64]
    codes, _, _ = quant.quantize_keys(x, 4, 32)
    assert codes.min() == 0 and codes.max() == 15


def test_paged_write_then_dequantize_matches_direct_quantization():
    h, d, g, p, kb, vb = 3, 64, 32, 64, 4, 2
    pool = [torch.zeros(5, h, p, d * kb // 8, dtype=torch.uint8), torch.zeros(5, h, p // g, d),
            torch.zeros(5, h, p // g, d), torch.zeros(5, h, d, p * vb // 8, dtype=torch.uint8),
            torch.zeros(5, h, d // g, p), torch.zeros(5, h, d // g, p)]
    k = torch.randn(3, h, g, d)
    v = torch.randn(3, h, g, d)
    ref.quantize_and_write(k, v, torch.tensor([4, 4, 1]), torch.tensor([0, 32, 0]), *pool, kb, vb, g)
    bt = torch.tensor([[4, -1], [1, -1]])
    dk, dv = ref.dequantize_pages(bt, torch.tensor([64, 32]), *pool, kb, vb, g)
    c, s, z = quant.quantize_keys(torch.cat([k[0], k[1]], 1), kb, g)
    assert torch.allclose(dk[0], quant.dequantize_keys(c, s, z, g))
    c, s, z = quant.quantize_values(v[2], vb, g)
    assert torch.allclose(dv[1, :, :32], quant.dequantize_values(c, s, z, g))
    assert (dk[1, :, 32:] == 0).all()


def test_dequantize_pages_zeroes_positions_past_each_length_over_poisoned_pages():
    """Slots past a sequence's length hold anything (here NaN scales): the reference returns zeros there, for the
    shorter sequences of a batch and for a max_len past every length; equal lengths need no masking."""
    h, d, g, p, kb, vb = 2, 64, 32, 64, 4, 4
    pool = [torch.randint(0, 256, (4, h, p, d * kb // 8), dtype=torch.uint8),
            torch.full((4, h, p // g, d), float("nan")), torch.full((4, h, p // g, d), float("nan")),
            torch.randint(0, 256, (4, h, d, p * vb // 8), dtype=torch.uint8),
            torch.full((4, h, d // g, p), float("nan")), torch.full((4, h, d // g, p), float("nan"))]
    k = torch.randn(3, h, g, d)
    ref.quantize_and_write(k, k, torch.tensor([2, 2, 0]), torch.tensor([0, 32, 0]), *pool, kb, vb, g)
    bt = torch.tensor([[2], [0]])
    dk, dv = ref.dequantize_pages(bt, torch.tensor([64, 32]), *pool, kb, vb, g)
    assert not dk.isnan().any() and not dv.isnan().any()
    assert (dk[1, :, 32:] == 0).all() and (dv[1, :, 32:] == 0).all()
    dk, dv = ref.dequantize_pages(bt[:1], torch.tensor([32]), *pool, kb, vb, g, max_len=64)
    assert (dk[0, :, 32:] == 0).all() and (dv[0, :, 32:] == 0).all() and not dk.isnan().any()
    dk, _ = ref.dequantize_pages(bt, torch.tensor([32, 32]), *pool, kb, vb, g)  # equal lengths: no masking needed
    assert dk.shape[2] == 32 and not dk.isnan().any()

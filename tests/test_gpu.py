"""End-to-end checks on a CUDA device (skipped without one): the Triton path inside generate."""

import pytest
import torch
from models import SMALL, decisive_prompt, steps_with_reorder, tiny_llama_d64, window_written_by_copies
from transformers import DynamicCache

import kivi_cache
from kivi_cache import QuantizedPagedCache, cache_kwargs
from kivi_cache.config import preset_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _auto_backend():
    kivi_cache.set_backend("auto")
    yield
    kivi_cache.set_backend("auto")


def _gen(model, ids, cache, n=32):
    with torch.no_grad():
        return model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=n, min_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("make", [tiny_llama_d64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernels_match_reference_inside_generate(make, dtype):
    model = make()
    ids = decisive_prompt(model, 70, margin=0.01).cuda()
    model = model.to("cuda", dtype)
    outs = {}
    for backend in ("triton", "torch"):
        kivi_cache.set_backend(backend)
        outs[backend] = _gen(model, ids, QuantizedPagedCache(key_bits=8, value_bits=8, **dict(SMALL, page_size=64)))
    ref = _gen(model, ids, DynamicCache())
    new = slice(ids.shape[1], None)
    agree_ref = (outs["triton"][:, new] == ref[:, new]).float().mean().item()
    agree_torch = (outs["triton"][:, new] == outs["torch"][:, new]).float().mean().item()
    print(f"{make.__name__} {dtype}: triton==torch {agree_torch:.2f}, triton==DynamicCache {agree_ref:.2f}")
    assert agree_torch > 0.9 and agree_ref > 0.9


@pytest.mark.parametrize("bits", [4, 2])
def test_step_logits_close_to_reference_backend(bits):
    model = tiny_llama_d64().to("cuda", torch.float16)
    ids = torch.randint(0, 128, (3, 150), device="cuda")
    logits = {}
    for backend in ("triton", "torch"):
        kivi_cache.set_backend(backend)
        cache = QuantizedPagedCache(key_bits=bits, value_bits=bits, **dict(SMALL, page_size=64))
        with torch.no_grad():
            model(ids[:, :50], **cache_kwargs(model, cache))
            logits[backend] = torch.cat([model(ids[:, t:t + 1], **cache_kwargs(model, cache)).logits
                                         for t in range(50, 150)], 1).float()
    err = (logits["triton"] - logits["torch"]).norm() / logits["torch"].norm()
    print(f"int{bits}: triton vs torch relative logit error {err:.2e}")
    assert err < 1e-2


@pytest.mark.parametrize("extra", [{}, dict(rotate="both", clip="both")], ids=["plain", "rotate-clip"])
def test_static_cache_compiles_in_generate_and_matches_eager(extra):
    """generate compiles the decode step by itself for StaticQuantizedPagedCache (inductor, CUDA graphs); the
    tokens match the eager QuantizedPagedCache, and a second cache object reuses the compiled graph (also with
    rotated keys and values and clipped groups)."""
    from torch._dynamo.utils import counters

    from kivi_cache import StaticQuantizedPagedCache

    model = tiny_llama_d64()
    ids = decisive_prompt(model, 70, margin=0.01, new_tokens=48).cuda()
    model = model.to("cuda", torch.float16)
    cfg = dict(key_bits=4, value_bits=4, sink_length=2, **dict(SMALL, page_size=64), **extra)
    ref = _gen(model, ids, QuantizedPagedCache(**cfg), n=48)
    before = counters["stats"]["unique_graphs"]
    out = _gen(model, ids, StaticQuantizedPagedCache(model, 70 + 48, **cfg), n=48)
    graphs = counters["stats"]["unique_graphs"] - before
    again = _gen(model, ids, StaticQuantizedPagedCache(model, 70 + 48, **cfg), n=48)
    regraphs = counters["stats"]["unique_graphs"] - before - graphs
    agree = (out == ref).float().mean().item()
    print(f"static compiled vs eager: agreement {agree:.3f}, graphs compiled {graphs}, on a new cache {regraphs}")
    assert graphs >= 1 and regraphs == 0
    assert agree > 0.95 and torch.equal(out, again)


def _sliding_model():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                            sliding_window=64, max_position_embeddings=1024, pad_token_id=0)).eval()


def test_sliding_window_model_compiled_and_eager_on_the_gpu():
    """A sliding-window model (Mistral shape, window 64, head_dim 64, a decisive 160-token prompt) on the GPU: the
    eager cache serves the window from the pages with the Triton kernels (no fallback step, pages released) and
    gives the fallback's tokens over the same storage; StaticQuantizedPagedCache compiled by generate (inductor, CUDA
    graphs) gives the eager cache's tokens."""
    from kivi_cache import StaticQuantizedPagedCache, hook
    from kivi_cache.layer import QuantizedPagedLayer

    model = _sliding_model()
    ids = decisive_prompt(model, 160, margin=0.01, new_tokens=32).cuda()
    model = model.to("cuda", torch.float16)
    cfg = dict(key_bits=4, value_bits=4, sink_length=0, **dict(SMALL, page_size=64))
    calls = []
    real = QuantizedPagedLayer.materialize
    QuantizedPagedLayer.materialize = lambda self, *a: calls.append(1) or real(self, *a)
    try:
        eager = QuantizedPagedCache(**cfg)
        served = _gen(model, ids, eager)
    finally:
        QuantizedPagedLayer.materialize = real
    assert calls == [] and all(layer.sliding_window == 64 and layer.hidden[0] > 0 for layer in eager.layers)
    saved = hook._pattern
    hook._pattern = lambda module, kwargs: (False, None)
    try:
        fallback = _gen(model, ids, QuantizedPagedCache(**cfg))
    finally:
        hook._pattern = saved
    static_cache = StaticQuantizedPagedCache(model, 160 + 32, **cfg)
    static = _gen(model, ids, static_cache)
    # the pages reused per sequence: the prompt's visible ones (2 of the table's 3; the bound alone is 1)
    assert [layer.ring for layer in static_cache.layers] == [2, 2]
    vs_fallback = (served == fallback).float().mean().item()
    vs_static = (static == served).float().mean().item()
    print(f"sliding window: served vs fallback {vs_fallback:.3f}, static compiled vs eager {vs_static:.3f}")
    assert vs_fallback > 0.95 and vs_static > 0.95


def _gen_logits(model, ids, cache, n=32):
    """Greedy tokens (new ones only) and the step logits ``[B, n, V]`` (fp32)."""
    with torch.no_grad():
        out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1).float()


def test_learned_sinks_model_compiled_and_eager_on_the_gpu():
    """GPT-OSS (learned sink logits, a window-64 layer and a full one, head_dim 64, a decisive 160-token prompt) on
    the GPU under attn_implementation="kivi": the eager cache serves every step with the Triton kernels (the sinks
    in their merge; no fallback step) and gives the fallback's tokens over the same storage (sdpa with the sink
    key); StaticQuantizedPagedCache compiled by generate (inductor, CUDA graphs) gives the eager cache's logits while
    their tokens agree (fp16 MoE layers compiled differently may flip a late near-tie: the tokens are compared up to
    there); dropping the sinks changes the logits."""
    import warnings

    from smollm2 import leading_agreement  # examples/smollm2.py (conftest.py puts examples/ on sys.path)
    from transformers import GptOssConfig, GptOssForCausalLM

    from kivi_cache import StaticQuantizedPagedCache, hook
    from kivi_cache.layer import QuantizedPagedLayer

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(
        vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, num_local_experts=2, num_experts_per_tok=1, sliding_window=64,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024)).eval()
    for module in model.modules():
        if hasattr(module, "sinks"):
            torch.nn.init.normal_(module.sinks, mean=2.0, std=2.0)
    ids = decisive_prompt(model, 160, margin=0.01, new_tokens=32).cuda()
    model = model.to("cuda", torch.float16)
    model.set_attn_implementation("kivi")
    cfg = dict(key_bits=4, value_bits=4, sink_length=0, **dict(SMALL, page_size=64))
    calls = []
    real = QuantizedPagedLayer.materialize
    QuantizedPagedLayer.materialize = lambda self, *a: calls.append(1) or real(self, *a)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a kernel falling back to the reference warns
            eager = QuantizedPagedCache(**cfg)
            served, served_logits = _gen_logits(model, ids, eager)
    finally:
        QuantizedPagedLayer.materialize = real
    assert calls == [] and [layer.sliding_window for layer in eager.layers] == [64, None]
    saved = hook._pattern
    hook._pattern = lambda module, kwargs: (False, None)
    try:
        fallback, _ = _gen_logits(model, ids, QuantizedPagedCache(**cfg))
    finally:
        hook._pattern = saved
    saved = hook._sink_logits
    hook._sink_logits = lambda kwargs: None
    try:
        _, dropped_logits = _gen_logits(model, ids, QuantizedPagedCache(**cfg))
    finally:
        hook._sink_logits = saved
    static_cache = StaticQuantizedPagedCache(model, 160 + 32, **cfg)
    static, static_logits = _gen_logits(model, ids, static_cache)
    assert [layer.ring for layer in static_cache.layers] == [2, None]  # the sliding layer reuses the prompt's 2 pages
    lead = min(leading_agreement(static[0].tolist(), served[0].tolist()) + 1, served.shape[1])  # same inputs so far

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    vs_fallback = (served == fallback).float().mean().item()
    static_err = rel(static_logits[:, :lead], served_logits[:, :lead])
    dropped_err = rel(dropped_logits[:, :1], served_logits[:, :1])  # the first step: the same prompt
    print(f"learned sinks: served vs fallback tokens {vs_fallback:.3f}; static compiled vs eager: {lead - 1} leading "
          f"tokens agree, logits rel err {static_err:.2e} over {lead} steps; sinks dropped: first-step logits rel "
          f"err {dropped_err:.2e}")
    assert vs_fallback > 0.95 and lead >= 8 and static_err < 2e-2 and dropped_err > 5 * static_err


def test_static_sliding_ring_over_many_rounds_on_the_gpu():
    """StaticQuantizedPagedCache on a sliding-window model (window 64 + residual 16 of page 64; a 100-token prompt
    leaves 2 pages visible: a ring of 2 pages per sequence) over 300 teacher-forced steps (the ring reused ~3
    times), static step not compiled: the Triton
    kernels' logits equal the eager cache's (which releases pages instead) at every step, and the pool holds the
    ring only."""
    from kivi_cache import StaticQuantizedPagedCache

    model = _sliding_model().to("cuda", torch.float16)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 100), generator=gen).cuda()
    forced = torch.randint(3, 128, (2, 300), generator=gen).cuda()  # the same inputs for both caches
    cfg = dict(key_bits=4, value_bits=4, sink_length=0, **dict(SMALL, page_size=64))

    def logits(cache):
        out = []
        with torch.no_grad():
            model(ids, **cache_kwargs(model, cache))
            for i in range(forced.shape[1]):
                step = model(forced[:, i:i + 1], **cache_kwargs(model, cache),
                             cache_position=torch.full((1,), ids.shape[1] + i, device="cuda"))
                out.append(step.logits[:, -1].float())
        return torch.stack(out, 1)

    ref = logits(QuantizedPagedCache(**cfg))
    cache = StaticQuantizedPagedCache(model, 400, **cfg)
    got = logits(cache)
    err = ((got - ref).norm() / ref.norm()).item()
    worst = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    print(f"static ring: logits rel err {err:.2e} over 300 steps (worst step {worst:.2e})")
    assert err < 1e-3 and worst < 5e-3
    for layer in cache.layers:
        assert layer.ring == 2 and layer.pool.pages_in_use == 2 * 2 + (layer.pool.zero is not None)


def test_decode_steps_never_synchronize_the_gpu_from_the_cache():
    """Eager decoding keeps the host ahead of the GPU: across a generate with group flushes (unpadded and
    left-padded batches) no synchronizing CUDA call comes from kivi_cache's code (torch's sync debug mode
    reports each one with the Python line that made it). The prompt's forward is allowed its syncs."""
    import warnings

    model = tiny_llama_d64().to("cuda", torch.float16)
    for padded in (False, True):
        ids = torch.randint(1, 128, (3, 70), device="cuda")
        mask = torch.ones_like(ids)
        if padded:
            mask[0, :9] = 0
        cache = QuantizedPagedCache(key_bits=4, value_bits=4, **dict(SMALL, page_size=64))
        with torch.no_grad():
            model(ids, attention_mask=mask, **cache_kwargs(model, cache))  # the prompt
            nxt = torch.randint(1, 128, (3, 1), device="cuda")
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(40):  # > group_size + residual: flushes happen
                        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
                        model(nxt, attention_mask=mask, **cache_kwargs(model, cache))
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        ours = [f"{r.filename}:{r.lineno}" for r in rec
                if "kivi_cache" in r.filename and "synchroniz" in str(r.message)]
        print(f"padded={padded}: {len(rec)} warnings, from kivi_cache: {ours}")
        assert cache.layers[0].paged_lens[0] > 0  # pages were written during the steps
        # a padded batch reads its real-token flags back once per forward (the first layer's call)
        allowed = 40 if padded else 0
        assert len(ours) <= allowed, ours


@pytest.mark.parametrize("bits", [(4, 4, 32), (4, 2, 64)])  # both group sizes; the loop is the same for every bit width
def test_decode_never_follows_block_table_entries_past_a_sequences_pages(bits):
    """The pipelined paged loop prefetches steps ahead; a block-table entry past a sequence's pages (the cache
    pads rows with -1, a caller may leave anything there) must never be used as a page id. Ragged lengths (0,
    1, odd, long), every entry past each sequence's pages poisoned with a page id far outside the pool, default
    and forced split counts; the output matches the reference computed on the same table with the poison
    replaced by a valid id (the reference gathers every entry)."""
    from kivi_cache import reference as REF
    from kivi_cache.kernels import api as KK
    from kivi_cache.testing import random_pool as make_pool

    kb, vb, g = bits
    gen = torch.Generator(device="cuda").manual_seed(7)
    p, d, hkv, hq = 64, 128, 4, 16
    lengths = torch.tensor([9000, 0, 1, 3001, 64, 12345], dtype=torch.int32, device="cuda")
    need = [-(-int(n) // p) for n in lengths.tolist()]
    b = len(need)
    pool = make_pool(b, hkv, int(lengths.max()), d, p, g, kb, vb, torch.device("cuda"), gen)  # distinct random pages
    bt = torch.full((b, max(need) + 5), 0x3FFFFFFF, dtype=torch.int32, device="cuda")
    for row, n in enumerate(need):
        bt[row, :n] = pool["block_table"][row, :n]
    q = torch.randn(b, hq, d, device="cuda", generator=gen).half()
    rk = torch.randn(b, hkv, 160, d, device="cuda", generator=gen).half()
    rv = torch.randn(b, hkv, 160, d, device="cuda", generator=gen).half()
    rl = torch.tensor([100, 5, 160, 0, 1, 77], dtype=torch.int32, device="cuda")
    tail = (pool["k_codes"], pool["k_scale"], pool["k_zero"], pool["v_codes"], pool["v_scale"], pool["v_zero"],
            rk, rv, rl, kb, vb, g, 0.088)
    ref = REF.paged_decode_attention(q, torch.where(bt == 0x3FFFFFFF, 0, bt), lengths, *tail).float()
    for ns in (None, 1, 7, 64):
        out = KK.paged_decode_attention(q, bt, lengths, *tail, num_splits=ns).float()
        torch.cuda.synchronize()
        err = ((out - ref).norm() / ref.norm()).item()
        print(f"{bits} splits={ns}: rel err {err:.1e}")
        assert err < 3e-3


def test_cached_launches_give_the_full_launch_paths_outputs(monkeypatch):
    """The decode op's plan cache and its direct launches of the compiled kernels (kernels._util.Launcher) give
    bit for bit what Triton's own launch path (``fast_launch=False``) gives, over calls that change the data, the
    lengths, the block table's width (a new plan), the dtype and a tuning setting; and the direct path is taken."""
    from kivi_cache.kernels import decode as D
    from kivi_cache.kernels.tuning import DecodeTuning
    from kivi_cache.testing import random_pool as make_pool

    gen = torch.Generator(device="cuda").manual_seed(11)
    p, d, hkv, hq, b = 64, 128, 8, 32, 3
    pool = make_pool(b, hkv, 4096, d, p, 32, 4, 4, torch.device("cuda"), gen)

    def call(width, lengths, dtype, seed, tuning=None):
        g2 = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(b, hq, d, device="cuda", generator=g2).to(dtype)
        rk = torch.randn(b, hkv, 160, d, device="cuda", generator=g2).to(dtype)
        rv = torch.randn(b, hkv, 160, d, device="cuda", generator=g2).to(dtype)
        rl = torch.tensor([100, 0, 31], dtype=torch.int32, device="cuda")
        ln = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        sc = {k: pool[k].to(dtype) for k in ("k_scale", "k_zero", "v_scale", "v_zero")}
        return D.paged_decode_attention(q, pool["block_table"][:, :width].contiguous(), ln, pool["k_codes"],
                                        sc["k_scale"], sc["k_zero"], pool["v_codes"], sc["v_scale"], sc["v_zero"],
                                        rk, rv, rl, 4, 4, 32, 0.088, tuning=tuning)

    calls = [(64, [4096, 64, 1000], torch.float16, 1), (64, [4000, 2048, 1], torch.float16, 2),
             (64, [4096, 64, 1000], torch.float16, 3), (40, [2560, 64, 100], torch.float16, 4),
             (40, [2560, 2560, 0], torch.float16, 5), (64, [4096, 64, 1000], torch.bfloat16, 6),
             (64, [4096, 64, 1000], torch.bfloat16, 7)]
    slow = [call(*c, tuning=DecodeTuning(fast_launch=False)) for c in calls]
    before = D._SPLIT.fast_launches
    for _ in range(2):
        fast = [call(*c) for c in calls]
        for c, x, y in zip(calls, slow, fast, strict=True):
            assert torch.equal(x, y), c
    assert D._SPLIT.fast_launches - before >= len(calls)  # the second round runs through the cached kernels
    # a setting of the plan: planned again, still equal
    slow2 = call(*calls[0], tuning=DecodeTuning(split_min=512, fast_launch=False))
    t = DecodeTuning(split_min=512)
    assert torch.equal(call(*calls[0], tuning=t), slow2) and torch.equal(call(*calls[0], tuning=t), slow2)


@pytest.mark.parametrize("padded", [False, True])
def test_window_write_by_the_decode_kernel_gives_the_copies_logits(monkeypatch, padded):
    """The window write by the decode op (models.window_written_by_copies: two copies): the split kernel's window
    program stores the step's token before reading the
    window; the step logits and the stored windows equal those of the two torch copies, bit for bit."""
    model = tiny_llama_d64().to("cuda", torch.float16)
    ids = torch.randint(0, 128, (3, 150), device="cuda")
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
    runs = {}
    for fuse in (False, True):
        cache = QuantizedPagedCache(key_bits=4, value_bits=4, **dict(SMALL, page_size=64))
        with torch.no_grad(), window_written_by_copies(active=not fuse):
            model(ids[:, :50], attention_mask=mask[:, :50], **cache_kwargs(model, cache))
            logits = torch.cat([model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1],
                                      **cache_kwargs(model, cache)).logits for t in range(50, 150)], 1)
        runs[fuse] = (logits, cache.layers[0].res_k.clone(), cache.layers[1].res_v.clone())
    for x, y in zip(runs[False], runs[True], strict=True):
        assert torch.equal(x, y)


def _int4_decode_args(bk, b, hkv, ctx, gen, min_window):
    """The decode op's arguments over a random int4 pool (32 query heads, d 128, pages of 64, g32) and a 160-token
    window holding ``min_window`` to 159 tokens per sequence (kivi_cache.testing's builders)."""
    dev = torch.device("cuda")
    pool = bk.random_pool(b, hkv, ctx, 128, 64, 32, 4, 4, dev, gen)
    q = torch.randn(b, 32, 128, device=dev, generator=gen, dtype=torch.float16)
    rk = torch.randn(b, hkv, 160, 128, device=dev, generator=gen, dtype=torch.float16)
    rv = torch.randn(b, hkv, 160, 128, device=dev, generator=gen, dtype=torch.float16)
    rl = torch.randint(min_window, 160, (b,), device=dev, generator=gen, dtype=torch.int32)
    return bk.decode_args(pool, q, rk, rv, rl, 4, 4, 32, 0.088)


def test_split_kernel_merge_matches_the_merge_kernel_on_the_gpu(monkeypatch):
    """The split kernel's own merge (``fuse_merge=True``) on the GPU (memory ordering: arrival counts with
    acq_rel atomics, partials read through L2): many calls in a row, every (sequence, KV head) with the given paged
    splits plus the window's programs (64-slot chunks at these small batches: 4..18 partials, unrolled merge, and
    41..131, ``merge_max`` 256: the merge's loop), against the two-kernel path."""
    from kivi_cache import testing as bk
    from kivi_cache.kernels import decode as D
    from kivi_cache.kernels.tuning import DecodeTuning
    gen = torch.Generator(device="cuda").manual_seed(3)
    unfused, fused = DecodeTuning(merge_max=256, fuse_merge=False), DecodeTuning(merge_max=256, fuse_merge=True)
    for b, hkv, ctx, splits in ((1, 8, 1024, 3), (4, 8, 4096, 15), (8, 2, 2048, 1), (3, 4, 3008, 7),
                                (1, 8, 32768, 128), (2, 4, 8192, 40)):
        args = _int4_decode_args(bk, b, hkv, ctx, gen, min_window=0)
        two = D.paged_decode_attention(*args, num_splits=splits, tuning=unfused)  # the merge kernel
        for _ in range(20):
            one = D.paged_decode_attention(*args, num_splits=splits, tuning=fused)
            assert any(p.merge_meta is not None and p.ints[1] == splits for p in D._PLANS.values())  # NS paged splits
            err = ((one.float() - two.float()).norm() / two.float().norm()).item()
            assert err < 1e-3, (b, hkv, ctx, splits, err)


@pytest.mark.parametrize("merge", [False, True])
def test_decode_runner_equals_the_op_call_for_call(monkeypatch, merge):
    """kernels.DecodeRunner (plan once, then direct launches with the first call's argument list, only the changing
    pointers replaced) against the ordinary op, bit for bit: fresh queries, window lengths and new tokens every call,
    with and without the step's token written by the kernel and the in-kernel merge; a change of settings, strides
    or the token's presence goes through the ordinary call again. The runners and calls run under ``tuning.DEFAULT``
    (the cache's way), set here."""
    from kivi_cache.kernels import decode as D
    from kivi_cache.kernels import tuning as T

    default = T.Tuning(decode=T.DecodeTuning(fuse_merge=merge))
    monkeypatch.setattr(T, "DEFAULT", default)
    from kivi_cache import testing as bk
    gen = torch.Generator(device="cuda").manual_seed(5)
    dev = torch.device("cuda")
    for b, hkv, ctx in ((1, 8, 1024), (3, 4, 3008)):
        args = _int4_decode_args(bk, b, hkv, ctx, gen, min_window=1)
        fixed, bits = args[1:11], args[12:15]
        for with_new in (False, True, False):
            run = D.DecodeRunner(*fixed, *bits)
            for i in range(8):
                q = torch.randn(b, 32, 128, device=dev, generator=gen, dtype=torch.float16)
                rl = torch.randint(1, 160, (b,), device=dev, generator=gen, dtype=torch.int32)
                new = {}
                if with_new:
                    nk = torch.randn(b, hkv, 1, 128, device=dev, generator=gen, dtype=torch.float16)
                    new = dict(new_k=nk, new_v=torch.randn_like(nk))
                got = run.run(q, rl, 0.088, **new)
                want = D.paged_decode_attention(q, *fixed, rl, *bits, 0.088, **new)
                assert torch.equal(got, want), (b, hkv, ctx, with_new, i)
            # every call after the first (after the second where the first was the process's first of the kernel:
            # its plan waits for the compiled kernel's residency)
            assert run.fast_runs >= 6, (b, hkv, ctx, with_new, run.fast_runs)
            qt = torch.randn(b, 128, 32, device=dev, generator=gen, dtype=torch.float16).transpose(1, 2)  # strides
            assert torch.equal(run.run(qt, rl, 0.088, **new), D.paged_decode_attention(qt, *fixed, rl, *bits, 0.088,
                                                                                        **new))
            assert run.fast_runs >= 6
        # a plan setting of the default: the ordinary call again, then direct
        monkeypatch.setattr(T, "DEFAULT", T.Tuning(decode=T.DecodeTuning(fuse_merge=merge, split_min=512)))
        run = D.DecodeRunner(*fixed, *bits)
        for _ in range(3):
            assert torch.equal(run.run(q, rl, 0.088), D.paged_decode_attention(q, *fixed, rl, *bits, 0.088))
        monkeypatch.setattr(T, "DEFAULT", default)
        assert torch.equal(run.run(q, rl, 0.088), D.paged_decode_attention(q, *fixed, rl, *bits, 0.088))
        assert run.fast_runs == 2
        # a window length or step token on the CPU after direct runs: the ordinary call, whose check names it
        with pytest.raises(ValueError, match="res_lengths|device"):
            run.run(q, rl.cpu(), 0.088)
        assert run.fast_runs == 2


def test_deepcopy_mid_generation_on_the_gpu():
    """A deep copy of a cache mid-generation on CUDA (the layers hold decode runners: Triton launch state, raw
    pointers) continues on its own: the copy, the original and a never-copied cache give the same tokens, eagerly
    (QuantizedPagedCache: the pool's copy drops its runner) and for a static cache stepped without compiling (the
    copy binds itself to the attention modules when used)."""
    import copy

    from models import unbind_static

    from kivi_cache import StaticQuantizedPagedCache

    model = tiny_llama_d64().to("cuda", torch.float16)
    x = torch.randint(1, 128, (2, 150), device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    q4 = dict(key_bits=4, value_bits=4, **dict(SMALL, page_size=64))
    first = _gen(model, x[:, :90], QuantizedPagedCache(**q4), n=20)
    cache = QuantizedPagedCache(**q4)
    _gen(model, x[:, :90], cache, n=20)
    assert cache.layers[0].pool.decode_runner is not None  # the Triton path ran
    branch = copy.deepcopy(cache)
    a, b = _gen(model, first, cache, n=24), _gen(model, first, branch, n=24)
    solo = QuantizedPagedCache(**q4)
    _gen(model, x[:, :90], solo, n=20)
    assert torch.equal(a, b) and torch.equal(a, _gen(model, first, solo, n=24))

    def steps(c, copy_at=None, switch_at=None):
        """Logits of decode steps 60..109: the cache on sequence 0 (from switch_at on, sequence 1's tokens); with
        copy_at, a deep copy made there steps through sequence 1's tokens beside it."""
        out, other = [], None
        with torch.no_grad():
            model(x[:1, :60], **cache_kwargs(model, c))
            for t in range(60, 110):
                if t == copy_at:
                    other = copy.deepcopy(c)
                row = x[1:] if switch_at is not None and t >= switch_at else x[:1]
                out.append(model(row[:, t:t + 1], **cache_kwargs(model, c)).logits)
                if other is not None:
                    out.append(model(x[1:, t:t + 1], **cache_kwargs(model, other)).logits)
        return out

    try:
        both = steps(StaticQuantizedPagedCache(model, 128, **q4), copy_at=80)
        alone = steps(StaticQuantizedPagedCache(model, 128, **q4))  # never copied, same kernels
        switched = steps(StaticQuantizedPagedCache(model, 128, **q4), switch_at=80)
    finally:
        unbind_static(model)
    original = torch.cat(both[:20] + both[20::2], 1).float()
    branch = torch.cat(both[21::2], 1).float()
    for got, want in ((original, torch.cat(alone, 1).float()), (branch, torch.cat(switched[20:], 1).float())):
        err = ((got - want).norm() / want.norm()).item()
        print(f"deep-copied static cache vs a never-copied one: logits rel err {err:.2e}")
        assert err < 1e-3


def test_static_cache_beam_search_and_reorder_on_the_gpu():
    """Beam search with StaticQuantizedPagedCache on CUDA (the Triton kernels; generate runs beam search eagerly)
    gives the eager cache's tokens, and a reorder between different sequences ([2, 0, 0] after 60 steps) gives the
    eager cache's logits afterwards (8-bit, so that both caches' quantization agree closely)."""
    from models import unbind_static

    from kivi_cache import StaticQuantizedPagedCache

    model = tiny_llama_d64().to("cuda", torch.float16)
    q8 = dict(key_bits=8, value_bits=8, **dict(SMALL, page_size=64))
    x = torch.randint(1, 128, (3, 160), device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    rows = torch.tensor([2, 0, 0], device="cuda")
    kw = dict(max_new_tokens=40, min_new_tokens=40, num_beams=3, do_sample=False)

    def run(cache):
        return steps_with_reorder(model, x, cache, 70, 130, rows)

    try:
        with torch.no_grad():
            beams = model.generate(x[:1, :70], **cache_kwargs(model, StaticQuantizedPagedCache(model, 128, **q8)),
                                   **kw)
        static = run(StaticQuantizedPagedCache(model, 192, **q8))
    finally:
        unbind_static(model)
    with torch.no_grad():
        ref = model.generate(x[:1, :70], **cache_kwargs(model, QuantizedPagedCache(**q8)), **kw)
    eager = run(QuantizedPagedCache(**q8))
    err = ((static - eager).norm() / eager.norm()).item()
    print(f"static reorder vs eager: logits rel err {err:.2e}; beam tokens equal {torch.equal(beams, ref)}")
    assert torch.equal(beams, ref) and err < 2e-3


@pytest.mark.skipif(kivi_cache.cb.unsupported_reason() is not None,
                    reason=str(kivi_cache.cb.unsupported_reason()))
@pytest.mark.parametrize("preset", ["int4", "int2", "int2-rotate-clip"])
def test_continuous_batching_on_the_gpu_equals_chunked_generate(preset):
    """transformers' continuous-batching engine on quantized pages (decode through the Triton kernels, later prompt
    chunks through the prefix op) gives for a request the tokens of the same prompt stored by 64-token chunks
    (kivi_cache.prefill) and decoded by generate with the preset's cache. (Served together, a request's chunks
    start wherever the batch's token budget leaves room, so the quantized history its chunks see differs.)"""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = tiny_llama_d64().to("cuda", torch.float16)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (257, 321, 90, 1)]
    gen = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cache_cls = {"int4": kivi_cache.Int4PagedCache, "int2": kivi_cache.Int2PagedCache,
                 "int2-rotate-clip": lambda: kivi_cache.Int2PagedCache(rotate="both", clip="both")}[preset]
    want = []
    for p in prompts:
        x = torch.tensor([p], device="cuda")
        cache = cache_cls()
        if len(p) > 1:
            kivi_cache.prefill(model, cache, x, chunk_size=64)
        with torch.no_grad():
            want.append(model.generate(x, generation_config=gen, **cache_kwargs(model, cache))[0, len(p):].tolist())
    if preset == "int2-rotate-clip":
        kivi_cache.enable_continuous_batching(model, config=preset_config("int2", rotate="both", clip="both"))
    else:
        kivi_cache.enable_continuous_batching(model, preset=preset)
    try:
        got = [next(iter(model.generate_batch([p], generation_config=gen, continuous_batching_config=(
            ContinuousBatchingConfig(page_size=64, num_blocks=64, max_batch_tokens=64))).values())).generated_tokens
            for p in prompts]
    finally:
        kivi_cache.disable_continuous_batching(model)
    assert got == want

"""Generation modes against transformers' DynamicCache on the sliding-window and learned-sink families: beam search,
assisted and prompt-lookup decoding (which crop the cache), sampling with num_return_sequences (batch expansion) and
a deep copy of the cache mid-generation, continued on both branches; and the static cache's deep copy. Tiny models
(hidden 64, 2-3 layers, vocab 128), 8-bit caches with small groups so that flushes, sinks and page releases happen
within a few dozen tokens."""

import copy
import threading

import pytest
import torch
import transformers as T
from models import steps_with_reorder, unbind_static
from transformers import DynamicCache

from kivi_cache import QuantizedPagedCache, StaticQuantizedPagedCache, cache_kwargs, ops

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.1)
Q8 = dict(key_bits=8, value_bits=8, group_size=16, residual_length=16, page_size=32, sink_length=2)
PROMPT, NEW = 48, 28


def _gpt_oss(seed=0):
    """Learned sink logits (``s_aux``) on a sliding (window 24) and a full layer, served under ``"kivi"``."""
    torch.manual_seed(seed)
    cfg = T.GptOssConfig(**TINY, num_local_experts=2, num_experts_per_tok=1, sliding_window=24,
                         layer_types=["sliding_attention", "full_attention"])
    model = T.GptOssForCausalLM(cfg).eval()
    for module in model.modules():
        if hasattr(module, "sinks"):
            torch.nn.init.normal_(module.sinks, std=2.0)
    model.set_attn_implementation("kivi")
    return model


def _mistral(seed=0):
    torch.manual_seed(seed)
    return T.MistralForCausalLM(T.MistralConfig(**TINY, sliding_window=24)).eval()


def _gemma3(seed=0):
    torch.manual_seed(seed)
    return T.Gemma3ForCausalLM(T.Gemma3TextConfig(**dict(TINY, num_hidden_layers=3, initializer_range=0.02),
                                                  sliding_window=24, layer_types=[
                                                      "sliding_attention", "full_attention", "sliding_attention"])
                               ).eval()


FAMILIES = {"mistral": _mistral, "gemma3": _gemma3, "gpt_oss": _gpt_oss}


def _reference_cache(model):
    return DynamicCache(config=model.config) if isinstance(model, T.GptOssForCausalLM) else DynamicCache()


def _generate(model, ids, cache, **kw):
    with torch.no_grad():
        return model.generate(ids, **cache_kwargs(model, cache), pad_token_id=0, **kw)


def _prompt(model, tries=6):
    """The most decisive of a few random prompts (its greedy continuation's smallest top-1 margin is the largest),
    with a repeat in it (prompt-lookup decoding finds its candidates there)."""
    gen = torch.Generator().manual_seed(0)
    best, margin = None, -1.0
    for _ in range(tries):
        ids = torch.randint(1, 128, (1, PROMPT), generator=gen)
        ids = torch.cat([ids, ids[:, 8:20]], 1)
        out = _generate(model, ids, _reference_cache(model), max_new_tokens=NEW, min_new_tokens=NEW,
                        do_sample=False, output_logits=True, return_dict_in_generate=True)
        top2 = torch.stack(out.logits).topk(2, dim=-1).values
        m = (top2[..., 0] - top2[..., 1]).min().item()
        if m > margin:
            best, margin = ids, m
    return best


def _teacher_error(model, sequences, logits, prompt_len):
    """Largest relative error of a run's step logits against the model's uncached forward over the run's own
    tokens (sampling: the draws may part from the reference's at a near-tie; the logits may not)."""
    with torch.no_grad():
        full = model(sequences).logits
    return max(((step - full[:, prompt_len - 1 + j]).norm() / full[:, prompt_len - 1 + j].norm()).item()
               for j, step in enumerate(logits))


def _crops(monkeypatch):
    calls = []
    real = QuantizedPagedCache.crop
    monkeypatch.setattr(QuantizedPagedCache, "crop", lambda self, n: calls.append(n) or real(self, n))
    return calls


MODES = ["beam", "assisted", "prompt_lookup", "sample_return_sequences", "deepcopy"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generation_modes_match_dynamic_cache(monkeypatch, family, mode):
    """8-bit cache (near lossless): the reference's tokens in the deterministic modes, the reference forward's
    logits over its own tokens where it samples or branches."""
    model = FAMILIES[family]()
    ids = _prompt(model)
    p = ids.shape[1]
    greedy = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    if mode in ("beam", "assisted", "prompt_lookup"):
        kw = dict(greedy)
        if mode == "beam":
            kw = dict(max_new_tokens=24, num_beams=3, num_return_sequences=2, early_stopping=True, do_sample=False)
        elif mode == "assisted":
            kw.update(assistant_model=FAMILIES[family](seed=1), num_assistant_tokens=5,
                      num_assistant_tokens_schedule="constant")
        else:
            kw.update(prompt_lookup_num_tokens=4)
        ref = _generate(model, ids, _reference_cache(model), **kw)
        calls = _crops(monkeypatch)
        out = _generate(model, ids, QuantizedPagedCache(**Q8), **kw)
        assert torch.equal(out, ref)
        if mode == "assisted":
            assert min(calls) < 0  # rejected candidates were cropped
        return
    if mode == "sample_return_sequences":
        torch.manual_seed(7)
        out = _generate(model, ids, QuantizedPagedCache(**Q8), max_new_tokens=NEW, do_sample=True, top_k=20,
                        temperature=0.7, num_return_sequences=2, output_logits=True, return_dict_in_generate=True)
        assert out.sequences.shape[0] == 2 and not torch.equal(out.sequences[0], out.sequences[1])
        assert _teacher_error(model, out.sequences, out.logits, p) < 1e-2
        return
    # deepcopy mid-generation, then both continue, step by step in turn on other tokens (flushes, page releases):
    # each gives the reference forward's logits (a shared page or window would mix the branches)
    cache = QuantizedPagedCache(**Q8)
    first = _generate(model, ids, cache, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    branch = copy.deepcopy(cache)
    tails = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(2))
    seqs = [torch.cat([first, tail[None]], 1) for tail in tails]
    logits = [[], []]
    with torch.no_grad():
        for t in range(first.shape[1] - 1, seqs[0].shape[1]):
            for k, c in enumerate((cache, branch)):
                logits[k].append(model(seqs[k][:, t:t + 1], **cache_kwargs(model, c)).logits[:, -1])
    for seq, steps in zip(seqs, logits, strict=True):
        assert _teacher_error(model, seq, steps[:-1], first.shape[1]) < 1e-2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_beam_search_with_a_static_cache(monkeypatch, family):
    """Beam search reorders a static cache after every step (generate runs it eagerly). Tokens equal the eager
    cache's and DynamicCache's, over flushes, ring pages (sliding layers) and sinks; a reorder that does nothing gives
    other tokens. A reorder that forgot only the page copy still passes here (beams of one prompt rarely differ inside
    flushed groups): test_static_reorder_copies_the_parents_pages is the one that catches it."""
    model = FAMILIES[family]()
    ids = _prompt(model)
    kw = dict(max_new_tokens=48, min_new_tokens=48, num_beams=3, num_return_sequences=2, do_sample=False)
    ref = _generate(model, ids, _reference_cache(model), **kw)
    eager = _generate(model, ids, QuantizedPagedCache(**Q8), **kw)
    calls = []
    real = StaticQuantizedPagedCache.reorder_cache
    monkeypatch.setattr(StaticQuantizedPagedCache, "reorder_cache", lambda self, i: calls.append(i) or real(self, i))
    try:
        static = _generate(model, ids, StaticQuantizedPagedCache(model, 128, **Q8), **kw)
    finally:
        unbind_static(model)
    assert torch.equal(static, eager) and torch.equal(static, ref)
    assert any(not torch.equal(i.cpu(), torch.arange(len(i))) for i in calls)  # the beams did move


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_static_reorder_copies_the_parents_pages(family):
    """Three different sequences of equal length, 40 decode steps (flushes into pages, ring pages reused on sliding
    layers), then ``reorder_cache([2, 0, 0])`` and 30 more steps on the chosen rows' tokens: the static cache's logits
    equal the eager cache's (whose reorder shares pages). Beam search rarely reorders beams that differ in their
    paged tokens; this does, so a child that kept its own pages (or window, or lengths) fails here."""
    model = FAMILIES[family]()
    x = torch.randint(1, 128, (3, 120), generator=torch.Generator().manual_seed(5))
    rows = torch.tensor([2, 0, 0])

    def run(cache):
        return steps_with_reorder(model, x, cache, 50, 90, rows)

    try:
        static = run(StaticQuantizedPagedCache(model, 128, **Q8))
    finally:
        unbind_static(model)
    torch.testing.assert_close(static, run(QuantizedPagedCache(**Q8)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_deepcopy_of_a_static_cache_continues_on_its_own(family):
    """A static cache binds itself to the model's attention modules; a deep copy was not bound, so its decode steps
    went to plain attention over the bare residual window: a shape error, or with learned sinks (GPT-OSS's
    sdpa_with_sinks cuts the mask to the window) silently wrong logits (~1.5 relative error). Each cache now binds
    itself again when used: the copy and the original, interleaved, give the eager cache's logits."""
    model = FAMILIES[family]()
    x = torch.randint(1, 128, (2, 100), generator=torch.Generator().manual_seed(11))

    def step(c, ids):
        with torch.no_grad():
            return model(ids, **cache_kwargs(model, c)).logits

    def run(make):
        cache, out = make(), []
        step(cache, x[:1, :50])
        for t in range(50, 60):
            step(cache, x[:1, t:t + 1])
        branch = copy.deepcopy(cache)
        for t in range(60, 90):  # interleaved, other tokens on the branch: flushes and page releases on both
            out.append(step(cache, x[:1, t:t + 1]))
            out.append(step(branch, x[1:, t:t + 1]))
        return torch.cat(out, 1)

    try:
        static = run(lambda: StaticQuantizedPagedCache(model, 128, **Q8))
    finally:
        unbind_static(model)
    eager = run(lambda: QuantizedPagedCache(**Q8))
    torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)


def test_deepcopy_mid_generation_drops_the_decode_runner(monkeypatch):
    """On the GPU a layer's decode runner holds the Triton launch state (compiled kernels, raw pointers of the
    pool and window), which deepcopy could not copy (TypeError: cannot pickle '_thread.RLock', H200) and which would
    point at the original's tensors. The pool's copy drops it; the copy plans its own. Here a lock stands in for
    the launch state."""
    real_init = ops.DecodeRunner.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.launch_state = threading.RLock()

    monkeypatch.setattr(ops.DecodeRunner, "__init__", init)
    model = _mistral()
    x = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(3))
    cache = QuantizedPagedCache(**Q8)
    first = _generate(model, x[:, :50], cache, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert cache.layers[0].pool.decode_runner is not None
    branch = copy.deepcopy(cache)
    assert branch.layers[0].pool.decode_runner is None and cache.layers[0].pool.decode_runner is not None
    greedy = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    a = _generate(model, first, cache, **greedy)
    b = _generate(model, first, branch, **greedy)
    assert torch.equal(a, b)
    solo = QuantizedPagedCache(**Q8)  # never copied
    _generate(model, x[:, :50], solo, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert torch.equal(a, _generate(model, first, solo, **greedy))

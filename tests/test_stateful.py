"""Stateful property tests (issue 45, "every operation all or nothing"): hypothesis ``RuleBasedStateMachine``s drive
``QuantizedPagedCache`` and transformers' ``DynamicCache`` in lockstep through tiny random models and check, after
every step, that the two agree and that our cache's bookkeeping is sound.

Machines (model x cache setting):

* models: a 2-layer Llama (full attention), and a 2-layer Qwen2 whose layers are ``[full_attention,
  sliding_attention]`` (window 24; the full layer first, so a refusal by the sliding layer after the full one changed
  would show);
* settings: ``exact`` (residual window of 512 tokens, no sinks: nothing is ever quantized, so our keys and values
  equal DynamicCache's: layer 0 bit for bit, later layers to float rounding of the attention, logits to 1e-5) and
  ``int8`` (8 bits, group 16, residual 16, page 32, 2 sink tokens: flushes, page sharing, copy-on-write and released
  sliding-window pages all happen within ~100 tokens; keys and values within a few half quantization steps,
  ``range / 510`` per group, lengths exactly).

Rules: a prompt or chunk of 1..40 tokens, decode steps, a new left-padded prompt (pads are not stored: the sequences'
lengths, sinks and windows differ from then on), ``crop(-k)`` (also past the length: both empty), the older ``crop(m)``
form (ours: keep the first m; compared with DynamicCache's ``crop(m - seen)``), crop exactly at a sliding-window
layer's limit or one beyond, ``reorder_cache`` with repeated indices, ``batch_select_indices`` (long / int32 / list /
bool mask), ``batch_repeat_interleave``, a fork (copies of a sequence share its pages), a crop back and decode steps to
the next flush (the copies' own tokens then go into the shared, partly filled page: copy-on-write), ``reset`` (both; a
new prompt and batch size follow), every bad argument, and failures injected part way through an operation.

After every step, per layer: ``get_seq_length`` and the batch size equal DynamicCache's; the materialized
``keys``/``values`` agree (a sliding-window layer's released tokens are zeros in ours and are not compared, and no
released token may be visible to the next query); the bookkeeping is consistent (``seen == pads + paged_lens +
window_lens``, whole groups in the pages, one table entry per started page, released entries point at the zero page);
the pool audits clean: every page's reference count equals the number of block-table entries naming it (the zero page
holds its huge count), a page is in the free list iff its count is 0, no page is free twice, and ``pages_in_use``
(also in ``memory_stats``) is the pages referenced plus the zero page once allocated.

Refusals: where DynamicCache refuses an argument (an out-of-range, negative, float or 2-D index, a bool mask of
another length, a float crop, a wrong repeat count) ours must raise ValueError, IndexError or TypeError, and so must it
for update states of a wrong shape or dtype and ``layer_idx=-1`` (which DynamicCache takes as "the last layer"); the
cache must then be exactly as before (tables, lengths, sinks, pads, released entries, ``seen``, the materialized
keys/values, the pool's reference counts and free list). A crop that ours refuses while DynamicCache would not must be
the documented limitation (it would bring a sliding-window layer's released tokens back into the window): ValueError,
nothing changed in any layer. Deliberate differences, not asserted as refusals: ``crop(m)`` with m > 0 and a bool mask
of the batch size in ``reorder_cache`` (DynamicCache refuses both); the reference for the sliding model is
``DynamicCache()`` (full layers; the model's mask applies the window), because ``DynamicCache(config=...)``'s sliding
layers refuse every crop once the window is reached (RuntimeError, without past recording).

Injected failures (``torch.OutOfMemoryError`` from ``PagePool._grow`` or from a tensor allocation in a batch
operation, RuntimeError from a paged op: storing groups, dequantizing, prefix or decode attention) on the n-th call
inside a prompt, decode step, crop or batch operation: the cache must afterwards be either exactly as before, or
unusable: every use (a forward, crop, reorder_cache, batch_select_indices, batch_repeat_interleave,
get_seq_length) raises ``kivi_cache.CacheUnusableError`` until ``reset()``, after which it works as a fresh cache.

A smaller machine does the same for ``StaticQuantizedPagedCache`` (prompt, static decode steps, beam reorders,
reset, the operations static mode refuses).

Cost: derandomized (a fixed set of examples, no example database) with small example counts (40 / 60 per cache
machine, 30 for the static one, 25 steps each): about 70 s for the file on one CPU thread (a failing machine adds
hypothesis's shrinking, up to about 5 minutes). ``KIVI_STATEFUL_EXAMPLES=N`` runs N examples per machine with random
exploration and reports every distinct failure (e.g. 200 for a soak run: about 4 minutes when all pass);
``KIVI_STATEFUL_STEPS=N`` sets the steps per example (default 25).
"""

from __future__ import annotations

import collections
import functools
import os
import unittest.mock

import pytest
import torch
import transformers as T
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from models import SMALL, tiny_llama, unbind_static
from transformers import DynamicCache

import kivi_cache
from kivi_cache import QuantizedPagedCache, cache_kwargs, ops
from kivi_cache.pool import PagePool


class _NeverRaised(RuntimeError):
    """Stands in for kivi_cache.CacheUnusableError where the library has none (nothing raises it)."""


CacheUnusableError = getattr(kivi_cache, "CacheUnusableError", None) or _NeverRaised

_EXAMPLES = os.environ.get("KIVI_STATEFUL_EXAMPLES")
_STEPS = int(os.environ.get("KIVI_STATEFUL_STEPS", 25))


def _settings(examples: int):
    return settings(max_examples=int(_EXAMPLES) if _EXAMPLES else examples, stateful_step_count=_STEPS,
                    deadline=None, derandomize=not _EXAMPLES, database=None, print_blob=False,
                    report_multiple_bugs=bool(_EXAMPLES), suppress_health_check=[HealthCheck.too_slow])


MAX_LEN = 150  # tokens per sequence at most (the exact setting's residual window of 512 is never reached)
MAX_BATCH = 4
WINDOW = 24
EXACT = dict(key_bits=2, value_bits=2, group_size=32, residual_length=512, page_size=64, sink_length=0)
INT8 = dict(key_bits=8, value_bits=8, sink_length=2, **SMALL)
ZERO_PAGE_COUNT = 1 << 61  # the zero page's reference count is 1 << 62: above any real count


@functools.cache
def _model(name: str):
    if name == "llama":
        return tiny_llama(layers=2)
    torch.manual_seed(0)
    cfg = T.Qwen2Config(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    return T.Qwen2ForCausalLM(cfg).eval()


@functools.cache
def _static_model():
    return tiny_llama(layers=2, seed=1)  # its own instance: a static cache binds itself to the attention modules


# ----------------------------------------------------------------------------------------------- state and checks

def _snapshot(cache) -> list:
    """Everything an operation may change, per layer (an uninitialized layer, or one not made yet, as None); reads the
    materialized keys/values (which may raise on an unusable cache)."""
    out = []
    for layer in cache.layers:
        if not layer.is_initialized:
            out.append(None)
            continue
        # keys first: a static layer's host lists follow its device state on that read
        snap = dict(keys=layer.keys.clone(), values=layer.values.clone())
        snap.update(batch_size=layer.batch_size, tables=[list(t) for t in layer.tables],
                    paged_lens=list(layer.paged_lens), window_lens=list(layer.window_lens), sinks=list(layer.sinks),
                    pads=list(layer.pads), hidden=list(layer.hidden), seen=int(layer.get_seq_length()),
                    pending=layer.pending is not None, sliding_window=layer.sliding_window)
        if getattr(layer, "static", False):  # the static decode state (device tensors)
            snap.update(static=True, decoding=layer.decoding,
                        device_state=[t.tolist() for t in (layer.block_table, layer.paged_len, layer.window_len,
                                                           layer.sink_len, layer.seen_t)])
        pool = layer.pool
        snap["pool"] = (pool.capacity, list(pool.refcount), sorted(pool.free), pool.zero)
        out.append(snap)
    return out


def _snapshot_diff(before: list, after: list) -> str | None:
    """The first difference between two snapshots (None: the same state). A pool may have grown meanwhile as long as
    the new pages are free and unreferenced."""
    n = max(len(before), len(after))
    before = before + [None] * (n - len(before))
    after = after + [None] * (n - len(after))
    for i, (a, b) in enumerate(zip(before, after, strict=True)):
        if (a is None) != (b is None):
            return f"layer {i}: initialized {a is not None} -> {b is not None}"
        if a is None:
            continue
        for key in sorted(set(a) | set(b), key=str):
            if (key in a) != (key in b):
                return f"layer {i}: {key} {a.get(key, '(absent)')} -> {b.get(key, '(absent)')}"
            if key == "pool":
                (cap0, rc0, free0, zero0), (cap1, rc1, free1, zero1) = a[key], b[key]
                grown = list(range(cap0, cap1))
                if (cap1 < cap0 or rc1[:cap0] != rc0 or any(rc1[cap0:]) or free1 != sorted(free0 + grown)
                        or zero1 != zero0):
                    return (f"layer {i}: pool changed: capacity {cap0} -> {cap1}, refcount {rc0} -> {rc1}, free "
                            f"{free0} -> {free1}, zero page {zero0} -> {zero1}")
            elif key in ("keys", "values"):
                if a[key].shape != b[key].shape or not torch.equal(a[key], b[key]):
                    return f"layer {i}: materialized {key} changed ({tuple(a[key].shape)} -> {tuple(b[key].shape)})"
            elif a[key] != b[key]:
                return f"layer {i}: {key} {a[key]} -> {b[key]}"
    return None


def _audit_pool(i: int, layer) -> None:
    pool = layer.pool
    if pool is None:
        assert not layer.is_initialized, f"layer {i}: initialized without a pool"
        return
    zero, cap = pool.zero, pool.capacity
    refs = collections.Counter(page for table in layer.tables for page in table if page != zero)
    assert len(pool.refcount) == cap and all(t.shape[0] == cap for t in pool.tensors.values()), f"layer {i}: capacity"
    assert all(0 <= page < cap for page in refs), f"layer {i}: a table names a page outside the pool: {layer.tables}"
    for page in range(cap):
        if page == zero:
            assert pool.refcount[page] >= ZERO_PAGE_COUNT, f"layer {i}: the zero page's count {pool.refcount[page]}"
        else:
            assert pool.refcount[page] == refs.get(page, 0), (
                f"layer {i}: page {page} has reference count {pool.refcount[page]} but {refs.get(page, 0)} table "
                f"entries (tables {layer.tables}, refcount {pool.refcount})")
    assert len(pool.free) == len(set(pool.free)), f"layer {i}: a page is free twice: {pool.free}"
    unreferenced = {page for page in range(cap) if page != zero and pool.refcount[page] == 0}
    assert set(pool.free) == unreferenced, (
        f"layer {i}: free list {sorted(pool.free)} but unreferenced pages {sorted(unreferenced)} (a leaked page, or "
        f"one free while in use)")
    in_use = len(refs) + (zero is not None)
    assert pool.pages_in_use == in_use, f"layer {i}: pages_in_use {pool.pages_in_use}, expected {in_use}"
    if layer.is_initialized:
        assert layer.memory_stats()["pages_in_use"] == in_use, f"layer {i}: memory_stats' pages_in_use"


def _check_bookkeeping(i: int, layer) -> None:
    if not layer.is_initialized:
        return
    static = getattr(layer, "static", False)  # a static layer: tables hold every page up to max_cache_len
    seen = int(layer.get_seq_length())
    cfg = layer.cfg
    g, p, b = cfg.group_size, cfg.page_size, layer.batch_size
    zero = layer.pool.zero
    lists = dict(tables=layer.tables, paged_lens=layer.paged_lens, window_lens=layer.window_lens, sinks=layer.sinks,
                 pads=layer.pads, hidden=layer.hidden)
    assert all(len(v) == b for v in lists.values()) and layer.res_k.shape[0] == b, (
        f"layer {i}: batch size {b} but {[(k, len(v)) for k, v in lists.items()]}, window rows {layer.res_k.shape[0]}")
    for s in range(b):
        q, r, sinks, h = layer.paged_lens[s], layer.window_lens[s], layer.sinks[s], layer.hidden[s]
        table = layer.tables[s]
        where = f"layer {i} sequence {s} (q {q}, r {r}, sinks {sinks}, hidden {h}, seen {seen}, table {table})"
        assert seen == layer.pads[s] + q + r, f"{where}: seen != pads + paged_lens + window_lens"
        assert q % g == 0 and 0 <= sinks <= min(r, cfg.sink_length), f"{where}: partial group or sinks"
        assert r <= layer.res_k.shape[2], f"{where}: window overflow"
        if not static:
            assert len(table) == -(-q // p), f"{where}: not one table entry per started page"
            assert r - sinks < cfg.residual_length + g, f"{where}: a whole group left unflushed"
        assert h <= len(table) and all(e == zero for e in table[:h]), f"{where}: released entries"
        if not static:
            assert zero not in table[h:], f"{where}: the zero page after the released entries"
        if layer.sliding_window is not None and h:  # the next query (stored index q + r) sees indices > q + r - w
            assert h * p <= q + r + 1 - layer.sliding_window, f"{where}: a released token is still in the window"


def _released_mask(layer, length: int) -> torch.Tensor:
    """``[B, 1, length, 1]``: the timeline positions of a sliding-window layer's released tokens (zeros in ours)."""
    mask = torch.zeros(layer.batch_size, 1, length, 1, dtype=torch.bool)
    p = layer.cfg.page_size
    for s in range(layer.batch_size):
        start = length - layer.paged_lens[s] - layer.window_lens[s] + layer.sinks[s]
        mask[s, :, start:start + min(layer.paged_lens[s], layer.hidden[s] * p)] = True
    return mask


def _compare_tensors(i: int, name: str, ours: torch.Tensor, ref: torch.Tensor, tol) -> None:
    assert ours.shape == ref.shape, f"layer {i}: {name} shape {tuple(ours.shape)}, DynamicCache's {tuple(ref.shape)}"
    err = (ours - ref).abs()
    if tol is None or isinstance(tol, float):
        bad = err > (tol or 0.0)
    else:
        bad = err > tol
    if bad.any():
        idx = tuple(int(x) for x in bad.nonzero()[0])
        limit = tol if tol is None or isinstance(tol, float) else float(tol.expand_as(err)[idx])
        raise AssertionError(f"layer {i}: {name} differ from DynamicCache's at [b, h, t, d]={list(idx)}: ours "
                             f"{float(ours[idx]):.6g}, DynamicCache {float(ref[idx]):.6g} (allowed {limit}; max error "
                             f"{float(err.max()):.3g}, {int(bad.sum())} entries)")


# ------------------------------------------------------------------------------------------------ injected failures

class _Inject:
    """A context manager that makes one internal step raise on its ``nth`` call (``fired``: the exception raised)."""

    def __init__(self, target: str, nth: int):
        self.target, self.nth, self.calls, self.fired = target, nth, 0, None
        self._patch = None

    def _fail(self, exc_type):
        self.calls += 1
        if self.calls == self.nth:
            self.fired = exc_type(f"kivi stateful test: injected failure of {self.target} (call {self.nth})")
            raise self.fired

    def __enter__(self):
        inj = self
        if self.target == "pool_grow":  # out of memory while the pool grows (only calls that would grow count)
            real = PagePool._grow

            def grow(pool, new_capacity):
                if new_capacity > pool.capacity:
                    inj._fail(torch.OutOfMemoryError)
                return real(pool, new_capacity)

            self._patch = unittest.mock.patch.object(PagePool, "_grow", grow)
        elif self.target == "index_select":  # out of memory in a tensor allocation (gathers: the batch operations',
            # the torch path's attention)
            real = torch.Tensor.index_select

            def index_select(t, *args, **kwargs):
                inj._fail(torch.OutOfMemoryError)
                return real(t, *args, **kwargs)

            self._patch = unittest.mock.patch.object(torch.Tensor, "index_select", index_select)
        elif self.target == "decode_attention":
            real = ops.DecodeRunner.__call__

            def call(runner, *args, **kwargs):
                inj._fail(RuntimeError)
                return real(runner, *args, **kwargs)

            self._patch = unittest.mock.patch.object(ops.DecodeRunner, "__call__", call)
        else:  # a paged op raising (a kernel error): quantize_and_write, dequantize_pages, paged_prefix_attention
            real = getattr(ops, self.target)

            def op(*args, **kwargs):
                inj._fail(RuntimeError)
                return real(*args, **kwargs)

            self._patch = unittest.mock.patch.object(ops, self.target, op)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        return self._patch.__exit__(*exc)


INJECT_TARGETS = ["pool_grow", "quantize_and_write", "dequantize_pages", "paged_prefix_attention",
                  "decode_attention", "index_select"]


def _caused_by(exc: BaseException, cause: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if exc is cause:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


# ----------------------------------------------------------------------------------------------- the machines

class _Lockstep(RuleBasedStateMachine):
    """Helpers and the invariant shared by the machines (no rules: each machine has its own)."""

    SETTING = "int8"

    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)
        self._clear(1)

    def _clear(self, batch: int) -> None:
        """Both caches empty: the next prompt has ``batch`` sequences."""
        self.mask = torch.ones(batch, 0, dtype=torch.long)  # the stored timeline's attention mask (0: a pad)
        self.requantized = 0  # crops that put quantized tokens back into the window since the last reset
        self.ranges = {}  # (layer, dim): the widest range of keys / values since the last reset (tolerance)

    @property
    def seen(self) -> int:
        return self.dyn.get_seq_length()

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    def _ids(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.model.config.vocab_size, (self.batch_size, n), generator=self.gen)

    def _forward(self, cache, ids, new_mask=None):
        """The model's logits for ``ids`` on ``cache``; ``new_mask``: the new tokens' attention mask (None: all real).
        The attention mask is passed once the timeline holds pads."""
        mask = None
        if new_mask is not None or not bool(self.mask.all()):
            new = torch.ones_like(ids) if new_mask is None else new_mask
            mask = torch.cat([self.mask, new], dim=1)
        with torch.no_grad():
            return self.model(ids, attention_mask=mask, **cache_kwargs(self.model, cache)).logits

    def _advance(self, ids, new_mask=None) -> None:
        """The timeline grew by ``ids`` (both caches stored them)."""
        self.mask = torch.cat([self.mask, torch.ones_like(ids) if new_mask is None else new_mask], dim=1)

    def _compare_logits(self, ours, ref, new_mask=None) -> None:
        if new_mask is not None:  # a pad's logits are not compared (its query sees nothing real)
            ours, ref = ours[new_mask.bool()], ref[new_mask.bool()]
        if self.SETTING == "exact":
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
        else:  # 8 bits: measured below 1e-2 of the logits' scale over these sequences
            err = float((ours - ref).abs().max())
            assert err <= 0.03 * float(ref.abs().max()) + 1e-3, f"logits differ by {err}"

    def _both(self, op):
        """Run ``op(cache)`` on both caches (valid arguments: both must accept)."""
        return op(self.ours), op(self.dyn)

    def _step(self, n: int, new_mask=None) -> None:
        ids = self._ids(n)
        self._compare_logits(*self._both(lambda c: self._forward(c, ids, new_mask)), new_mask)
        self._advance(ids, new_mask)

    def _select_rows(self, name: str, arg) -> None:
        """``name(arg)`` (a batch operation DynamicCache took) on the timeline's mask too."""
        if name == "batch_repeat_interleave":
            self.mask = self.mask.repeat_interleave(arg, dim=0)
        else:
            self.mask = self.mask[arg if not isinstance(arg, torch.Tensor) or arg.dtype == torch.bool else arg.long()]

    def _batch(self, name: str, arg) -> None:
        """A batch operation on both caches and the mask."""
        self._both(self._batch_op(name, arg))
        self._select_rows(name, arg)

    @staticmethod
    def _batch_op(name: str, arg):
        def op(cache):
            getattr(cache, name)(arg)
        return op

    def _refused(self, what: str, call, allowed=(ValueError, IndexError, TypeError)) -> None:
        """``call()`` on ours must raise one of ``allowed`` and change nothing."""
        before = _snapshot(self.ours)
        try:
            call()
        except allowed:
            pass
        else:
            raise AssertionError(f"{what}: accepted (expected one of {[e.__name__ for e in allowed]})")
        diff = _snapshot_diff(before, _snapshot(self.ours))
        assert diff is None, f"{what}: refused but changed the cache: {diff}"

    def _unusable_uses(self):
        ids = self._ids(1)
        return {
            "forward": lambda: self._forward(self.ours, ids),
            "crop": lambda: self.ours.crop(-1),
            "reorder_cache": lambda: self.ours.reorder_cache(torch.zeros(self.batch_size, dtype=torch.long)),
            "batch_select_indices": lambda: self.ours.batch_select_indices(torch.zeros(1, dtype=torch.long)),
            "batch_repeat_interleave": lambda: self.ours.batch_repeat_interleave(2),
            "get_seq_length": lambda: self.ours.get_seq_length(),
        }

    def _reset_both(self, batch: int | None = None) -> None:
        self.ours.reset()
        # a fresh reference: transformers 5.17's DynamicCache.reset() zeroes its tensors but keeps their length
        self.dyn = DynamicCache()
        self._clear(self.batch_size if batch is None else batch)
        assert int(self.ours.get_seq_length()) == 0, "get_seq_length after reset"
        assert all(not layer.is_initialized for layer in self.ours.layers), "a layer initialized after reset"

    def _after_failure(self, what: str, before: list, exc: BaseException) -> None:
        """An operation raised part way: the cache is as before, or unusable until reset."""
        try:
            self.ours.get_seq_length()
            unusable = False
        except CacheUnusableError:
            unusable = True
        if not unusable:
            try:
                diff = _snapshot_diff(before, _snapshot(self.ours))
            except CacheUnusableError as err:
                raise AssertionError(f"{what} failed ({exc!r}): some layer is unusable ({err}) but "
                                     f"get_seq_length() still answers") from err
            except Exception as err:
                raise AssertionError(f"{what} failed ({exc!r}) and left the cache neither unusable nor readable: "
                                     f"reading its keys/values raised {err!r}") from err
            assert diff is None, (f"{what} failed part way ({exc!r}) and left the cache changed without marking it "
                                  f"unusable: {diff}")
            return
        for name, use in self._unusable_uses().items():
            try:
                use()
            except CacheUnusableError:
                continue
            except Exception as other:
                raise AssertionError(f"after {what} failed, {name} on the unusable cache raised {other!r}, not "
                                     f"CacheUnusableError") from other
            raise AssertionError(f"after {what} failed, {name} on the unusable cache did not raise")
        self._reset_both()  # then the cache must work as a fresh one: the next rules go on from empty caches

    def _injected(self, failing: str, nth: int, what: str, call) -> tuple[bool, object]:
        """``call(self.ours)`` with ``failing`` raising on its ``nth`` call. Returns (whether it failed, its result);
        a failure is checked (as before, or unusable and then reset with DynamicCache)."""
        before = _snapshot(self.ours)
        inj = _Inject(failing, nth)
        try:
            with inj:
                out = call(self.ours)
        except BaseException as exc:
            if inj.fired is None or not _caused_by(exc, inj.fired):
                raise
            self._after_failure(f"{what} with {failing} failing", before, exc)
            return True, None
        return False, out

    # ------------------------------------------------------------------ invariants
    @invariant()
    def agrees_with_dynamic_cache(self):
        ours, dyn = self.ours, self.dyn
        assert int(ours.get_seq_length()) == dyn.get_seq_length(), (
            f"get_seq_length {ours.get_seq_length()}, DynamicCache's {dyn.get_seq_length()}")
        for i, layer in enumerate(ours.layers):
            ref = dyn.layers[i] if i < len(dyn.layers) else None
            ref_len = ref.get_seq_length() if ref is not None else 0
            k = v = None
            if layer.is_initialized:
                k, v = layer.keys, layer.values  # (a static layer's host lists follow its device state here)
            _audit_pool(i, layer)
            _check_bookkeeping(i, layer)
            assert layer.pending is None, f"layer {i}: a step left pending"
            assert int(layer.get_seq_length()) == ref_len, (
                f"layer {i}: get_seq_length {int(layer.get_seq_length())}, DynamicCache's {ref_len} (layers: "
                f"{[int(x.get_seq_length()) for x in ours.layers]} vs {[x.get_seq_length() for x in dyn.layers]})")
            if not layer.is_initialized:
                continue
            if self.SETTING == "exact":
                assert not any(layer.paged_lens), f"layer {i}: tokens quantized in the exact setting"
            if ref is None or ref.keys is None:
                assert ref_len == 0
                continue
            assert layer.batch_size == ref.keys.shape[0], (
                f"layer {i}: batch size {layer.batch_size}, DynamicCache's {ref.keys.shape[0]}")
            if ref_len == 0:
                continue
            rk, rv = ref.keys, ref.values
            pads = (self.mask == 0)[:, None, :, None]
            if pads.any():  # pads are not stored: zeros in ours
                assert pads.shape[2] == k.shape[2], f"layer {i}: {k.shape[2]} positions, the mask {pads.shape[2]}"
                assert not (k * pads).any() and not (v * pads).any(), f"layer {i}: a pad's keys/values not zero"
                rk, rv = torch.where(pads, 0.0, rk), torch.where(pads, 0.0, rv)
            if layer.sliding_window is not None and any(layer.hidden):
                released = _released_mask(layer, k.shape[2])
                assert not (k * released).any() and not (v * released).any(), f"layer {i}: released tokens not zero"
                rk, rv = torch.where(released, 0.0, rk), torch.where(released, 0.0, rv)
            _compare_tensors(i, "keys", k, rk, self._tolerance(i, rk, 2))
            _compare_tensors(i, "values", v, rv, self._tolerance(i, rv, 3))

    def _tolerance(self, i: int, ref: torch.Tensor, dim: int):
        if self.SETTING == "exact":
            return None if i == 0 else 1e-5  # later layers: the paged attention's float rounding
        # 8 bits: half a step (range / 510) of the group a token was quantized in, bounded by the widest range of
        # the layer's keys over tokens (keys are grouped per channel over tokens) or of its values over channels
        # (grouped per token) since the last reset (a group's other tokens may have been cropped since); a crop that
        # puts a partial group back into the window re-quantizes it later (another half step each); later layers
        # add the drift of attention over the quantized history
        key = (i, dim)
        widest = float((ref.amax(dim) - ref.amin(dim)).max())
        self.ranges[key] = widest = max(widest, self.ranges.get(key, 0.0))
        drift = 0.0 if i == 0 else 0.02 * float(ref.abs().max())
        return widest / 510 * (1.05 + self.requantized) + drift + 1e-6


class CacheMachine(_Lockstep):
    """QuantizedPagedCache against DynamicCache (see the module docstring)."""

    MODEL = "llama"

    def __init__(self):
        super().__init__()
        self.model = _model(self.MODEL)
        self.cfg = EXACT if self.SETTING == "exact" else INT8
        self.ours = QuantizedPagedCache(**self.cfg)
        self.dyn = DynamicCache()

    def _would_refuse_crop(self, remove: int) -> bool:
        """Whether crop must refuse (the documented limitation): a sliding-window layer's next query, at the kept
        length, would see a released token."""
        for layer in self.ours.layers:
            if not layer.is_initialized or layer.sliding_window is None or not remove:
                continue
            p, w = layer.cfg.page_size, layer.sliding_window
            zero = layer.pool.zero
            for table, q, r in zip(layer.tables, layer.paged_lens, layer.window_lens, strict=True):
                released = sum(1 for e in table if e == zero) * p
                kept = q + r - min(remove, q + r)
                if released and released > kept + 1 - w:
                    return True
        return False

    def _crop_requantizes(self, remove: int) -> bool:
        """Whether crop puts a partial group of quantized tokens back into a window (re-quantized later)."""
        for layer in self.ours.layers:
            if not layer.is_initialized:
                continue
            g = layer.cfg.group_size
            for q, r, s in zip(layer.paged_lens, layer.window_lens, layer.sinks, strict=True):
                keep_q = q + r - s - min(remove, q + r)
                if 0 < keep_q < q and keep_q % g:
                    return True
        return False

    def _crop_limit(self) -> int | None:
        """The most tokens crop may remove (None: no released page limits it)."""
        limit = None
        for layer in self.ours.layers:
            if not layer.is_initialized or layer.sliding_window is None:
                continue
            p, w, zero = layer.cfg.page_size, layer.sliding_window, layer.pool.zero
            for table, q, r in zip(layer.tables, layer.paged_lens, layer.window_lens, strict=True):
                released = sum(1 for e in table if e == zero) * p
                if released:
                    here = q + r + 1 - released - w
                    limit = here if limit is None else min(limit, here)
        return limit

    def _crop(self, arg: int, remove: int) -> None:
        """``crop(arg)`` on ours, which removes ``remove`` tokens; DynamicCache's ``crop(-remove)``."""
        refuse = self._would_refuse_crop(remove)
        before = _snapshot(self.ours)
        partial = self._crop_requantizes(remove)
        try:
            self.ours.crop(arg)
        except ValueError as exc:
            assert refuse, f"crop({arg}) refused although no released page is in the way: {exc}"
            diff = _snapshot_diff(before, _snapshot(self.ours))
            assert diff is None, f"crop({arg}) refused but changed the cache: {diff}"
            return
        assert not refuse, f"crop({arg}) accepted although it brings released sliding-window tokens back"
        self._cropped(remove, partial)

    def _cropped(self, remove: int, partial: bool) -> None:
        """Ours removed ``remove`` tokens: DynamicCache and the mask follow."""
        self.requantized += partial
        if remove:
            self.dyn.crop(-remove)
            self.mask = self.mask[:, :self.mask.shape[1] - remove]

    @invariant()
    def agrees_with_dynamic_cache(self):
        """The shared invariant, and: where a sliding-window layer released pages, a crop of one token more than it
        allows is refused and changes nothing (checked in every such state; the rule crop_at_the_limit takes exactly
        the limit)."""
        super().agrees_with_dynamic_cache()
        limit = self._crop_limit()
        if limit is not None:
            self._crop(-(limit + 1), limit + 1)

    # ------------------------------------------------------------------ rules
    @initialize(batch=st.integers(1, 3), n=st.integers(1, 40))
    def prompt(self, batch, n):
        self._clear(batch)
        self._step(n)

    @precondition(lambda self: self.seen < MAX_LEN)
    @rule(n=st.integers(2, 40))
    def chunk(self, n):
        self._step(min(n, MAX_LEN - self.seen))

    @precondition(lambda self: self.seen < MAX_LEN)
    @rule(steps=st.integers(1, 12))
    def decode(self, steps):
        for _ in range(min(steps, MAX_LEN - self.seen)):
            self._step(1)

    @rule(k=st.integers(0, 48))
    def crop(self, k):
        self._crop(-k, min(k, self.seen))

    @precondition(lambda self: self.seen > 0)
    @rule(m=st.integers(1, MAX_LEN))
    def crop_keep_first(self, m):
        """The older ``crop(m)`` form: keep the first m tokens (DynamicCache refuses m > 0: its ``crop(m - seen)``)."""
        m = min(m, self.seen + 1)
        self._crop(m, max(0, self.seen - m))

    @precondition(lambda self: self._crop_limit() is not None)
    @rule(beyond=st.booleans())
    def crop_at_the_limit(self, beyond):
        """A sliding-window layer released pages: crop exactly the most it allows (accepted), or one more
        (refused, nothing changed)."""
        remove = self._crop_limit() + beyond
        self._crop(-remove, min(remove, self.seen))

    @precondition(lambda self: self.seen > 0)
    @rule(picks=st.lists(st.integers(0, MAX_BATCH - 1), min_size=1, max_size=MAX_BATCH),
          dtype=st.sampled_from([torch.long, torch.int32]))
    def reorder(self, picks, dtype):
        self._batch("reorder_cache", torch.tensor([i % self.batch_size for i in picks], dtype=dtype))

    @precondition(lambda self: self.seen > 0)
    @rule(picks=st.lists(st.integers(0, MAX_BATCH - 1), min_size=1, max_size=MAX_BATCH),
          form=st.sampled_from(["long", "int32", "list", "bool"]))
    def select(self, picks, form):
        b = self.batch_size
        if form == "bool":
            index = torch.zeros(b, dtype=torch.bool)
            index[[i % b for i in picks]] = True
        else:
            index = [i % b for i in picks]
            if form != "list":
                index = torch.tensor(index, dtype=torch.long if form == "long" else torch.int32)
        self._batch("batch_select_indices", index)

    @precondition(lambda self: self.seen > 0 and self.batch_size * 2 <= MAX_BATCH)
    @rule(repeats=st.integers(1, 2))
    def repeat(self, repeats):
        self._batch("batch_repeat_interleave", repeats)

    @precondition(lambda self: self.seen > 0)
    @rule(row=st.integers(0, MAX_BATCH - 1), back=st.integers(0, 24), steps=st.integers(0, 8))
    def fork_and_decode(self, row, back, steps):
        """Beam search's and assisted decoding's pattern: copies of a sequence share its pages; a crop takes tokens
        back (the window then holds fewer than a group of the shared tokens), and decode steps up to the next flush
        (and ``steps`` more) write the copies' own tokens into the shared, partly filled page (copy-on-write; without
        the crop a flush only ever writes tokens the copies share)."""
        b = self.batch_size
        index = [row % b] * 2 + list(range(b)) if b * 2 <= MAX_BATCH else [row % b] * b
        self._batch("reorder_cache", torch.tensor(index[:MAX_BATCH]))
        self._crop(-back, min(back, self.seen))
        layer = self.ours.layers[0]
        if self.SETTING != "exact" and layer.is_initialized:
            flushed = list(layer.paged_lens)
            while self.seen < MAX_LEN and layer.paged_lens == flushed:
                self._step(1)
        self.decode(steps)

    @rule(batch=st.integers(1, 3), n=st.integers(1, 40))
    def reset(self, batch, n):
        self._reset_both(batch)
        self._step(n)

    @rule(pads=st.lists(st.integers(0, 39), min_size=1, max_size=3), n=st.integers(2, 40))
    def reset_with_padded_prompt(self, pads, n):
        """A new, left-padded prompt: pads are not stored (zeros in ours), the sequences' lengths differ from then on
        (sinks, windows, pages per sequence: the per-sequence paths)."""
        self._reset_both(len(pads))
        new_mask = torch.ones(len(pads), n, dtype=torch.long)
        for i, pad in enumerate(pads):
            new_mask[i, :min(pad, n - 1)] = 0
        self._step(n, new_mask)

    BAD = ["crop_float", "reorder_out_of_range", "reorder_negative", "reorder_float", "reorder_2d",
           "select_mask_of_another_length", "select_float", "select_2d", "select_out_of_range", "repeat_zero",
           "repeat_negative", "repeat_float", "update_batch", "update_heads", "update_head_dim", "update_dtype",
           "update_int", "update_tokens_mismatch", "update_3d", "update_layer_minus_1"]

    def _bad_call(self, case: str):
        b, c = self.batch_size, self.ours
        layer = next(x for x in c.layers if x.is_initialized)
        h, d, dt = layer.num_heads, layer.head_dim, layer.dtype

        def update(shape_k, shape_v=None, dtype=dt, layer_idx=0):
            k = torch.ones(shape_k, dtype=dtype)
            v = torch.ones(shape_v or shape_k, dtype=dtype)
            return lambda: c.update(k, v, layer_idx)

        long_mask = torch.zeros(b + 1, dtype=torch.bool)  # one entry too many; it selects a valid sequence
        long_mask[0] = True
        calls = {
            "crop_float": lambda: c.crop(-2.0),
            "reorder_out_of_range": lambda: c.reorder_cache(torch.tensor([0, b])),
            "reorder_negative": lambda: c.reorder_cache(torch.tensor([-1])),
            "reorder_float": lambda: c.reorder_cache(torch.tensor([0.0])),
            "reorder_2d": lambda: c.reorder_cache(torch.zeros(1, 1, dtype=torch.long)),
            "select_mask_of_another_length": lambda: c.batch_select_indices(long_mask),
            "select_float": lambda: c.batch_select_indices(torch.tensor([0.0])),
            "select_2d": lambda: c.batch_select_indices(torch.zeros(1, 1, dtype=torch.long)),
            "select_out_of_range": lambda: c.batch_select_indices(torch.tensor([b])),
            "repeat_zero": lambda: c.batch_repeat_interleave(0),
            "repeat_negative": lambda: c.batch_repeat_interleave(-1),
            "repeat_float": lambda: c.batch_repeat_interleave(1.5),
            "update_batch": update((b + 1, h, 1, d)),
            "update_heads": update((b, h + 1, 1, d)),
            "update_head_dim": update((b, h, 1, d * 2)),
            "update_dtype": update((b, h, 1, d), dtype=torch.float64),
            "update_int": update((b, h, 1, d), dtype=torch.int32),
            "update_tokens_mismatch": update((b, h, 2, d), (b, h, 1, d)),
            "update_3d": update((b, h, d)),
            "update_layer_minus_1": update((b, h, 1, d), layer_idx=-1),
        }
        return calls[case]

    @precondition(lambda self: self.seen > 0)
    @rule()
    def bad_arguments(self):
        """Every bad argument on the current state: refused, nothing changed."""
        for case in self.BAD:
            self._refused(case, self._bad_call(case))

    @precondition(lambda self: self.seen > 0)
    @rule(case=st.sampled_from(["select_negative", "reorder_bool_mask"]))
    def either_argument(self, case):
        """Arguments DynamicCache takes that ours may refuse (cleanly) or take the same way: a negative index in
        batch_select_indices (Python indexing), a bool mask of the batch size in reorder_cache (DynamicCache: a
        RuntimeError; a mask in ours)."""
        b = self.batch_size
        if case == "select_negative":
            arg, name, ref = torch.tensor([-1]), "batch_select_indices", torch.tensor([b - 1])
        else:
            arg = torch.zeros(b, dtype=torch.bool)
            arg[0] = True
            name, ref = "reorder_cache", torch.tensor([0])
        before = _snapshot(self.ours)
        try:
            getattr(self.ours, name)(arg)
        except (ValueError, IndexError, TypeError):
            diff = _snapshot_diff(before, _snapshot(self.ours))
            assert diff is None, f"{case}: refused but changed the cache: {diff}"
            return
        getattr(self.dyn, name)(ref)
        self._select_rows(name, ref)

    @rule(failing=st.sampled_from(INJECT_TARGETS), nth=st.integers(1, 3),
          op=st.sampled_from(["chunk", "decode", "crop", "reorder", "select", "repeat"]), n=st.integers(1, 40))
    def injected_failure(self, failing, nth, op, n):
        seen, b = self.seen, self.batch_size
        if op in ("reorder", "select", "repeat") and (seen == 0 or (op == "repeat" and b * 2 > MAX_BATCH)):
            op = "decode"
        if op in ("chunk", "decode") and seen >= MAX_LEN:
            op = "crop"
        remove = min(n, seen)
        if op == "crop" and self._would_refuse_crop(remove):
            return
        ids, name, arg = None, None, None
        if op in ("chunk", "decode"):
            ids = self._ids(1 if op == "decode" else min(max(n, 2), MAX_LEN - seen))
            call = functools.partial(self._forward, ids=ids)
        elif op == "crop":
            call = self._batch_op("crop", -remove)
        else:
            name, arg = {"reorder": ("reorder_cache", torch.tensor([(i * n) % b for i in range(b)])),
                         "select": ("batch_select_indices", torch.tensor(sorted({0, n % b}))),
                         "repeat": ("batch_repeat_interleave", 2)}[op]
            call = self._batch_op(name, arg)
        partial = op == "crop" and self._crop_requantizes(remove)
        failed, out = self._injected(failing, nth, op, call)
        if failed:
            return
        if op == "crop":
            self._cropped(remove, partial)
        elif ids is None:
            call(self.dyn)
            self._select_rows(name, arg)
        else:
            self._compare_logits(out, call(self.dyn))
            self._advance(ids)


MAX_CACHE_LEN = 80  # the static cache's max_cache_len


class StaticMachine(_Lockstep):
    """StaticQuantizedPagedCache (8 bits, small groups, 2 sinks) against DynamicCache on a tiny Llama: a prompt (in
    chunks before the first decode step), static decode steps up to max_cache_len, beam reorders, reset, what static
    mode refuses (crop, batch_select_indices, batch_repeat_interleave, a reorder changing the batch size, a chunk
    after decoding began, a token past max_cache_len), and injected failures."""

    def __init__(self):
        super().__init__()
        self.model = _static_model()
        self.ours = kivi_cache.StaticQuantizedPagedCache(self.model, MAX_CACHE_LEN, **INT8)
        self.dyn = DynamicCache()
        self.decoding = False  # a one-token step ran after the prompt: static mode takes no more chunks

    def teardown(self):
        unbind_static(self.model)

    def _reset_both(self, batch: int | None = None) -> None:
        super()._reset_both(batch)
        self.decoding = False

    @initialize(batch=st.integers(1, 3), n=st.integers(1, 40))
    def prompt(self, batch, n):
        self._clear(batch)
        self._step(n)

    @precondition(lambda self: self.seen + 2 < MAX_CACHE_LEN)
    @rule(n=st.integers(2, 30))
    def chunk(self, n):
        n = min(n, MAX_CACHE_LEN - 1 - self.seen)
        if not self.decoding:
            self._step(n)
            return
        ids = self._ids(n)
        self._refused("a chunk after decoding began", lambda: self._forward(self.ours, ids))

    @rule(steps=st.integers(1, 16))
    def decode(self, steps):
        for _ in range(steps):
            if self.seen >= MAX_CACHE_LEN:
                ids = self._ids(1)
                self._refused("a token past max_cache_len", lambda: self._forward(self.ours, ids))  # noqa: B023
                return
            self.decoding |= self.seen > 0  # (a one-token prompt on an empty cache is no decode step)
            self._step(1)

    @rule(picks=st.lists(st.integers(0, MAX_BATCH - 1), min_size=MAX_BATCH, max_size=MAX_BATCH))
    def reorder(self, picks):
        b = self.batch_size
        self._batch("reorder_cache", torch.tensor([i % b for i in picks[:b]]))

    @precondition(lambda self: self.seen > 0)
    @rule(case=st.sampled_from(["crop", "select", "repeat", "reorder_another_batch_size"]))
    def refused_in_static_mode(self, case):
        b, c = self.batch_size, self.ours
        calls = {"crop": lambda: c.crop(-1), "select": lambda: c.batch_select_indices(torch.tensor([0])),
                 "repeat": lambda: c.batch_repeat_interleave(2),
                 "reorder_another_batch_size": lambda: c.reorder_cache(torch.zeros(b + 1, dtype=torch.long))}
        self._refused(case, calls[case], (NotImplementedError, ValueError, IndexError, TypeError))

    @rule(batch=st.integers(1, 3), n=st.integers(1, 40))
    def reset(self, batch, n):
        self._reset_both(batch)
        self._step(n)

    @rule(failing=st.sampled_from(["append_and_flush", "paged_decode_attention", "quantize_and_write", "pool_grow",
                                   "index_select"]),
          nth=st.integers(1, 3), op=st.sampled_from(["decode", "reorder", "prompt"]), n=st.integers(1, 30))
    def injected_failure(self, failing, nth, op, n):
        b = self.batch_size
        if op == "decode" and self.seen >= MAX_CACHE_LEN:
            op = "reorder"
        decoding = op == "decode" and self.seen > 0
        ids, index = None, None
        if op == "prompt":  # a fresh prompt (reset first) of n tokens
            self._reset_both()
            ids = self._ids(n)
        elif op == "decode":
            ids = self._ids(1)
        if op == "reorder":
            index = torch.tensor([(i * n) % b for i in range(b)])
            call = self._batch_op("reorder_cache", index)
        else:
            call = functools.partial(self._forward, ids=ids)
        failed, out = self._injected(failing, nth, op, call)
        if failed:
            if self.seen == 0:
                self._step(n)  # the next rules go on from a prompt
            return
        self.decoding |= decoding
        if ids is None:
            call(self.dyn)
            self._select_rows("reorder_cache", index)
        else:
            self._compare_logits(out, call(self.dyn))
            self._advance(ids)


def _machine(model: str, setting: str, examples: int):
    cls = type(f"{model.capitalize()}{setting.capitalize()}Machine", (CacheMachine,),
               dict(MODEL=model, SETTING=setting))
    case = cls.TestCase
    case.settings = _settings(examples)
    return case


TestLlamaExact = _machine("llama", "exact", 40)
TestLlamaInt8 = pytest.mark.slow(_machine("llama", "int8", 60))
TestSlidingExact = _machine("sliding", "exact", 40)
TestSlidingInt8 = pytest.mark.slow(_machine("sliding", "int8", 60))
TestStatic = StaticMachine.TestCase
TestStatic.settings = _settings(30)

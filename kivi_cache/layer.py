"""One model layer's quantized, paged KV cache (a transformers ``CacheLayerMixin``).

State per sequence ``b``:

* ``pads[b]``: positions of the batch's virtual timeline that hold no stored
  token (left padding; those tokens are never stored when the attention hook
  sees the padding mask);
* ``paged_lens[b]`` quantized tokens in the pages listed by ``tables[b]``
  (always a multiple of ``group_size``);
* ``window_lens[b]`` tokens in full precision in ``res_k/res_v[b]``: first the sequence's
  ``sinks[b]`` attention-sink tokens (its first ``sink_length`` tokens, kept for good),
  then the newest tokens (the residual window proper);
* ``hidden[b]``: leading entries of ``tables[b]`` whose pages were released (a sliding-window
  layer: no query can see their tokens again); they point at the pool's zero page.

``seen`` is the virtual length (what ``get_seq_length`` reports and the masks
are built for): ``seen == pads[b] + paged_lens[b] + window_lens[b]`` for every b.

The layer is the transformers-facing part (update, attention, materialization, batch operations, sizes); storing
tokens into the window and the pages is :class:`kivi_cache.store.Store`, the device copy of the tables and lengths
:class:`kivi_cache.mirror.DeviceMirror`, the window's rule :mod:`kivi_cache.window`, reading the forward's mask
:mod:`kivi_cache.masks`.

Semantics every path follows: a single new token is stored first and then
attended to from the pages and residual window; a chunk of several new tokens
attends to the stored history plus its own full-precision keys and values
(causal within the chunk), and is stored afterwards. A prompt on an empty cache
is thus attended in full precision, as in KIVI.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import CacheLayerMixin

from . import checks, ops, rotation
from .batch import as_int, batch_index, repeat_index
from .config import QuantConfig
from .handles import KVHandle, PendingStep
from .masks import MaskReader, chunk_visibility, query_len
from .mirror import DeviceMirror, all_equal
from .pool import Budget, PagePool
from .store import Store
from .window import capacity


class CacheUnusableError(RuntimeError):
    """An operation on the cache failed after it had started changing it (out of memory while the pool grew, a
    kernel error while a step was stored): the cache refuses every later use until ``reset()``, instead of going on
    from a half-changed state."""


class SharedState:
    """What the layers of one cache share: the mask reader, why the cache is unusable (None: it is usable), and its
    size budget (None: none given), which warns once when a pool outgrows it."""

    __slots__ = ("masks", "unusable", "budget")

    def __init__(self, budget: Budget | None = None):
        self.masks = MaskReader()
        self.unusable: str | None = None
        self.budget = budget


class QuantizedPagedLayer(Store, DeviceMirror, CacheLayerMixin):
    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, cfg: QuantConfig, shared: SharedState | None = None):
        super().__init__()
        self.cfg = cfg
        self.shared = SharedState() if shared is None else shared  # the cache's: one for all its layers
        self.masks = self.shared.masks
        self._bits = dict(key_bits=cfg.key_bits, value_bits=cfg.value_bits, group_size=cfg.group_size)
        self.pool: PagePool | None = None
        self.rot_k = self.rot_v = None  # Hadamard matrices where cfg.rotate asks (set with the first states)
        # the model layer's sliding window (None: full attention), learned from the attention hook
        # (use_sliding_window); the layer then keeps no sink tokens
        self.sliding_window: int | None = None
        # transformers' past recording (assisted decoding): a sliding-window layer then writes every token of a step
        # (no skipped pages), so that crop can take back any of the last step's tokens
        self.record_past = False
        self._clear_sequences()

    def activate_past_recording(self, **kwargs) -> None:
        """transformers' hook before a generation that crops (assisted decoding): see ``record_past``. (Keyword
        arguments, such as 5.25's ``recurrent_states_to_keep`` for recurrent layers, do not apply.)"""
        self.record_past = True

    def use_sliding_window(self, window: int) -> bool:
        """Serve this layer as sliding-window attention of ``window`` positions (its module says so at every step).
        A layer that holds no sink tokens can (the first time: before it stores anything, its sink setting is
        dropped: sinks are the sequence's first tokens, which the window hides); one that already holds some
        cannot, nor one told another window before (False)."""
        if self.sliding_window is not None:
            return self.sliding_window == window
        if self.cfg.sink_length:
            if any(self.sinks) or any(self.paged_lens) or any(self.window_lens):
                return False
            self.cfg = dataclasses.replace(self.cfg, sink_length=0)
        self.sliding_window = window
        return True

    # ------------------------------------------------------------------ state
    def _clear_sequences(self) -> None:
        self.batch_size = 0
        self.tables: list[list[int]] = []
        self.paged_lens: list[int] = []
        self.window_lens: list[int] = []
        self.pads: list[int] = []
        self.sinks: list[int] = []
        self.hidden: list[int] = []
        self.seen = 0
        self.res_k = self.res_v = None
        self.pending: PendingStep | None = None
        self._device_tables = None  # cached (block_table, paged_lens, window_lens) device tensors
        self._bt_width = 0  # the columns of the cached device block table that hold pages (the rest: spare, -1)
        self._length_rows = None  # this batch's rows of the shared window-length table (_uniform_lengths)
        if self.pool is not None:
            self.pool.decode_runner = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.cfg.check_head_dim(d)  # raises before any state is touched
        if value_states.shape[1] != h or value_states.shape[-1] != d:
            raise ValueError(
                f"key and value heads must have the same shape (heads and head_dim), got keys "
                f"{tuple(key_states.shape)} and values {tuple(value_states.shape)}: a model whose values have "
                f"another head_dim than its keys (DeepSeek's multi-head latent attention) is not supported; use "
                f"transformers' DynamicCache for it")
        if key_states.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"key_states dtype must be float16, bfloat16 or float32, got {key_states.dtype}")
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_heads, self.head_dim = h, d
        pool = self.pool
        if pool is None or (pool.num_heads, pool.head_dim, pool.dtype, pool.device) != (h, d, self.dtype,
                                                                                          self.device):
            self.pool = PagePool(self.cfg, h, d, self.dtype, self.device, self.shared.budget)
        self._clear_sequences()
        self.batch_size = b
        self.tables = [[] for _ in range(b)]
        self.paged_lens = [0] * b
        self.window_lens = [0] * b
        self.pads = [0] * b
        self.sinks = [0] * b
        self.hidden = [0] * b
        self.rot_k, self.rot_v = rotation.matrices(self.cfg.rotate, d, self.dtype, self.device)
        cap = capacity(self.cfg.sink_length, self.cfg.residual_length, self.cfg.group_size)
        self.res_k = torch.zeros(b, h, cap, d, dtype=self.dtype, device=self.device)
        self.res_v = torch.zeros_like(self.res_k)
        self.is_initialized = True

    # ----------------------------------------------------------------- update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.check_step(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)  # checks the heads of values against keys first
        if self.pending is not None:
            self.commit(self.pending)  # the last step's attention never read its handles
        if self.rot_k is not None:
            key_states = key_states @ self.rot_k
        if self.rot_v is not None:
            value_states = value_states @ self.rot_v
        b, h, n, d = key_states.shape
        step = PendingStep(self, key_states, value_states)
        self.pending = step
        self.seen += n
        shape = (b, h, self.seen, d)
        return KVHandle(step, 0, shape), KVHandle(step, 1, shape)

    def check_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Raise, changing nothing, unless a step of these states can be stored: a usable cache, and once the layer
        holds a batch, the batch's shape, dtype and device."""
        if self.unusable is not None:
            self.check_usable()
        checks.check_states(key_states, value_states)
        if value_states.dtype != key_states.dtype:
            raise ValueError(f"key_states ({key_states.dtype}) and value_states ({value_states.dtype}) must have one "
                             f"dtype")
        if not self.is_initialized:
            return
        b, h, n, d = key_states.shape
        if (b, h, d) != (self.batch_size, self.num_heads, self.head_dim) or value_states.shape != key_states.shape:
            raise ValueError(
                f"key/value states of shape {tuple(key_states.shape)}/{tuple(value_states.shape)} do not match "
                f"the cache (batch {self.batch_size}, {self.num_heads} heads, head_dim {self.head_dim}): a cache "
                f"holds one batch of conversations; call cache.reset() (or make a new cache) for another batch")
        if key_states.dtype != self.dtype or key_states.device != self.device:
            raise ValueError(f"key/value states must have the dtype and device of the tokens stored ({self.dtype} on "
                             f"{self.device}), got {key_states.dtype} on {key_states.device}: a cache holds one "
                             f"model's states (reset() it, or make a new cache, for another dtype or device)")

    def commit(self, step: PendingStep, valid: torch.Tensor | None = None, defer_write: bool = False) -> bool:
        """Store the step's new tokens. ``valid`` ``[B, L]`` bool marks real (non-pad) tokens. ``defer_write``: a
        one-token step may leave its window write to the decode op (``new_k``/``new_v``) when no group is flushed;
        returns whether it did (the caller must then pass the step's key and value to the op)."""
        if step.done:
            return False
        if step is not self.pending:
            raise RuntimeError("kivi_cache: a stale key/value handle was used after a later cache update")
        step.done = True
        self.pending = None
        k, v = step_tensors(step)
        try:
            if valid is None and k.shape[2] == 1:
                return self._append_one(k, v, defer_write)
            # the stored index of each sequence's first new token: the step's first query (a sliding-window layer
            # keeps what it sees, so that crop may take the step's tokens back: assisted decoding's rejected candidates)
            first = ([q + r for q, r in zip(self.paged_lens, self.window_lens, strict=True)] if self.sliding_window
                     else None)
            self._append_chunk(k, v, valid)
            if first is not None:
                self._release_hidden_pages(first)
        except BaseException as exc:  # the step is counted (seen) but only partly stored
            self.mark_unusable("storing a step", exc)
            raise
        return False


    # -------------------------------------------------------------- attention
    def attend(self, step: PendingStep, query: torch.Tensor, attention_mask, scaling: float, sdpa_fn, module,
               window: int | None = None, sink_logits=None, **kwargs) -> torch.Tensor:
        """Attention for the step's queries ``[B, Hq, L, D]``; returns ``[B, L, Hq, D]``. ``window``: the layer's
        sliding window (the hook passes it once :meth:`use_sliding_window` accepted it); ``sink_logits``: learned
        attention sinks (``[Hq]``; ``sdpa_fn`` computes them itself from ``kwargs``). With rotated keys the queries
        are rotated alike, with rotated values the output is turned back (:mod:`kivi_cache.rotation`)."""
        if self.rot_k is not None:
            query = query @ self.rot_k
        out = self._attend(step, query, attention_mask, scaling, sdpa_fn, module, window, sink_logits, **kwargs)
        return out if self.rot_v is None else out @ self.rot_v

    def _attend(self, step: PendingStep, query: torch.Tensor, attention_mask, scaling: float, sdpa_fn, module,
                window: int | None, sink_logits, **kwargs) -> torch.Tensor:
        n = query.shape[2]
        valid = self.masks.valid_tokens(attention_mask, n, self.batch_size)
        bits = self._bits
        if n == 1:
            # a step that flushes nothing leaves its window write to the decode op: two copies fewer per layer in a
            # host-bound eager step
            deferred = self.commit(step, valid, defer_write=True)
            try:
                bt, ql, rl = self._device_state()
                pool = self.pool
                run = pool.decode_runner  # plan once, run every step until the block table or window is replaced
                if (run is None or run.block_table is not bt or run.lengths is not ql or run.res_k is not self.res_k
                        or run.sliding_window != window):
                    run = pool.decode_runner = ops.DecodeRunner(bt, ql, pool.args(), res_k=self.res_k,
                                                                res_v=self.res_v,
                                                                sliding_window=window, own=True, **bits)
                if deferred:  # the op writes the step's token into the window (counted already by commit)
                    k, v = step_tensors(step)
                    return run(query.select(2, 0), rl, scaling, k, v, sink_logits).unsqueeze(1)
            except BaseException as exc:
                if deferred:
                    self.mark_unusable("storing a step", exc)
                raise
            return run(query.select(2, 0), rl, scaling, sink_logits=sink_logits).unsqueeze(1)
        if not any(self.paged_lens) and not any(self.window_lens):
            # a prompt on an empty cache: plain full-precision attention over it
            mask = None if attention_mask is None else attention_mask[..., -n:]
            out, _ = sdpa_fn(module, query, step.key, step.value, mask, scaling=scaling, **kwargs)
            self.commit(step, valid)
            return out
        bt, ql, rl = self._device_state()
        new_mask = chunk_visibility(attention_mask, n, self.batch_size, query.device, window)
        with checks.own_state():
            out = ops.paged_prefix_attention(
                query, bt, ql, self.pool.args(), res_k=self.res_k, res_v=self.res_v, res_lengths=rl,
                new_k=step.key, new_v=step.value, sm_scale=scaling, sliding_window=window, sink_logits=sink_logits,
                **bits, new_mask=new_mask)
        self.commit(step, valid)
        return out.transpose(1, 2)

    def materialize(self, step: PendingStep, valid: torch.Tensor | None = None):
        """Full-precision ``[B, H, seen, D]`` keys and values for attention functions the hook does not serve.
        ``valid`` ``[B, L]`` bool marks the step's real tokens (None: all; pads are then stored)."""
        n = step.key.shape[2]
        if n == 1:
            self.commit(step, valid)
            return self._unrotated(*self._stored_layout(self.seen))
        k, v = self._stored_layout(self.seen - n, tail=(step.key, step.value))
        self.commit(step, valid)
        return self._unrotated(k, v)

    def _unrotated(self, k, v):
        """Stored (possibly rotated) keys and values in the model's own basis."""
        return (k if self.rot_k is None else k @ self.rot_k), (v if self.rot_v is None else v @ self.rot_v)

    # --------------------------------------- DynamicLayer's keys/values, for code that reads a layer's tensors
    @property
    def keys(self) -> torch.Tensor | None:
        """The cached keys in full precision, ``[B, H, seen, D]``, as ``DynamicLayer.keys`` holds them (stored
        tokens dequantized, right-aligned, pads and a sliding-window layer's released tokens as zeros; a pending
        step's tokens included, nothing committed);
        None before the first update. For code that reads a layer's tensors (Whisper's ``generate`` with
        ``return_dict_in_generate``, iterating the cache): a new tensor each time, so writing to it changes
        nothing, and a dequantization per read."""
        return self._full_precision(0)

    @keys.setter
    def keys(self, value) -> None:
        self._read_only("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """The cached values in full precision, ``[B, H, seen, D]`` (see :attr:`keys`)."""
        return self._full_precision(1)

    @values.setter
    def values(self, value) -> None:
        self._read_only("values", value)

    @staticmethod
    def _read_only(name: str, value) -> None:
        if value is not None:  # CacheLayerMixin.__init__ sets None
            raise AttributeError(f"QuantizedPagedLayer.{name} is read-only: the dequantized history, computed on "
                                 "each read (the cache stores codes, scales and a full-precision window)")

    def _full_precision(self, which: int):
        if not self.is_initialized:
            return None
        self.check_usable()
        step = self.pending
        if step is None:
            return self._unrotated(*self._stored_layout(self.seen))[which]
        return self._unrotated(*self._stored_layout(self.seen - step.key.shape[2],
                                                    tail=(step.key, step.value)))[which]

    def _stored_layout(self, length: int, tail=None):
        """Stored tokens dequantized, right-aligned in a ``[B, H, length, D]`` timeline (pads as zeros); ``tail``:
        keys and values ``[B, H, n, D]`` appended (-> ``[B, H, length + n, D]``)."""
        b, h, d = self.batch_size, self.num_heads, self.head_dim
        if length == 0:
            k = torch.zeros(b, h, 0, d, dtype=self.dtype, device=self.device)
            if tail is None:
                return k, torch.zeros_like(k)
            return torch.cat([k, tail[0]], dim=2), torch.cat([k, tail[1]], dim=2)
        cfg = self.cfg
        bt, ql, _ = self._device_state()
        bits = dict(key_bits=cfg.key_bits, value_bits=cfg.value_bits, group_size=cfg.group_size)
        if (b and self.paged_lens[0] + self.window_lens[0] == length and all_equal(self.paged_lens)
                and all_equal(self.window_lens) and all_equal(self.sinks) and not any(self.hidden)):
            # no pads, nothing released (eager attention's step): sinks, quantized tokens and the newest written
            # straight into one buffer
            q, r, s = self.paged_lens[0], self.window_lens[0], self.sinks[0]
            k = torch.empty(b, h, length + (0 if tail is None else tail[0].shape[2]), d, dtype=self.dtype,
                            device=self.device)
            v = torch.empty_like(k)
            for i, (out, res) in enumerate(((k, self.res_k), (v, self.res_v))):
                out[:, :, :s] = res[:, :, :s]
                out[:, :, s + q:length] = res[:, :, s:r]
                if tail is not None:
                    out[:, :, length:] = tail[i]
            with checks.own_state():
                ops.dequantize_pages(bt, ql, self.pool.args(), **bits, max_len=q,
                                     out=(k[:, :, s:s + q], v[:, :, s:s + q]))
            return k, v
        with checks.own_state():
            qk, qv = ops.dequantize_pages(bt, ql, self.pool.args(), **bits, max_len=max(self.paged_lens))
        k = torch.zeros(b, h, length, d, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        for i in range(b):
            q, r, s = self.paged_lens[i], self.window_lens[i], self.sinks[i]
            start = length - q - r  # timeline: [pads][sinks][quantized][newest]
            k[i, :, start:start + s] = self.res_k[i, :, :s]
            v[i, :, start:start + s] = self.res_v[i, :, :s]
            z = min(q, self.hidden[i] * self.cfg.page_size)  # released tokens stay zeros (a static ring reuses pages)
            k[i, :, start + s + z:start + s + q] = qk[i, :, z:q]
            v[i, :, start + s + z:start + s + q] = qv[i, :, z:q]
            k[i, :, start + s + q:length] = self.res_k[i, :, s:r]
            v[i, :, start + s + q:length] = self.res_v[i, :, s:r]
        if tail is not None:
            return torch.cat([k, tail[0]], dim=2), torch.cat([v, tail[1]], dim=2)
        return k, v

    # ------------------------------------------------- sizes, as transformers asks
    def get_seq_length(self) -> int:
        if self.unusable is not None:
            self.check_usable()
        return self.seen

    def host_length(self) -> int:
        """The tokens stored or pending, as the host counts them (no device read)."""
        return self.seen

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        return self.seen + query_len(query_length), 0

    def get_max_length(self) -> int:
        return -1

    # ------------------------------------------------------- batch operations
    # Each operation checks its arguments against the layer first (raising leaves the layer as it was), then
    # changes it through _apply (a failure part way marks the layer unusable). The cache runs the checks of every
    # layer before it changes any (QuantizedPagedCache.crop and the batch operations).
    def _flush_pending(self) -> None:
        if self.pending is not None:
            self.commit(self.pending)

    def _apply(self, what: str, change, *args) -> None:
        try:
            change(*args)
        except BaseException as exc:
            self.mark_unusable(what, exc)
            raise

    def check_usable(self) -> None:
        if self.unusable is not None:
            raise CacheUnusableError(f"kivi_cache: this cache is unusable: {self.unusable}; call reset() (or make a "
                                     f"new cache) before using it again")

    @property
    def unusable(self) -> str | None:
        """Why the cache refuses use until reset() (None: it is usable; see CacheUnusableError)."""
        return self.shared.unusable

    def mark_unusable(self, what: str, exc: BaseException) -> None:
        """Mark the whole cache unusable (its layers may now disagree) until reset()."""
        if self.shared.unusable is None:
            self.shared.unusable = f"{what} failed part way ({type(exc).__name__}: {exc})"

    def check_index(self, index, name: str) -> list[int]:
        """``index`` (a 1-d integer tensor or sequence of ints in ``[0, batch)``, or a bool mask of the batch size) as
        a list of ints; IndexError naming ``name`` for anything else."""
        return batch_index(index, self.batch_size, name)

    def _select(self, index: list[int]) -> None:
        """Sequence ``i`` becomes the current sequence ``index[i]`` (checked by :meth:`check_index`)."""
        new_tables = [list(self.tables[i]) for i in index]
        rows = torch.tensor(index, dtype=torch.long, device=self.device)
        res_k = self.res_k.index_select(0, rows)  # allocations first: nothing changed yet if they fail
        res_v = self.res_v.index_select(0, rows)
        for t in new_tables:
            self.pool.share(t)
        for t in self.tables:
            self.pool.release(t)
        self.tables = new_tables
        self.paged_lens = [self.paged_lens[i] for i in index]
        self.window_lens = [self.window_lens[i] for i in index]
        self.pads = [self.pads[i] for i in index]
        self.sinks = [self.sinks[i] for i in index]
        self.hidden = [self.hidden[i] for i in index]
        self.res_k, self.res_v = res_k, res_v
        self.batch_size = len(index)
        self._length_rows = None
        self._device_tables = None
        self.pool.decode_runner = None  # it holds the old window

    def select(self, index, name: str = "indices") -> None:
        """Check ``index`` (:meth:`check_index`), then :meth:`_select` it."""
        if not self.is_initialized:
            return
        self.check_usable()
        self._flush_pending()
        self._apply("selecting sequences", self._select, self.check_index(index, name))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select(beam_idx, "beam_idx")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.select(repeat_index(self.batch_size, repeats), "repeats")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select(indices, "indices")

    def check_crop(self, tokens_to_remove) -> int:
        """The tokens ``crop(tokens_to_remove)`` removes (0: none), or ValueError if it cannot (a pending step must
        be committed first: its tokens count)."""
        n = as_int(tokens_to_remove)
        if n is None:
            raise ValueError(f"crop takes an int (-n: remove the n newest tokens; m > 0: keep the first m), got "
                             f"{tokens_to_remove!r}")
        if not self.is_initialized:
            return 0
        remove = min(-n if n <= 0 else max(0, self.seen - n), self.seen)
        p, w = self.cfg.page_size, self.sliding_window
        for i in range(self.batch_size):
            kept = self.paged_lens[i] + self.window_lens[i] - min(remove, self.paged_lens[i] + self.window_lens[i])
            # the next query (stored index kept) sees indices > kept - w
            if remove and self.hidden[i] and self.hidden[i] * p > kept + 1 - w:
                raise ValueError(
                    f"crop({tokens_to_remove}) would bring tokens back into the sliding window ({w}) of a layer that "
                    f"released their pages (sequence {i}: {self.hidden[i] * p} released, {kept} would stay); "
                    f"crop by at most {self.paged_lens[i] + self.window_lens[i] + 1 - self.hidden[i] * p - w} "
                    f"tokens here")
        return remove

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens: ``crop(-n)`` removes n; ``crop(m)`` with m > 0 keeps the first m (the older
        transformers' form); ``crop(0)`` removes nothing (transformers >= 5.24 calls it when assisted decoding
        accepted every candidate)."""
        self.check_usable()
        self._flush_pending()
        remove = self.check_crop(tokens_to_remove)
        if remove:
            self._apply("crop", self._crop, remove)

    def _crop(self, remove: int) -> None:
        """Remove the ``remove`` newest tokens (checked by :meth:`check_crop`)."""
        cfg = self.cfg
        g, p = cfg.group_size, cfg.page_size
        for i in range(self.batch_size):
            q, r, s = self.paged_lens[i], self.window_lens[i], self.sinks[i]
            drop = min(remove, q + r)  # newest first: window tokens, then pages, then sinks
            if drop <= r - s:
                self.window_lens[i] = r - drop
                continue
            keep_q = q + (r - s) - drop  # tokens that stay in pages (negative: sinks go too)
            start = max(0, keep_q) // g * g  # a partial group goes back to the residual window
            if keep_q > start:
                bt, ql, _ = self._device_state()
                dk, dv = ops.dequantize_pages(bt[i:i + 1], ql[i:i + 1], self.pool.args(), key_bits=cfg.key_bits,
                                              value_bits=cfg.value_bits, group_size=g, max_len=keep_q)
                self.res_k[i, :, s:s + keep_q - start] = dk[0, :, start:keep_q]
                self.res_v[i, :, s:s + keep_q - start] = dv[0, :, start:keep_q]
            if keep_q >= 0:
                self.window_lens[i] = s + keep_q - start
            else:
                self.sinks[i] = self.window_lens[i] = s + keep_q
            self.paged_lens[i] = start
            n_pages = -(-start // p)
            self.pool.release(self.tables[i][n_pages:])
            del self.tables[i][n_pages:]
            self._device_tables = None
        self.pads = [max(0, x - max(0, remove - (self.seen - x))) for x in self.pads]
        self.seen -= remove
        self._device_tables = None

    def reset(self) -> None:
        if self.pool is not None:
            for t in self.tables:
                self.pool.release(t)
        self._clear_sequences()
        self.is_initialized = False
        self.shared.unusable = None

    def offload(self):
        raise NotImplementedError("kivi_cache does not support cache offloading")

    def prefetch(self):
        raise NotImplementedError("kivi_cache does not support cache offloading")

    # ----------------------------------------------------------------- memory
    def _held_page_tokens(self) -> int:
        """Quantized tokens the pages hold: a page shared by several sequences (beams) counted once, by its
        fullest sequence."""
        p, held, zero = self.cfg.page_size, {}, self.pool.zero
        for table, q, h in zip(self.tables, self.paged_lens, self.hidden, strict=True):
            for j, page in enumerate(table):
                if page != zero and j >= h:  # released entries (a static ring's) hold nothing
                    held[page] = max(held.get(page, 0), min(p, max(0, q - j * p)))
        return sum(held.values())

    def memory_stats(self) -> dict:
        if self.pool is None:
            return {}
        c, h, d = self.cfg, self.num_heads, self.head_dim
        per_page = self.pool.page_nbytes()
        # quantized tokens still held (a sliding-window layer's released ones are not: they count nowhere)
        live_q = sum(self.paged_lens) - sum(self.hidden) * c.page_size
        held = self._held_page_tokens()
        elem = self.dtype.itemsize
        live_r = sum(self.window_lens)
        live_s = sum(self.sinks)
        residual_alloc = 0 if self.res_k is None else 2 * self.res_k.numel() * elem
        token_bytes = 2 * h * d * elem  # a key and a value in full precision
        # the baseline: a DynamicCache of these tokens (pads included in its tensors; a sliding-window layer's holds
        # the last window - 1 positions, as transformers' DynamicSlidingWindowLayer)
        stored = [q + r for q, r in zip(self.paged_lens, self.window_lens, strict=True)]
        positions = max((p + n for p, n in zip(self.pads, stored, strict=True)), default=0)
        kept = positions if self.sliding_window is None else min(positions, self.sliding_window - 1)
        return {
            "quantized_tokens": live_q,
            "residual_tokens": live_r,
            "codes": per_page["codes"] * held // c.page_size,
            "scales": per_page["scales"] * held // c.page_size,
            "zeros": per_page["zeros"] * held // c.page_size,
            "residual": live_r * token_bytes,
            "sink_tokens": live_s,
            "sinks": live_s * token_bytes,
            "residual_allocated": residual_alloc,
            "pool_allocated": self.pool.allocated_bytes(),
            "pages_total": self.pool.capacity,
            "pages_in_use": self.pool.pages_in_use,
            "fp16_equivalent": 2 * (live_q + live_r) * h * d * 2,
            "dtype": self.dtype,
            "batch_size": self.batch_size,
            "seq_length": positions,
            "baseline_live": sum(min(n, kept) for n in stored) * token_bytes,
            "baseline_allocated": self.batch_size * kept * token_bytes,
        }



def step_tensors(step: PendingStep) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's keys and values as the cache stores them: without autograd history (a forward run with grad
    enabled still attends through ``step.key``/``step.value``; the cache keeps data, not graphs)."""
    k, v = step.key, step.value
    if k.requires_grad or v.requires_grad:
        return k.detach(), v.detach()
    return k, v

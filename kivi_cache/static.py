"""A compileable variant of the cache: fixed shapes and device-side state during decode.

``StaticQuantizedPagedCache(model, max_cache_len)`` stores the prompt like
:class:`~kivi_cache.QuantizedPagedCache` (eagerly), then switches every layer to a static
decode mode in which a step is tensor operations only, so ``torch.compile`` (``fullgraph``,
CUDA graphs) can capture it and ``generate`` compiles the decode step on its own
(``is_compileable``):

* every sequence owns a fixed range of pages for ``max_cache_len`` tokens (block table built
  once, no page allocation while decoding);
* quantized length, residual length and sink count are device tensors;
* a step's window write and the flush of full windows are one kernel
  (``kivi_cache::append_and_flush``): no host branch, and only the sequences whose window is full quantize a
  group and move their window; the lengths advance by tensor arithmetic;
* the paged ops are ``torch.library`` custom ops (``kivi_cache::paged_decode_attention``,
  ``kivi_cache::append_and_flush``), opaque to the compiler and captured whole by CUDA graphs; the decode op
  always merges the partial results in a second kernel (``merge=False``): the in-kernel merge's arrival counts,
  allocated by a first call, would come from the CUDA graphs' pool during inductor's warm-up and outlive it, which
  the graphs' recording refuses;
* attention finds its layer through the attention module it is called for (the cache binds
  itself to the model's attention modules; several static caches of one model may be in use at once).

Same stored values and attention as ``QuantizedPagedCache`` with the same settings (tested token for token),
sliding windows included (the step's attention reads the window the prompt's attention learned; in static mode
a sliding layer's sequence reuses a ring of :func:`ring_pages` pages, ``ceil((window - residual_length) /
page_size)``, where a full layer's owns the pages of ``max_cache_len``: Gemma 3, GPT-OSS and Mistral-style
models hold their sliding layers' window only, as transformers' StaticCache does). Beam search copies the
chosen beams' pages into the others' (eagerly, as generate runs it). Not supported in static mode: cropping,
several tokens per sequence after the first decode step (assisted decoding), growing past ``max_cache_len``.
A prompt may come in chunks (``generate(..., prefill_chunk_size=)``): each chunk is stored eagerly, also when the
forward is compiled (generate compiles the chunks' forward too): the cache update and the attention of a step before
the static mode are ``torch.compiler.disable``'d, so such a step breaks its graph once per layer into plain Python
and dynamo never traces the bookkeeping. The compiled chunks still cost compile time and CUDA-graph memory:
:func:`kivi_cache.prefill` stores the prompt without them. Speed against transformers' compiled ``StaticCache``:
the benchmarks' documentation.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from . import hook, ops
from .cache import INT4_PRESET, QuantizedPagedCache
from .config import _check_int
from .kernels.checks import PoolTensors
from .layer import QuantizedPagedLayer
from .masks import query_len
from .window import window_append

# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("kivi_cache::paged_decode_attention", mutates_args=())
def _decode_op(q: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor, k_codes: torch.Tensor,
               k_scale: torch.Tensor, k_zero: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor,
               v_zero: torch.Tensor, res_k: torch.Tensor, res_v: torch.Tensor, res_lengths: torch.Tensor,
               key_bits: int, value_bits: int, group_size: int, sm_scale: float,
               sliding_window: int = 0, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    pool = PoolTensors(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)  # flattened for torch.library
    return ops.paged_decode_attention(q, block_table, lengths, pool, res_k=res_k, res_v=res_v,
                                      res_lengths=res_lengths, key_bits=key_bits, value_bits=value_bits,
                                      group_size=group_size, sm_scale=sm_scale, merge=False,
                                      sliding_window=sliding_window or None, sink_logits=sink_logits)


@_decode_op.register_fake
def _(q, *args):
    return torch.empty_like(q)


@torch.library.custom_op("kivi_cache::append_and_flush",
                         mutates_args=("res_k", "res_v", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale",
                                       "v_zero"))
def _append_op(new_k: torch.Tensor, new_v: torch.Tensor, res_k: torch.Tensor, res_v: torch.Tensor,
               res_lengths: torch.Tensor, sink_lengths: torch.Tensor, lengths: torch.Tensor, block_table: torch.Tensor,
               k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor, v_codes: torch.Tensor,
               v_scale: torch.Tensor, v_zero: torch.Tensor, key_bits: int, value_bits: int, group_size: int,
               residual_length: int, sink_length: int, clip_keys: bool, clip_values: bool) -> None:
    pool = PoolTensors(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)  # flattened for torch.library
    ops.append_and_flush(new_k, new_v, res_k, res_v, res_lengths, sink_lengths, lengths, block_table, pool,
                         key_bits=key_bits, value_bits=value_bits, group_size=group_size,
                         residual_length=residual_length, sink_length=sink_length, clip_keys=clip_keys,
                         clip_values=clip_values)


@_append_op.register_fake
def _(*args):
    return None


# ----------------------------------------------------------------------------- layer


def ring_pages(cfg, window: int) -> int:
    """Pages per sequence that a sliding-window layer (no sinks) reuses in turn in static mode: ``ceil((window -
    residual_length) / page_size)``, at least 1. Table entry ``j`` names the page of entry ``j - n``, so the token
    at slot ``k`` of entry ``m`` is overwritten once the sequence's quantized length ``q`` passes ``(m + n) P + k``.
    A step's query (stored index ``t``) sees the tokens after ``t - window``, and after the step's flush the residual
    window holds at least ``residual_length`` tokens (``t >= q + R - 1``): a token it sees has ``m P + k >= q + R -
    window``. Both at once need ``n P < window - R``: with ``n P >= window - R`` no token a query sees has been
    overwritten (tests/test_static.py runs one page fewer and gets other logits)."""
    return max(1, -(-(window - cfg.residual_length) // cfg.page_size))



class StaticQuantizedPagedLayer(QuantizedPagedLayer):
    is_compileable = True
    is_croppable = False
    SPARE_COLUMNS = False  # the static step's flush writes the column its length names: exact columns

    def __init__(self, cfg, max_cache_len: int, window_hint: int | None = None, shared=None):
        super().__init__(cfg, shared)
        self.max_cache_len = max_cache_len
        self.static = False
        self.decoding = False  # a one-token step ran in static mode: no more prompt chunks
        # the model layer's sliding window as its module declares it (sizes the pool before the hook says so)
        self.window_hint = window_hint
        self.ring: int | None = None  # static mode of a sliding-window layer: pages per sequence, reused in turn
        self._eager_widths: list[int] = []  # the tables' widths before _to_static extended them
        self.materialized_prompt = False
        self._kept: dict[str, torch.Tensor] = {}  # see _reuse

    def get_max_length(self) -> int:
        return self.max_cache_len

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.static = self.decoding = self.materialized_prompt = False
        self.ring = None
        # after reset(), the tensors a compiled step captured serve again where they fit (no recompilation)
        self.res_k = self._reuse("res_k", self.res_k.zero_())
        self.res_v = self._reuse("res_v", self.res_v.zero_())
        per_seq = self._pages_per_sequence()
        if self.window_hint:  # a sliding-window layer's sequence reuses a few pages (_to_static: the ring)
            per_seq = min(per_seq, ring_pages(self.cfg, self.window_hint))
        need = key_states.shape[0] * per_seq
        if self.pool.capacity < need:  # the whole pool at once: no doubling growth, nothing to copy later
            self.pool._grow(need)

    def _pages_per_sequence(self) -> int:
        """Pages a sequence of up to max_cache_len cached tokens can fill: its whole key groups beyond the sinks and
        the window (QuantConfig.pages_per_sequence; the window's and the sinks' tokens take no pages)."""
        return max(1, self.cfg.pages_per_sequence(self.max_cache_len))

    def materialize(self, step, valid=None):
        # the prompt's attention read the full-precision history, not the pages through the hook (eager or flash
        # attention, output_attentions, soft-capping, sinks): the static decode step could not serve it either
        self.materialized_prompt = True
        return super().materialize(step, valid)

    def commit(self, step, valid=None, defer_write=False) -> bool:
        super().commit(step, valid)  # the window written here (a one-token prompt too): the static state reads it
        if not self.static:
            self._to_static()
        return False

    def _to_static(self) -> None:
        """After the prompt: fixed pages for every sequence, state as device tensors. A sliding-window layer's
        sequence gets a ring of ``ring`` pages: its table's later entries name them in turn (entry ``j`` the page of
        entry ``j - ring``), so a flush overwrites the tokens of ``ring`` pages before, which no query sees any more
        (:meth:`_ring_pages`); the prompt's visible pages are the ring's first."""
        maxp = self._pages_per_sequence()
        self.ring = self._ring_pages(maxp)
        self._eager_widths = [len(table) for table in self.tables]
        if self.ring is None:
            fresh = [max(0, maxp - len(table)) for table in self.tables]
        else:
            fresh = [max(0, min(maxp, h + self.ring) - len(table)) for table, h in zip(self.tables, self.hidden,
                                                                                       strict=True)]
        # exactly the pages missing (a sliding-window layer dropped its sinks after lazy_initialization sized the
        # pool: a sequence then has more whole groups; allocate() would grow the pool by at least 1/8 of it)
        missing = sum(fresh) - len(self.pool.free)
        if missing > 0:
            self.pool._grow(self.pool.capacity + missing)
        for table, h in zip(self.tables, self.hidden, strict=True):
            while len(table) < maxp:
                j = len(table)
                if self.ring is not None and j - self.ring >= h:
                    table.append(table[j - self.ring])  # one more reference to the ring's page
                    self.pool.share(table[-1:])
                else:
                    table.append(self.pool.allocate())
        self._device_tables = None
        bt, ql, rl = self._device_state()
        self.block_table = self._reuse("block_table", bt)
        self.paged_len = self._reuse("paged_len", ql.clone())
        self.window_len = self._reuse("window_len", rl.clone())
        self.sink_len = self._reuse("sink_len", torch.tensor(self.sinks, dtype=torch.int32, device=self.device))
        self.seen_t = self._reuse("seen_t", torch.tensor(self.seen, device=self.device))
        self.host_seen = self.seen  # the same count on the host, for the eager check in _update_static
        self.static = True
        if not torch.compiler.is_compiling():
            for t in (*self.pool.args(), self.res_k, self.res_v, self.block_table, self.paged_len, self.window_len,
                      self.sink_len, self.seen_t):
                torch._dynamo.mark_static_address(t)

    def _reuse(self, name: str, fresh: torch.Tensor) -> torch.Tensor:
        """``fresh``'s values in the tensor this layer last used as ``name`` where it has the same shape, dtype and
        device (the one a compiled step captured), else ``fresh``, kept for next time."""
        kept = self._kept.get(name)
        if kept is None or kept is fresh or (kept.shape, kept.dtype, kept.device) != (fresh.shape, fresh.dtype,
                                                                                       fresh.device):
            self._kept[name] = fresh
            return fresh
        return kept.copy_(fresh)

    def reset(self) -> None:
        """Empty the layer for a new generation (its pool and the tensors a compiled step captured are kept)."""
        super().reset()
        self.static = self.decoding = self.materialized_prompt = False
        self.ring = None
        self._eager_widths = []

    def _ring_pages(self, maxp: int) -> int | None:
        """Pages per sequence of a sliding-window layer's ring (None: full attention, or a ring no smaller than the
        fixed pages): :func:`ring_pages`, or the pages the prompt left visible if more."""
        w = self.sliding_window
        if w is None:
            return None
        ring = max([ring_pages(self.cfg, w)] + [len(table) - h for table, h in zip(self.tables, self.hidden,
                                                                                     strict=True)])
        return ring if ring < maxp else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.static and key_states.shape[2] == 1:
            return self._update_static(key_states, value_states)
        return self._update_eager(key_states, value_states)

    @torch.compiler.disable
    def _update_eager(self, key_states, value_states):
        """The prompt or a chunk of it, through the host bookkeeping. Never traced: generate compiles the forward
        of every prompt chunk too, and dynamo would otherwise trace (and recompile for each chunk) the lists,
        page allocation and lazy handles; a compiled chunk breaks its graph here and runs this as plain Python."""
        # every check before _to_dynamic changes the bookkeeping (super().update checks the states again: cheap)
        self.check_step(key_states, value_states)
        if self.static and self.decoding:
            raise ValueError("StaticQuantizedPagedCache: after the prompt, only one token per sequence and step is "
                             "supported (no assisted decoding or chunked continuation); use QuantizedPagedCache; for "
                             "another batch of conversations, call cache.reset() (or make a new cache)")
        if self.seen + key_states.shape[2] >= self.max_cache_len:
            raise ValueError(f"the prompt ({self.seen + key_states.shape[2]} tokens) does not fit "
                             f"max_cache_len={self.max_cache_len} (prompt + new tokens)")
        if self.static:
            self._to_dynamic()  # another chunk of the prompt (generate's prefill_chunk_size): eager again
        return super().update(key_states, value_states)

    def _update_static(self, key_states, value_states):
        """One token per sequence as tensor operations on fixed shapes: the step torch.compile captures whole."""
        if self.materialized_prompt:  # before anything is written; a constant for the compiler (set by the prompt)
            raise ValueError(
                "StaticQuantizedPagedCache: this layer's attention read the materialized full-precision history "
                "for the prompt (attn_implementation other than 'sdpa'/'kivi', output_attentions, soft-capping or "
                "attention sinks), which the static decode step cannot serve; load the model with "
                "attn_implementation='sdpa' or use QuantizedPagedCache")
        if self.unusable is not None:
            self.check_usable()
        if not torch.compiler.is_compiling():  # eager: a clear error before anything is written
            if self.host_seen + 1 > self.max_cache_len:
                raise ValueError(f"StaticQuantizedPagedCache: more tokens than max_cache_len={self.max_cache_len} "
                                 f"(prompt + new tokens); make the cache with a larger max_cache_len")
            if (key_states.shape != value_states.shape or key_states.shape[:2] != self.res_k.shape[:2]
                    or key_states.shape[3] != self.head_dim or key_states.dtype != self.dtype
                    or value_states.dtype != self.dtype or key_states.device != self.device
                    or value_states.device != self.device):
                raise ValueError(f"key/value states must be [batch={self.batch_size}, heads={self.num_heads}, 1, "
                                 f"head_dim={self.head_dim}] {self.dtype} on {self.device} (the stored tokens'), got "
                                 f"{list(key_states.shape)} {key_states.dtype} on {key_states.device} and "
                                 f"{list(value_states.shape)} {value_states.dtype} on {value_states.device}: a "
                                 f"cache holds one batch of conversations; call cache.reset() (or make a new cache) "
                                 f"for another batch")
        if key_states.requires_grad or value_states.requires_grad:  # the cache keeps data, not graphs
            key_states, value_states = key_states.detach(), value_states.detach()
        if self.rot_k is not None:  # stored rotated, as the eager path stores them (kivi_cache.rotation)
            key_states = key_states @ self.rot_k
        if self.rot_v is not None:
            value_states = value_states @ self.rot_v
        cfg, g = self.cfg, self.cfg.group_size
        torch.ops.kivi_cache.append_and_flush(key_states, value_states, self.res_k, self.res_v, self.window_len,
                                              self.sink_len, self.paged_len, self.block_table, *self.pool.args(),
                                              cfg.key_bits, cfg.value_bits, g, cfg.residual_length, cfg.sink_length,
                                              cfg.clip_args["clip_keys"], cfg.clip_args["clip_values"])
        self.decoding = True
        if not torch.compiler.is_compiling():
            self.host_seen += 1
        # the lengths as the op read them, advanced by the window rule it follows
        sinks, flushed = window_append(self.window_len, self.sink_len, 1, **self._rule())
        self.sink_len.copy_(sinks)
        self.paged_len.add_(flushed)
        self.window_len.add_(1 - flushed)
        self.seen_t.add_(1)
        if torch.compiler.is_compiling():  # no host check above: past max_cache_len a flush would find no page of
            # its own; fail (asynchronously: no host sync) instead of overwriting the sequence's last page
            torch._assert_async(self.seen_t <= self.max_cache_len,
                                "StaticQuantizedPagedCache: more tokens than max_cache_len (prompt + new tokens)")
        return self.res_k, self.res_v

    def _to_dynamic(self) -> None:
        """Back to the eager bookkeeping before any decode step (a chunked prompt): the device state holds
        the same lengths; the block tables keep their fixed pages, which the eager path fills in order."""
        self._sync_host(hidden=False)  # no decode step ran: the eager path's releases stand
        if self.ring is not None:  # the ring's later entries go: the eager path allocates and releases as usual
            for table, width in zip(self.tables, self._eager_widths, strict=True):
                self.pool.release(table[width:])
                del table[width:]
            self.ring = None
        self.static = False
        self._device_tables = None

    def _sync_host(self, hidden: bool = True) -> None:
        """The host bookkeeping from the device state; with ``hidden``, a ring's entries that no query can see again
        count as released (``hidden``: as the eager path's, whose entries point at the zero page)."""
        self.paged_lens = self.paged_len.tolist()
        self.window_lens = self.window_len.tolist()
        self.sinks = self.sink_len.tolist()
        if hidden and self.ring is not None:
            w, p = self.sliding_window, self.cfg.page_size
            self.hidden = [max(h, max(0, min(q, q + r - w)) // p)
                           for h, q, r in zip(self.hidden, self.paged_lens, self.window_lens, strict=True)]

    def attend_static(self, query: torch.Tensor, scaling: float, sink_logits=None) -> torch.Tensor:
        cfg = self.cfg
        if self.rot_k is not None:
            query = query @ self.rot_k
        out = torch.ops.kivi_cache.paged_decode_attention(
            query[:, :, 0].contiguous(), self.block_table, self.paged_len, *self.pool.args(), self.res_k, self.res_v,
            self.window_len, cfg.key_bits, cfg.value_bits, cfg.group_size, float(scaling), self.sliding_window or 0,
            None if sink_logits is None else sink_logits.detach())
        return out[:, None] if self.rot_v is None else out[:, None] @ self.rot_v

    def get_seq_length(self):
        if self.unusable is not None:
            self.check_usable()
        return self.seen_t if self.static else self.seen

    def host_length(self) -> int:
        return self.host_seen if self.static else self.seen

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        if self.static and (self.decoding or query_len(query_length) == 1):  # a later prompt chunk: the eager sizes
            return self.max_cache_len, 0
        return super().get_mask_sizes(query_length, *args)

    def _unsupported(self, what):
        if self.static:
            raise NotImplementedError(f"StaticQuantizedPagedCache does not support {what} after the prompt; "
                                      "use QuantizedPagedCache")

    def check_crop(self, tokens_to_remove) -> int:
        self._unsupported("crop")
        return super().check_crop(tokens_to_remove)

    def check_index(self, index, name: str) -> list[int]:
        """In static mode only beam search's reorder (``beam_idx``), which keeps the batch size."""
        if name != "beam_idx":
            self._unsupported("batch_select_indices" if name == "indices" else "batch_repeat_interleave")
        pick = super().check_index(index, name)
        if self.static:
            if len(pick) != self.batch_size:
                raise IndexError(f"beam_idx must hold {self.batch_size} indices in [0, {self.batch_size}) (beam "
                                 f"search keeps the batch size in static mode), got {pick}")
            self._beam_copies(pick)
        return pick

    def _beam_copies(self, index: list[int]) -> tuple[list[int], list[int]]:
        """The pages a static-mode reorder copies (destinations, sources); ValueError where sequences' released
        (zero-page) entries differ: only beams of one prompt correspond entry by entry."""
        zero, p = self.pool.zero, self.cfg.page_size
        used = [-(-q // p) for q in self.paged_len.tolist()]  # entries holding stored tokens (beam search syncs anyway)
        dst, src, done = [], [], set()
        for child, parent in enumerate(index):
            if child == parent:
                continue
            for d, s in zip(self.tables[child][:used[parent]], self.tables[parent][:used[parent]], strict=True):
                if (d == zero) != (s == zero):
                    raise ValueError("StaticQuantizedPagedCache.reorder_cache: sequences "
                                     f"{child} and {parent} hold different released pages; only beams of one "
                                     "prompt can be reordered")
                if d != zero and d not in done:
                    done.add(d)
                    dst.append(d)
                    src.append(s)
        return dst, src

    def _select(self, index: list[int]) -> None:
        """Beam search in static mode (generate runs it eagerly): sequence ``i`` takes the stored tokens of
        ``index[i]``. Every sequence keeps its own fixed pages, so the parents' page contents are copied into
        the children's pages (table entry by table entry, after one gather: a parent may also be a child), and the
        windows and lengths follow by rows, all in place (the tensors the compiled step captured stay valid).
        Beams of one prompt have equal lengths, so their tables' entries correspond; a reorder across sequences
        whose zero-page entries differ (released tokens of a sliding layer) is refused by :meth:`check_index`."""
        if not self.static:
            return super()._select(index)
        if index == list(range(self.batch_size)):
            return
        dst, src = self._beam_copies(index)
        if dst:
            d_t = torch.tensor(dst, dtype=torch.long, device=self.device)
            s_t = torch.tensor(src, dtype=torch.long, device=self.device)
            for t in self.pool.args():
                t.index_copy_(0, d_t, t.index_select(0, s_t))
        rows = torch.tensor(index, dtype=torch.long, device=self.device)
        for t in (self.res_k, self.res_v, self.paged_len, self.window_len, self.sink_len):
            t.copy_(t.index_select(0, rows))
        for name in ("paged_lens", "window_lens", "pads", "sinks", "hidden"):
            setattr(self, name, [getattr(self, name)[i] for i in index])

    def _full_precision(self, which: int):
        if not self.static:
            return super()._full_precision(which)
        # the host bookkeeping from the device state (as memory_stats), the device state itself for the tables
        self._sync_host()
        saved = self._device_tables, self.seen
        self._device_tables, self.seen = (self.block_table, self.paged_len, self.window_len), int(self.seen_t)
        try:
            return super()._full_precision(which)
        finally:
            self._device_tables, self.seen = saved

    def memory_stats(self) -> dict:
        if not self.static:
            return super().memory_stats()
        self._sync_host()  # the eager bookkeeping the report reads
        return super().memory_stats()


# ----------------------------------------------------------------------------- cache


class StaticQuantizedPagedCache(QuantizedPagedCache):
    """``QuantizedPagedCache`` with fixed shapes while decoding, for ``torch.compile`` / CUDA graphs.

    Args:
        model: the model it will serve (its attention modules are bound to this cache).
        max_cache_len: prompt plus generated tokens per sequence, at most.
        **quant: ``key_bits``, ``value_bits``, ``group_size``, ``residual_length``, ``page_size``,
            ``sink_length`` as for :class:`QuantizedPagedCache` (defaults: the Int4 preset).
    """

    def __init__(self, model, max_cache_len: int, **quant):
        _check_int("max_cache_len", max_cache_len, 1)
        super().__init__(config=model.config, **dict(INT4_PRESET, **quant))
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if not getattr(model, "_supports_attention_backend", False):
            raise ValueError(f"StaticQuantizedPagedCache needs a model that routes attention through transformers' "
                             f"attention functions (_supports_attention_backend); {type(model).__name__} does not "
                             f"declare it (a static decode step would hand it the bare window); use "
                             f"QuantizedPagedCache for this model")
        impl = getattr(text, "_attn_implementation", None)
        if impl not in ("sdpa", hook.NAME):
            raise ValueError(f"StaticQuantizedPagedCache needs attn_implementation 'sdpa' or '{hook.NAME}', got "
                             f"{impl!r}; load the model with attn_implementation='sdpa' or use QuantizedPagedCache")
        if self._layer_bits and len(self._layer_bits) != text.num_hidden_layers:
            raise ValueError(f"layer_bits gives {len(self._layer_bits)} layers' bits for a model of "
                             f"{text.num_hidden_layers} layers: give one (key_bits, value_bits) per layer")
        self.layers = [StaticQuantizedPagedLayer(self._static_config(i), max_cache_len, shared=self._shared)
                       for i in range(text.num_hidden_layers)]
        bound = 0
        # each layer's attention modules (weak references: a deepcopy of the cache keeps them, not copies of the
        # model), which update() binds to the cache in use again (a copy, or an earlier cache used once more)
        self._bound_modules: list[list] = [[] for _ in self.layers]
        for module in model.modules():
            if type(module).__name__.endswith("Attention") and isinstance(getattr(module, "layer_idx", None), int):
                bind(module, self)
                bound += 1
                if module.layer_idx < len(self.layers):
                    self._bound_modules[module.layer_idx].append(weakref.ref(module))
                if module.layer_idx < len(self.layers):  # its window as declared (Gemma, GPT-OSS: per layer;
                    # Mistral: the config's), only to size the pool: the hook tells the layer what it serves
                    hint = getattr(module, "sliding_window", getattr(getattr(module, "config", None),
                                                                     "sliding_window", None))
                    self.layers[module.layer_idx].window_hint = hint if isinstance(hint, int) and hint > 0 else None
        if bound != text.num_hidden_layers:
            raise ValueError(f"StaticQuantizedPagedCache found {bound} attention modules with a layer_idx for "
                             f"{text.num_hidden_layers} layers; this model is not supported")

    def _static_config(self, i: int):
        """Layer ``i``'s settings: the cache's, with the layer's own bits (``layer_bits``)."""
        if i < len(self._layer_bits):
            kb, vb = self._layer_bits[i]
            return dataclasses.replace(self.quant_config, key_bits=kb, value_bits=vb)
        return self.quant_config

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.layers[layer_idx].update(key_states, value_states)
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx must be an int in [0, {len(self.layers)}) (the model's layers), got "
                             f"{layer_idx!r}")
        self._bind(layer_idx)
        return self._update_layer(layer_idx, key_states, value_states)

    def _bind(self, layer_idx: int) -> None:
        """Bind the layer's attention modules to this cache (eager steps): the hook finds the static layer through
        the module, and the binding names the newest cache made for the model. A deep copy of a cache (to branch a
        generation) or an earlier cache used again would otherwise be served by the bound cache's layer check,
        which fails, and get plain attention over its bare window: a shape error, or with learned sinks (GPT-OSS)
        silently wrong logits."""
        for ref in self._bound_modules[layer_idx] if layer_idx < len(self._bound_modules) else ():
            module = ref()
            if module is not None and module.__dict__.get("_kivi_static") is not self:
                bind(module, self)

    @property
    def is_compileable(self) -> bool:
        return True

    def get_max_length(self) -> int:
        return self.layers[0].max_cache_len


def bind(module, cache: StaticQuantizedPagedCache) -> None:
    """Make ``cache`` the one the hook looks at first for ``module``'s static decode steps (``_kivi_static``: the
    compiled step's guard), and one of those it searches when the step's key is not that cache's (``_kivi_statics``:
    several static caches of one model in use at once, one per thread say)."""
    module._kivi_static = cache
    refs = [ref for ref in module.__dict__.get("_kivi_statics", ()) if ref() is not None and ref() is not cache]
    module._kivi_statics = [*refs, weakref.ref(cache)]


def bound_layer(module, key):
    """The static-mode layer, among the static caches bound to ``module``, whose window ``key`` is (a static decode
    step's update returned it), or None."""
    d = module.__dict__
    static = d.get("_kivi_static")
    if static is None:
        return None
    layer = static.layers[module.layer_idx]
    if layer.static and key is layer.res_k:
        return layer
    for ref in d.get("_kivi_statics", ()):
        cache = ref()
        layer = None if cache is None else cache.layers[module.layer_idx]
        if layer is not None and layer.static and key is layer.res_k:
            return layer
    return None

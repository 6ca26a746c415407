"""The quantized cache that transformers' continuous-batching engine drives: pages of KIVI groups in the engine's
blocks, and one full-precision window per request in flight.

The engine (``transformers/generation/continuous_batching/``) thinks in *blocks*: a block holds ``page_size`` tokens
of one request in every layer; its scheduler asks the cache whether a request's next tokens fit
(``can_store_request_tokens``), its allocator hands out block ids, and it frees a request's blocks when the request
finishes, is cancelled or is evicted. :class:`KiviPagedAttentionCache` keeps that contract with two stores:

* **pages**: per layer, one :class:`~kivi_cache.kernels.checks.PoolTensors` of ``num_blocks`` pages (page id = block
  id): a request's quantized tokens, whole key groups, in the order they left its window. A request of ``n`` tokens
  needs ``QuantConfig.pages_per_sequence(n)`` blocks, fewer than the engine's fp16 cache would (its newest tokens
  are in the window, not in a page). Memory is counted in packed bytes (:func:`~kivi_cache.pool.page_nbytes`).
* **windows**: per layer, ``res_k``/``res_v`` ``[window_slots, Hkv, C, D]`` in the model's dtype: slot ``i`` holds one
  request's sink tokens and newest tokens (:mod:`kivi_cache.window`). A request takes a slot when it is first
  scheduled and gives it back with its blocks; ``window_slots`` bounds the requests in flight.

A request's window state follows from its token count alone (:func:`~kivi_cache.window.window_append` is
path-independent), so the cache keeps no per-request lengths: each step derives them from the engine's
``position_offset``. Attention and the writes happen in :mod:`kivi_cache.cb.step`.
"""

from __future__ import annotations

import logging

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionCache, PagedAttentionMemoryHandler
from transformers.generation.continuous_batching.cache_allocators import CachePool, FullAttentionCacheAllocator
from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

from ..config import QuantConfig
from ..kernels.checks import PoolTensors
from ..pool import page_nbytes, page_shapes
from ..window import capacity, window_append
from .step import Row, Step

logger = logging.getLogger("kivi_cache")


class KiviAllocator(FullAttentionCacheAllocator):
    """The engine's allocator for full-attention layers, counting pages of quantized groups: a request of ``n``
    tokens holds ``cfg.pages_per_sequence(n)`` blocks. No block sharing (a page's tokens are not the block's token
    range the engine hashes: sinks and the window shift them) and no block table (the decode path of flash)."""

    supports_block_sharing = False
    supports_block_table = False

    def __init__(self, cfg: QuantConfig, layer_indices: list[int], num_heads: int, head_dim: int,
                 dtype: torch.dtype):
        self.cfg = cfg
        self.head_dim = head_dim
        self.num_key_value_heads = num_heads
        self.cache_dtype = dtype
        self._before_cache_tensor_init(index=0, layer_indices=layer_indices, tokens_per_page=cfg.page_size,
                                       bytes_per_page=page_nbytes(cfg, num_heads, head_dim, dtype),
                                       allow_block_sharing=False)
        self.pools: dict[int, PoolTensors] = {}

    def register(self, num_blocks: int, pool: CachePool, device) -> None:
        """Allocate ``num_blocks`` pages per layer (one sector per block)."""
        shapes = page_shapes(self.cfg, self.num_key_value_heads, self.head_dim, self.cache_dtype)
        for layer in self.layer_indices:
            self.pools[layer] = PoolTensors(*(torch.zeros((num_blocks, *shape), dtype=dt, device=device)
                                              for shape, dt in shapes.values()))
        self.num_blocks = num_blocks
        self.num_pages = num_blocks * self.pages_per_block
        self.blocks_per_sector = 1
        self.pool = pool
        pool.set_blocks_per_sector(self.index, 1)
        # the engine fills its (unused) token index tensors with these
        self.read_trash_index = self.sentinel_index = self.write_trash_index = 0

    def register_cache_tensor(self, *args, **kwargs):
        raise NotImplementedError("KiviAllocator holds its own page tensors (register)")

    def _compute_blocks_needed(self, allocated_blocks: int, past_length: int, query_length: int) -> int:
        return max(0, self.cfg.pages_per_sequence(past_length + query_length) - allocated_blocks)

    def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        return []

    def get_write_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        return []

    def fill_block_table(self, *args, **kwargs):
        raise NotImplementedError("the quantized cache serves no block-table decode path")

    def get_cache_for_block_table(self, layer_idx: int):
        raise NotImplementedError("the quantized cache serves no block-table decode path")

    def copy_blocks(self, source_block_ids: list[int], dest_block_ids: list[int]) -> None:
        """Copy whole blocks (every layer's page) for a fork."""
        if not source_block_ids:
            return
        device = next(iter(self.pools.values())).k_codes.device
        src = torch.tensor(source_block_ids, device=device, dtype=torch.long)
        dst = torch.tensor(dest_block_ids, device=device, dtype=torch.long)
        for pool in self.pools.values():
            for t in pool:
                t.index_copy_(0, dst, t.index_select(0, src))


class KiviMemoryHandler(PagedAttentionMemoryHandler):
    """The engine's memory sizing (same available memory, same per-batch-token activations) for this cache: the
    windows are a fixed cost, nothing is read back into a full-precision copy (``bytes_per_cache_token`` 0) and no
    attention mask exists."""

    def __init__(self, *args, window_bytes: int, **kwargs):
        self.window_bytes = window_bytes
        super().__init__(*args, **kwargs)

    @property
    def bytes_per_cache_token(self) -> int:
        return 0

    @property
    def fixed_overhead_bytes(self) -> int:
        return super().fixed_overhead_bytes - self.trash_bytes + self.window_bytes

    def attention_mask_bytes(self, max_batch_tokens: int, num_sectors: int) -> int:
        return 0


class KiviPagedAttentionCache(PagedAttentionCache):
    """transformers' ``PagedAttentionCache`` with quantized pages and per-request windows (module docstring).
    Built by :class:`kivi_cache.cb.engine.KiviContinuousBatchingManager` with the engine's resolved config."""

    def __init__(self, config, continuous_batching_config, device, distributed_helper, dtype=torch.float16,
                 model_supports_logits_to_keep: bool = False, *, quant: QuantConfig, window_slots: int | None = None):
        cb = continuous_batching_config
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.quant = quant
        self.max_blocks_per_request = 0
        num_heads = find_num_key_value_heads(config)
        head_dim = find_head_dim(config)
        kv_tp_size = 1  # tensor parallelism (tp_plan): each rank holds its share of the KV heads, as the engine's cache
        if distributed_helper.tp_size > 1 and distributed_helper.are_kv_heads_tp_ed():
            kv_tp_size = distributed_helper.tp_size
            if num_heads % kv_tp_size:
                raise ValueError(f"the model's {num_heads} KV heads do not split over tensor-parallel size "
                                 f"{kv_tp_size}")
            num_heads //= kv_tp_size
        layers = list(range(config.num_hidden_layers))
        self.num_heads, self.head_dim = num_heads, head_dim
        allocator = KiviAllocator(quant, layers, num_heads, head_dim, dtype)
        self.cache_allocators = {allocator.layer_type: allocator}
        self.layer_to_allocator = dict.fromkeys(layers, allocator)
        self.bytes_per_sector = allocator.bytes_per_block
        self.tokens_per_sector = quant.page_size

        if window_slots is None:
            window_slots = min(cb.max_requests_per_batch or 256, 256)
        self.window_slots = window_slots
        self.window_capacity = capacity(quant.sink_length, quant.residual_length, quant.group_size)
        window_bytes = 2 * len(layers) * window_slots * num_heads * self.window_capacity * head_dim * dtype.itemsize
        self.max_batch_tokens, self.num_sectors = KiviMemoryHandler(
            config=config, cb_config=cb, dtype=dtype, bytes_per_sector=self.bytes_per_sector,
            tokens_per_sector=self.tokens_per_sector, bytes_per_block=allocator.bytes_per_block,
            attn_types=[allocator.layer_type], model_supports_logits_to_keep=model_supports_logits_to_keep,
            kv_tp_size=kv_tp_size, window_bytes=window_bytes).infer_max_batch_tokens_and_num_sectors()
        if distributed_helper.tp_size > 1:  # every rank the same sizes (the smallest)
            sync = torch.tensor([self.max_batch_tokens, self.num_sectors], device=self.device, dtype=torch.int64)
            distributed_helper.tp_all_reduce_min(sync)
            self.max_batch_tokens, self.num_sectors = int(sync[0]), int(sync[1])
        self.pool = CachePool(self.num_sectors, 1, num_reserved_sectors=0)
        allocator.register(self.num_sectors, self.pool, self.device)
        self.num_blocks = self.num_sectors
        shape = (window_slots, num_heads, self.window_capacity, head_dim)
        self.res_k = {i: torch.zeros(shape, dtype=dtype, device=self.device) for i in layers}
        self.res_v = {i: torch.zeros(shape, dtype=dtype, device=self.device) for i in layers}

        self.allow_block_sharing = False
        self.use_prefix_sharing = False
        self.read_cache_limit = None
        self.max_decode_fast_path_length = 0
        # the scheduler's budget of tokens read per varlen batch (the engine reads nothing back: an upper bound)
        self.max_tokens_read = self.num_blocks * quant.page_size + window_slots * self.window_capacity
        self.slot_of: dict[str, int] = {}
        self.free_slots = list(range(window_slots - 1, -1, -1))
        self._rows: list[Row] | None = None  # the batch being prepared (extend_read_and_write_indices)
        self._step: Step | None = None  # the forward in progress
        self._pending_window_copies: list[tuple[int, int]] = []
        self.error: BaseException | None = None
        logger.info("kivi_cache: continuous-batching cache of %d blocks of %d tokens (%.2f GiB packed) and %d "
                    "windows of %d tokens (%.2f GiB)", self.num_blocks, quant.page_size,
                    self.num_blocks * allocator.bytes_per_block / 2**30, window_slots, self.window_capacity,
                    window_bytes / 2**30)

    # -- capacity ---------------------------------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of the pages of all layers (the engine's blocks)."""
        return self.num_blocks * self.cache_allocators["full_attention"].bytes_per_block

    @property
    def window_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.res_k, self.res_v) for t in d.values())

    # -- scheduling -------------------------------------------------------------------------------------------------
    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        """As the engine's, and a request not yet in flight needs a free window slot (else it waits)."""
        needs_slot = state.request_id not in self.slot_of
        if needs_slot and not self.free_slots:
            return False
        fits = super().can_store_request_tokens(state, request_len, dry_run)
        if fits and needs_slot and not dry_run:
            self.slot_of[state.request_id] = self.free_slots.pop()
        return fits

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        super().free_blocks(request_id, no_cache)
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        """Every request's blocks and window slot free (the engine's reset, also after a failed step: with no request
        left, nothing stored can disagree)."""
        super().free_all_requests(clear_ledgers)
        self.slot_of.clear()
        self.free_slots = list(range(self.window_slots - 1, -1, -1))
        self._rows, self._step, self.error = None, None, None
        self._pending_window_copies.clear()

    def prepare_fork_request(self, src_state, dst_req_ids: list[str], copy_src_and_dst) -> list[str]:
        """The engine's fork (every block copied: nothing is shared), for as many children as there are free window
        slots; each child gets a copy of the parent's window."""
        forked = super().prepare_fork_request(src_state, dst_req_ids[:len(self.free_slots)], copy_src_and_dst)
        src = self.slot_of[src_state.request_id]
        for child in forked:
            self.slot_of[child] = slot = self.free_slots.pop()
            self._pending_window_copies.append((src, slot))
        return forked

    def perform_cache_copy(self, copy_src_and_dst) -> None:
        super().perform_cache_copy(copy_src_and_dst)
        if self._pending_window_copies:
            src = torch.tensor([s for s, _ in self._pending_window_copies], device=self.device)
            dst = torch.tensor([d for _, d in self._pending_window_copies], device=self.device)
            for store in (self.res_k, self.res_v):
                for t in store.values():
                    t.index_copy_(0, dst, t.index_select(0, src))
            self._pending_window_copies.clear()

    # -- one forward ------------------------------------------------------------------------------------------------
    def extend_read_and_write_indices(self, request_id: str, past_length: int, query_length: int, read_index,
                                      write_index) -> None:
        """Record the row (the engine reads and writes no token indices here: the step does)."""
        if self._rows is None:
            self._rows = []
        slot = self.slot_of.get(request_id)
        if slot is None:
            raise RuntimeError(f"kivi_cache: request {request_id!r} was scheduled without a window slot")
        blocks = list(self.cache_allocators["full_attention"].block_table.get(request_id, ()))
        start = self._rows[-1].start + self._rows[-1].q if self._rows else 0
        self._rows.append(Row(slot, past_length, query_length, blocks, start))

    def fill_block_table(self, request_id, past_length, query_length, block_table) -> None:
        raise NotImplementedError("the quantized cache serves no block-table decode path")

    @torch.compiler.disable
    def update(self, key_states, value_states, layer_idx: int, kwargs):
        """Hand this forward's :class:`~kivi_cache.cb.step.Step` to the attention function (``kwargs["kivi_cb"]``):
        the step attends and then stores the layer's new tokens. Keys and values are returned as given."""
        if self.error is not None:
            raise RuntimeError("kivi_cache: an earlier step failed midway, so the stored windows and pages disagree; "
                               "the cache serves no step until its requests are freed (reset)") from self.error
        if self._rows is not None:
            self._step = Step(self, self._rows)
            self._rows = None
        if self._step is None:
            raise RuntimeError("kivi_cache: the engine ran a forward without preparing its rows")
        kwargs["kivi_cb"] = self._step
        return key_states, value_states

    def window_state(self, n: int) -> tuple[int, int, int]:
        """``(sinks, quantized, window)`` token counts of a request holding ``n`` tokens."""
        q = self.quant
        s, c = window_append(0, 0, n, sink_length=q.sink_length, residual_length=q.residual_length,
                             group_size=q.group_size)
        return s, c, n - c

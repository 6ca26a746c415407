"""A per-layer pool of fixed-size pages with a free list and reference counts.

Pages hold quantized keys and values in the layout documented in
:mod:`kivi_cache.reference`. Sequences refer to pages through block tables
(lists of page ids) kept by the cache layer; the pool only hands out page ids,
counts references (beam search shares pages between sequences) and recycles
pages whose count drops to zero.
"""

from __future__ import annotations

import copy
import warnings

import torch

from .config import QuantConfig
from .kernels.checks import PoolTensors


def page_shapes(cfg: QuantConfig, num_heads: int, head_dim: int, dtype: torch.dtype) -> dict:
    """``{name: (shape, dtype)}`` of one page of each pool tensor (layout: :mod:`kivi_cache.reference`)."""
    h, d, p, g = num_heads, head_dim, cfg.page_size, cfg.group_size
    return {
        "k_codes": ((h, p, d * cfg.key_bits // 8), torch.uint8),
        "k_scale": ((h, p // g, d), dtype),
        "k_zero": ((h, p // g, d), dtype),
        "v_codes": ((h, d, p * cfg.value_bits // 8), torch.uint8),
        "v_scale": ((h, d // g, p), dtype),
        "v_zero": ((h, d // g, p), dtype),
    }


def page_nbytes(cfg: QuantConfig, num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one page of one layer (keys and values: codes, scales, zero points)."""
    return sum(torch.Size(shape).numel() * dt.itemsize
               for shape, dt in page_shapes(cfg, num_heads, head_dim, dtype).values())


class Budget:
    """A cache's size budget as the user gave it (``text`` names the parameters), shared by its layers' pools:
    a pool that outgrows its preallocated pages still grows, and the first to do so warns, once per cache."""

    __slots__ = ("text", "warned")

    def __init__(self, text: str):
        self.text = text
        self.warned = False

    def exceeded(self, pages: int, needed: int, page_size: int) -> None:
        if self.warned:
            return
        self.warned = True
        warnings.warn(
            f"kivi_cache: the cache outgrew its size budget ({self.text}: {pages} pages of {page_size} tokens in a "
            f"layer's pool); a layer needs {needed} pages for the tokens it holds, so its pool grows beyond the "
            f"budget (warned once per cache). Give a larger budget to keep the cache within a fixed size.",
            stacklevel=2)


class PagePool:
    def __init__(self, cfg: QuantConfig, num_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, budget: Budget | None = None):
        self.cfg = cfg
        self.budget = budget  # the cache's, where the user gave one (cfg.num_pages are then its pages)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.capacity = 0
        self.decode_runner = None  # the owning layer's ops.DecodeRunner over these tensors (dropped when they grow)
        self.refcount: list[int] = []
        self.free: list[int] = []
        self.zero: int | None = None  # the page of zeros (zero_page), once a table needs it
        self.tensors = {name: torch.zeros((0, *shape), dtype=dt, device=device)
                        for name, (shape, dt) in self._page_shapes().items()}
        self._grow(cfg.num_pages)

    def __deepcopy__(self, memo):
        """A copy with its own tensors and no decode runner (a cache deep-copied mid-generation, to branch it): a
        runner's Triton launch state (compiled kernels, the raw pointers of these tensors) can neither be copied
        (deepcopy of it raises TypeError) nor serve the copy's tensors; the copy plans its own at its next step."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, None if name == "decode_runner" else copy.deepcopy(value, memo))
        return new

    def _page_shapes(self):
        return page_shapes(self.cfg, self.num_heads, self.head_dim, self.dtype)

    def _grow(self, new_capacity: int) -> None:
        if new_capacity <= self.capacity:
            return
        extra = new_capacity - self.capacity
        self.decode_runner = None  # it holds the old tensors
        for name, (shape, dtype) in self._page_shapes().items():
            fresh = torch.zeros((extra, *shape), dtype=dtype, device=self.device)
            self.tensors[name] = torch.cat([self.tensors[name], fresh])
        # hand out low page ids first
        self.free.extend(range(new_capacity - 1, self.capacity - 1, -1))
        self.refcount.extend([0] * extra)
        self.capacity = new_capacity

    def _grow_for(self, deficit: int) -> None:
        """Grow by ``deficit`` pages. An empty pool gets exactly them: the first step to store pages is usually the
        prompt, which reserves all it needs at once, so the pool starts at the prompt's size. Later growth is at
        least 1/8 of the capacity, so that small steps amortize the copy that growing costs (the pool is one tensor
        per kind for the kernels: growing concatenates); doubling would leave up to half of a large pool unused.
        A pool preallocated to the user's budget (``num_pages``, ``max_batch_size``/``max_cache_len``) grows
        the same way past it, and the cache warns once (:class:`Budget`)."""
        if self.budget is not None and self.cfg.num_pages and self.capacity >= self.cfg.num_pages:
            self.budget.exceeded(self.cfg.num_pages, self.capacity + deficit, self.cfg.page_size)
        self._grow(self.capacity + max(deficit, -(-self.capacity // 8)))

    def reserve(self, n: int) -> None:
        """Make sure ``n`` pages can be allocated without growing one page at a time."""
        if n > len(self.free):
            self._grow_for(n - len(self.free))

    def allocate(self) -> int:
        if not self.free:
            self._grow_for(1)
        page = self.free.pop()
        self.refcount[page] = 1
        return page

    def allocate_many(self, n: int) -> list[int]:
        """``n`` pages, the same ids (and order) as ``n`` calls of :meth:`allocate`."""
        self.reserve(n)
        out = self.free[len(self.free) - n:][::-1]
        del self.free[len(self.free) - n:]
        for page in out:
            self.refcount[page] = 1
        return out

    def share(self, pages) -> None:
        for page in pages:
            self.refcount[page] += 1

    def release(self, pages) -> None:
        for page in pages:
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self.free.append(page)

    def copy_on_write(self, page: int) -> int:
        """Return a page the caller may write: ``page`` itself if unshared, else a private copy."""
        if self.refcount[page] == 1:
            return page
        fresh = self.allocate()
        for t in self.tensors.values():
            t[fresh].copy_(t[page])
        self.release([page])
        return fresh

    def zero_page(self) -> int:
        """A page of zeros (codes, scales and zero points: it dequantizes to 0) that the table entries of released
        tokens point at (a sliding-window layer's tokens no query can see again), so that every reader of a table
        (dequantization, the prefix path, the materialized fallback) stays in bounds. Never written, never freed."""
        if self.zero is None:
            self.zero = self.allocate()
            for t in self.tensors.values():
                t[self.zero].zero_()
            self.refcount[self.zero] = 1 << 62  # share/release leave it in use
        return self.zero

    @property
    def pages_in_use(self) -> int:
        return self.capacity - len(self.free)

    def page_nbytes(self) -> dict[str, int]:
        """Bytes of one page: codes, scales and zero points (keys + values)."""
        out = {"codes": 0, "scales": 0, "zeros": 0}
        for name, (shape, dtype) in self._page_shapes().items():
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            out["codes" if "codes" in name else "scales" if "scale" in name else "zeros"] += n
        return out

    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def args(self) -> PoolTensors:
        """The six tensors as the ops take them."""
        t = self.tensors
        return PoolTensors(t["k_codes"], t["k_scale"], t["k_zero"], t["v_codes"], t["v_scale"], t["v_zero"])

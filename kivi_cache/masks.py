"""What the cache reads from a forward's attention mask: which new tokens are pads, whether the mask carries an
additive bias, and a chunk's own visibility.

Reading a flag back from a mask on a GPU synchronizes with the device. transformers hands every layer of a forward
the same mask tensor, so :class:`MaskReader` keeps its last answers for that tensor while it is alive and unmodified
(its identity, version counter, data pointer and shape): one sync per forward instead of one per layer. A cache
shares one reader between its layers (caches used from different threads do not share answers).
"""

from __future__ import annotations

import weakref

import torch


class MaskReader:
    __slots__ = ("_valid", "_bias")

    def __init__(self):
        self._valid = (None, None, None)  # (weakref to the mask, key, answer) of the last call
        self._bias = (None, None, None)

    @staticmethod
    def _key(mask, *extra):
        try:
            return (id(mask), mask._version, mask.data_ptr(), tuple(mask.shape), *extra)
        except RuntimeError:  # an inference-mode tensor has no version counter: no memo
            return None

    @staticmethod
    def _recall(memo, mask, key):
        ref, last_key, answer = memo
        return key is not None and last_key == key and ref is not None and ref() is mask, answer

    @staticmethod
    def _memo(mask, key, answer) -> tuple:
        if key is None:
            return (None, None, None)
        try:
            return (weakref.ref(mask), key, answer)
        except TypeError:  # a tensor subclass without weak references: no memo
            return (None, None, None)

    def valid_tokens(self, mask, n: int, batch: int):
        """From the model's 4-D mask, the new tokens that are real (``[B, n]`` bool; None if all are, or no mask).
        Reduces the mask's last ``n x n`` block without materializing it (at a 32k prompt an ``n x n`` bool is
        1 GiB)."""
        if mask is None:
            return None
        key = self._key(mask, n, batch)
        hit, answer = self._recall(self._valid, mask, key)
        if hit:
            return answer
        cols = mask[:, 0, -n:, -n:]
        if mask.dtype == torch.bool:
            valid = cols.any(dim=1)
        else:
            valid = cols.amax(dim=1) > torch.finfo(mask.dtype).min / 2
        valid = valid.expand(batch, n)
        valid = None if bool(valid.all()) else valid
        self._valid = self._memo(mask, key, valid)
        return valid

    def adds_bias(self, mask) -> bool:
        """A floating mask holding values other than 0 and the masked-out minimum: an additive bias (Falcon's ALiBi
        from transformers 5.25 on, or a user's 4-D mask), which the paged attention, reading only padding from the
        mask, would drop. A bool mask (what transformers' sdpa mask function builds) cannot hold one and costs
        nothing."""
        if mask is None or mask.dtype == torch.bool or not mask.is_floating_point():
            return False
        key = self._key(mask)
        hit, answer = self._recall(self._bias, mask, key)
        if hit:
            return answer
        bias = bool(((mask != 0) & (mask > torch.finfo(mask.dtype).min / 2)).any())
        self._bias = self._memo(mask, key, bias)
        return bias


def chunk_visibility(mask, n: int, batch: int, device, window: int | None = None):
    """The chunk-internal visibility ``[B, n, n]`` (True = may attend): causal (within ``window`` positions) without
    a mask. Only a chunk of several tokens on a filled cache needs it (``paged_prefix_attention``)."""
    if mask is None:
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        if window is not None:
            causal = causal.triu(1 - window)
        return causal.expand(batch, n, n)
    m = mask[:, 0, -n:, -n:]
    m = m if mask.dtype == torch.bool else m > torch.finfo(mask.dtype).min / 2
    return m.expand(batch, n, n)


def query_len(query_length) -> int:
    """``get_mask_sizes``'s first argument as a token count (older transformers pass ``cache_position``)."""
    return query_length.shape[0] if isinstance(query_length, torch.Tensor) else query_length

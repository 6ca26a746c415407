"""The cache's own argument check (:func:`check_states`) and :class:`own_state`, the public switch of the ops'
by-value index checks for a caller's own tables.

The ops' argument checks (shared by the Triton kernels, the torch reference and the torch path), the constants both
sides use and the ``KIVI_CHECK_INDICES`` switch live in :mod:`kivi_cache.kernels.checks` (the repository's
``kernels/checks.py``, which imports nothing from ``kivi_cache``); :class:`own_state` is that module's.
"""

from __future__ import annotations

from .kernels.checks import own_state, shape_of

__all__ = ["check_states", "own_state"]


def check_states(key_states, value_states) -> None:
    """A cache update's key and value states: [batch, heads, tokens, head_dim] tensors of one batch and token count
    on one device (heads and head_dim are checked against each other and the cache by the layer)."""
    k = shape_of("key_states", key_states, 4)
    v = shape_of("value_states", value_states, 4)
    if (k[0], k[2]) != (v[0], v[2]):
        raise ValueError(f"key_states {list(k)} and value_states {list(v)} must have the same batch size and number "
                         "of tokens (dimensions 0 and 2 of [batch, heads, tokens, head_dim])")
    if key_states.device != value_states.device:
        raise ValueError(f"key_states is on {key_states.device} and value_states on {value_states.device}: both must "
                         "be on one device")


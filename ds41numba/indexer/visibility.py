"""Which compressed positions a query sees, and score rows masked to them."""

from __future__ import annotations

import numpy as np
from numba import prange

from ..jit import njit
from ..numerics import output_buffer, serial_twin, sized_call

__all__ = ["visible_lengths", "masked_buffer"]


def visible_lengths(start_pos: int, seqlen: int, ratio: int, prefill: bool | None = None) -> np.ndarray:
    """Compressed positions each query may see: ``(s + 1) // r`` at prefill (s the query's
    position; ``prefill``, default ``start_pos == 0``, for a chunk of one), all at decode."""
    if start_pos == 0 if prefill is None else prefill:
        return (np.arange(start_pos + 1, start_pos + seqlen + 1, dtype=np.int64)) // ratio
    return np.full(seqlen, (start_pos + seqlen) // ratio, dtype=np.int64)


@njit(parallel=True)
def _mask_kernel(out, clen, upto):
    for s in prange(out.shape[0]):
        out[s, min(max(clen[s], 0), upto):upto] = -np.inf


_mask_kernel_serial = serial_twin(_mask_kernel)


def masked_buffer(out, shape, clen, dirty_to, name):
    """``out`` (or a new buffer) of ``shape`` with every row -inf from its ``clen`` on.

    The kernels write only the positions a row sees. ``dirty_to`` says the columns from there
    on already hold -inf in every row (a buffer reused tile after tile, whose queries see more
    and more positions): only the columns before it are masked, not the whole row, which in a
    long chunked prefill is the whole prefill wide while a query sees the positions before it.
    """
    fresh = out is None
    out = output_buffer(out, shape, name)
    upto = shape[1] if fresh or dirty_to is None else min(int(dirty_to), shape[1])
    # A decode step's one row is masked in the calling thread (sized_call).
    sized_call(_mask_kernel, shape[0], upto, out, np.ascontiguousarray(clen, np.int64), upto)
    return out

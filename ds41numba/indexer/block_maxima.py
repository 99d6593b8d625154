"""Block maxima: per score row, the max over each block of positions it sees (NaN wins).

The candidate source ranks blocks of positions by their best score. The packed score kernels
take the maxima while a key block's scores are still in cache; otherwise a pass over the rows
after them does (:func:`visible_block_maxima`)."""

from __future__ import annotations

import numpy as np
from numba import prange

from ..jit import njit
from ..numerics import DOT_LANES, nan_max

__all__ = ["row_block_maxima", "key_block_maxima", "visible_block_maxima"]


@njit
def row_block_maxima(row, n, block, out):
    """``out[b]``: the max (NaN wins) of ``row[b * block : (b + 1) * block]`` within its first
    ``n`` values, for every block holding one of them."""
    for b in range(-(-n // block)):
        best = np.float32(-np.inf)
        for t in range(b * block, min(n, (b + 1) * block)):
            best = nan_max(best, row[t])
        out[b] = best


@njit
def key_block_maxima(out, clen, t0, s_lo, block, block_max):
    """Rows ``s_lo ..`` of ``block_max``: the maxima of the blocks of ``block`` positions (a
    divisor of DOT_LANES) in the key block at ``t0``, over the positions each row sees (NaN
    wins), taken while the block's scores are still in cache."""
    for s in range(s_lo, out.shape[0]):
        n = min(DOT_LANES, clen[s] - t0)
        row_block_maxima(out[s, t0:t0 + n], n, block, block_max[s, t0 // block:])


@njit(parallel=True)
def visible_block_maxima(scores, clen, block, out):
    """Per row, the max (NaN wins) over each block of ``block`` positions it sees: ``out[s, j]``
    for the blocks ``j`` holding positions below ``clen[s]``, over those positions only."""
    width = scores.shape[1]
    for s in prange(scores.shape[0]):
        row_block_maxima(scores[s], min(width, max(clen[s], 0)), block, out[s])

"""A candidate consumer's scores: only inside its candidate blocks, -inf elsewhere.

A candidate consumer masks every score outside its candidate blocks to -inf before its top-k,
so a score formed there is never used: at 1,048,576 positions a query's 2,048 blocks of 8 are
a 64th of what it sees. The score kernels therefore skip the key blocks (``DOT_LANES``
positions) in which a query has no candidate (:func:`needed_key_blocks`), and
:func:`mask_outside_candidates` then writes -inf over every visible position outside the
candidates: the rows are bit for bit the masked full rows, whatever the kernels left there.
The top-k sees the same rows; :func:`candidate_hints` only lets its scan skip the -inf runs
(each skipped run is all -inf, which never enters its heap).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..numerics import serial_twin, sized_call

__all__ = ["needed_key_blocks", "mask_outside_candidates", "candidate_hints"]


@njit(cache=True)
def _bit(packed_row, c):
    """Candidate block ``c`` of a row of bits packed as ``np.packbits`` packs them."""
    return (packed_row[c >> 3] >> (7 - (c & 7))) & 1


@njit(parallel=True, cache=True)
def _needed_kernel(packed, clen, block, lanes, out):
    for s in prange(out.shape[0]):
        seen = -(-max(clen[s], 0) // lanes)
        for b in range(out.shape[1]):
            hit = 0
            if b < seen:
                for c in range(b * lanes // block, -(-(b + 1) * lanes // block)):
                    if c < packed.shape[1] * 8:
                        hit |= _bit(packed[s], c)
            out[s, b] = hit


_needed_kernel_serial = serial_twin(_needed_kernel)


def needed_key_blocks(packed: np.ndarray, clen: np.ndarray, block: int, lanes: int,
                      n_key_blocks: int) -> np.ndarray:
    """``[T, n_key_blocks]`` uint8: 1 where query ``s`` has a candidate block (of ``block``
    positions; ``packed`` its bits, ``np.packbits``' layout) overlapping key block ``b`` (``lanes``
    positions from ``b * lanes``) and sees a position of it; the score kernels form no score of
    a key block a query does not need."""
    out = np.empty((packed.shape[0], n_key_blocks), np.uint8)
    sized_call(_needed_kernel, packed.shape[0], n_key_blocks * lanes // block, packed,
               np.ascontiguousarray(clen, np.int64), block, lanes, out)
    return out


@njit(parallel=True, cache=True)
def _mask_kernel(scores, packed, clen, block):
    for s in prange(scores.shape[0]):
        n = min(max(clen[s], 0), scores.shape[1])
        for c in range(-(-n // block)):
            if not _bit(packed[s], c):
                scores[s, c * block:min(n, (c + 1) * block)] = -np.inf


_mask_kernel_serial = serial_twin(_mask_kernel)


def mask_outside_candidates(scores: np.ndarray, packed: np.ndarray, clen: np.ndarray,
                            block: int) -> None:
    """-inf, in place, at every position below ``clen[s]`` outside row ``s``'s candidate blocks
    (the positions from ``clen`` on are -inf already): the candidate mask, which also clears
    whatever a kernel that skipped a key block left there."""
    if packed.shape[0] != scores.shape[0] or packed.shape[1] * 8 * block < scores.shape[1]:
        raise ValueError(f"mask_outside_candidates: candidate bits {packed.shape} do not cover "
                         f"scores {scores.shape} in blocks of {block}")
    sized_call(_mask_kernel, scores.shape[0], scores.shape[1], scores, packed,
               np.ascontiguousarray(clen, np.int64), block)


@njit(parallel=True, cache=True)
def _hints_kernel(packed, out):
    for s in prange(out.shape[0]):
        for c in range(out.shape[1]):
            out[s, c] = np.nan if _bit(packed[s], c) else -np.inf


_hints_kernel_serial = serial_twin(_hints_kernel)


def candidate_hints(packed: np.ndarray, n_blocks: int) -> np.ndarray:
    """``[T, n_blocks]`` float32 block hints for the top-k's scan
    (:func:`~ds41numba.topk.partial_sort_set_hinted`): -inf outside the candidates (every score
    there is -inf, so the scan may skip it), NaN on a candidate block (always read: NaN passes
    any top, where +inf would not pass a +inf top and could hide a NaN)."""
    out = np.empty((packed.shape[0], n_blocks), np.float32)
    sized_call(_hints_kernel, out.shape[0], out.shape[1], packed, out)
    return out

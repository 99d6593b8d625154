"""A candidate consumer's scores: only inside its candidate blocks, -inf elsewhere.

A candidate consumer masks every score outside its candidate blocks to -inf before its top-k,
so a score formed there is never used: at 1,048,576 positions a query's 2,048 blocks of 8 are
a 64th of what it sees. The score kernels therefore skip the key blocks (``DOT_LANES``
positions) in which a query has no candidate (:func:`needed_key_blocks`), and
:func:`mask_outside_candidates` then writes -inf over every visible position outside the
candidates: the rows are bit for bit the masked full rows, whatever the kernels left there.
VNNI's folded kernel goes further: it scores quarters of key blocks (8 positions, a candidate
block of the v41 configs), four from anywhere to a call (:func:`candidate_quarters`), so its
multiply-adds are the candidates' (a quarter of the key blocks' at 1,048,576 positions).
:class:`NeededKeys` carries both views of a tile's candidates to the kernels.
A buffer reused tile after tile needs the mask only inside the key blocks the tile formed,
once those the tile before formed are back to -inf (:func:`clear_key_blocks`). The top-k sees
the same rows, visiting only the quarters (:class:`NeededKeys`' ``spans``: every other position
is -inf, which never enters its heap).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import prange

from ..jit import njit
from ..numerics import DOT_LANES, QUARTER, serial_twin, sized_call
from ..topk import ListedSpans

__all__ = ["EVERY_KEY_BLOCK", "NeededKeys", "needed_keys", "needed_key_blocks", "candidate_quarters",
           "mask_outside_candidates", "clear_key_blocks"]

#: The key blocks a query needs when it needs every one: no column (as :func:`needed_key_blocks`
#: marks them, one column a key block, the kernels read "none" as "all").
EVERY_KEY_BLOCK = np.ones((1, 0), np.uint8)


@njit
def _bit(packed_row, c):
    """Candidate block ``c`` of a row of bits packed as ``np.packbits`` packs them."""
    return (packed_row[c >> 3] >> (7 - (c & 7))) & 1


@njit(parallel=True)
def _needed_kernel(packed, clen, block, lanes, out):
    for s in prange(out.shape[0]):
        out[s] = 0
        seen = min(-(-max(clen[s], 0) // lanes), out.shape[1])
        for byte in range(packed.shape[1]):
            if packed[s, byte] == 0:
                continue        # most of a long row: 2,048 candidate blocks of 131,072
            for c in range(8 * byte, 8 * byte + 8):
                if _bit(packed[s], c):
                    # the key blocks candidate block c overlaps
                    for b in range(c * block // lanes, min(-(-(c + 1) * block // lanes), seen)):
                        out[s, b] = 1


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


@njit(parallel=True)
def _mask_kernel(scores, packed, clen, block, need, lanes):
    for s in prange(scores.shape[0]):
        n = min(max(clen[s], 0), scores.shape[1])
        if need.shape[1] == 0:
            for c in range(-(-n // block)):
                if not _bit(packed[s], c):
                    scores[s, c * block:min(n, (c + 1) * block)] = -np.inf
            continue
        for b in range(min(need.shape[1], -(-n // lanes))):
            if need[s, b]:
                end = min(n, (b + 1) * lanes)
                for c in range(b * lanes // block, -(-end // block)):
                    if not _bit(packed[s], c):
                        scores[s, max(c * block, b * lanes):min(end, (c + 1) * block)] = -np.inf


_mask_kernel_serial = serial_twin(_mask_kernel)


def mask_outside_candidates(scores: np.ndarray, packed: np.ndarray, clen: np.ndarray,
                            block: int, within: tuple | None = None) -> None:
    """-inf, in place, at every position below ``clen[s]`` outside row ``s``'s candidate blocks
    (the positions from ``clen`` on are -inf already): the candidate mask, which also clears
    whatever a kernel that skipped a key block left there. ``within = (need, lanes)``: only
    inside the key blocks ``need`` marks (:func:`needed_key_blocks`), where the rows are -inf
    already everywhere else."""
    if packed.shape[0] != scores.shape[0] or packed.shape[1] * 8 * block < scores.shape[1]:
        raise ValueError(f"mask_outside_candidates: candidate bits {packed.shape} do not cover "
                         f"scores {scores.shape} in blocks of {block}")
    need, lanes = within if within is not None else (EVERY_KEY_BLOCK, 1)
    sized_call(_mask_kernel, scores.shape[0], scores.shape[1], scores, packed,
               np.ascontiguousarray(clen, np.int64), block, need, lanes)


@njit(parallel=True)
def _clear_kernel(scores, need, lanes):
    for s in prange(min(scores.shape[0], need.shape[0])):
        for b in range(need.shape[1]):
            if need[s, b]:
                scores[s, b * lanes:min(scores.shape[1], (b + 1) * lanes)] = -np.inf


_clear_kernel_serial = serial_twin(_clear_kernel)


def clear_key_blocks(scores: np.ndarray, need: np.ndarray, lanes: int) -> None:
    """-inf, in place, over the key blocks of ``lanes`` positions ``need`` marks in each row
    (a buffer's rows back to all -inf after a tile that wrote only those)."""
    sized_call(_clear_kernel, min(scores.shape[0], need.shape[0]), need.shape[1] * lanes, scores,
               need, lanes)


@njit
def _walk_quarters(packed_row, n, block, out):
    """The first keys of the quarters (``QUARTER`` keys) holding a visible candidate position
    of a row (``n`` positions visible), in order, into ``out`` when it has room; their count."""
    k = 0
    last = -1
    for byte in range(min(packed_row.shape[0], -(-n // (8 * block)))):
        if packed_row[byte] == 0:
            continue
        for c in range(8 * byte, 8 * byte + 8):
            if _bit(packed_row, c) and c * block < n:
                for u in range(c * block // QUARTER, (min(n, (c + 1) * block) - 1) // QUARTER + 1):
                    if u > last:
                        if k < out.shape[0]:
                            out[k] = u * QUARTER
                        k += 1
                        last = u
    return k


@njit(parallel=True)
def _quarters_kernel(packed, clen, block, offsets, firsts, counts):
    """Each row's quarters into ``firsts[offsets[s]:offsets[s + 1]]`` (none where that is
    empty, as with every offset 0), and their count into ``counts[s]``."""
    for s in prange(packed.shape[0]):
        counts[s] = _walk_quarters(packed[s], max(clen[s], 0), block,
                                   firsts[offsets[s]:offsets[s + 1]])


_quarters_kernel_serial = serial_twin(_quarters_kernel)


def candidate_quarters(packed: np.ndarray, clen: np.ndarray, block: int) -> tuple:
    """The quarters of key blocks (``QUARTER`` positions from a multiple of it) that hold a
    visible candidate position of each query (``packed`` its candidate bits of blocks of
    ``block``): ``(offsets int64 [T + 1], firsts int64)``, query ``s``'s quarters' first
    positions ``firsts[offsets[s]:offsets[s + 1]]``, in order."""
    T = packed.shape[0]
    clen = np.ascontiguousarray(clen, np.int64)
    offsets = np.zeros(T + 1, np.int64)
    counts = np.empty(T, np.int64)
    cost = packed.shape[1]
    sized_call(_quarters_kernel, T, cost, packed, clen, block, offsets, np.empty(0, np.int64), counts)
    np.cumsum(counts, out=offsets[1:])
    firsts = np.empty(offsets[-1], np.int64)
    sized_call(_quarters_kernel, T, cost, packed, clen, block, offsets, firsts, counts)
    return offsets, firsts


class NeededKeys(NamedTuple):
    """The keys a candidate consumer's tile needs scored: its candidate bits (``np.packbits``'
    layout, a bit a block of ``block`` positions), the key blocks of ``DOT_LANES`` positions
    holding a visible candidate (``key_blocks``, :func:`needed_key_blocks`) and the quarters
    of key blocks holding one (``spans``, :func:`candidate_quarters`). Kernels of whole key
    blocks read ``key_blocks``, VNNI's folded kernel the quarters where they are sparse; the
    top-k and the runners-up visit the quarters alone (the rows are -inf elsewhere once
    masked)."""
    bits: np.ndarray
    block: int
    key_blocks: np.ndarray
    spans: ListedSpans


def needed_keys(packed: np.ndarray, clen: np.ndarray, block: int, width: int) -> NeededKeys:
    """:class:`NeededKeys` of queries of these candidate bits and visible lengths, rows of
    ``width`` positions."""
    return NeededKeys(packed, block,
                      needed_key_blocks(packed, clen, block, DOT_LANES, -(-width // DOT_LANES)),
                      ListedSpans(*candidate_quarters(packed, clen, block), QUARTER))

"""The index selection: each query's top-k compressed positions, torch's CPU tie order."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..numerics import serial_twin, sized_call
from ..topk import ListedSpans, partial_sort_set_hinted, partial_sort_set_listed, topk_set_into

__all__ = ["select_rows", "top_k_sets", "top_k_sets_listed"]


def select_rows(scores, clen, k, out, maxima=None):
    """The index selection: each row's top-k set (:func:`top_k_sets`). A name of its own, apart
    from the candidate blocks' top-k, which uses the same rule: a kernel with its own tie order
    replaces this one (tests/test_golden.py does) and must leave the candidates as they are.
    ``maxima = (block, block_scores)``: the candidate source's block scores of these rows (each
    at least its block's max), which let the scan skip runs of a row unread; or
    :class:`~ds41numba.topk.ListedSpans`, the only spans of the rows above -inf (a candidate
    consumer's), which the scan visits alone."""
    # A decode step's one row is selected in the calling thread (sized_call).
    if isinstance(maxima, ListedSpans):
        sized_call(top_k_sets_listed, scores.shape[0], scores.shape[1], scores, clen, k, out,
                   *maxima)
        return
    block, block_scores = maxima if maxima is not None else (0, scores)
    sized_call(top_k_sets, scores.shape[0], scores.shape[1], scores, clen, k, out, block_scores,
               block)


@njit(cache=True)
def _scanned(scores, clen, k, out, s):
    """How much of row ``s`` the ``partial_sort`` branch scans (``k * 64 <= width``): its visible
    prefix, at least k; 0 in the ``nth_element`` branch, whose set of the whole row is written
    into ``out[s]`` here."""
    width = scores.shape[1]
    if k * 64 <= width:
        return min(width, max(k, clen[s]))
    topk_set_into(scores[s], k, out[s], np.empty(width, np.float32), np.empty(width, np.int64))
    return 0


@njit(parallel=True, cache=True)
def top_k_sets(scores, clen, k, out, block_scores, block):
    """Each row's top-k set (torch's CPU tie order) into ``out [rows, k]``, ascending.

    In the ``partial_sort`` branch (``k * 64 <= width``, every long row) the scan stops at the
    row's visible length: past it every score is -inf, which never displaces the heap's top, so
    the set is the one the whole row gives, at a cost that grows with what the query sees.
    With ``block`` > 0 that scan skips runs by ``block_scores`` (each at least its block's max; see
    :func:`~ds41numba.topk.partial_sort_set_hinted`).
    """
    for s in prange(scores.shape[0]):
        n = _scanned(scores, clen, k, out, s)
        if n:
            partial_sort_set_hinted(scores[s, :n], k, out[s], np.empty(k, np.int64), block_scores[s],
                                    block)


top_k_sets_serial = serial_twin(top_k_sets)


@njit(parallel=True, cache=True)
def top_k_sets_listed(scores, clen, k, out, offsets, firsts, span):
    """:func:`top_k_sets` of rows that are -inf outside the spans of ``span`` positions at
    ``firsts[offsets[s]:offsets[s + 1]]`` (:class:`~ds41numba.topk.ListedSpans`), which the
    ``partial_sort`` branch visits alone."""
    for s in prange(scores.shape[0]):
        n = _scanned(scores, clen, k, out, s)
        if n:
            partial_sort_set_listed(scores[s, :n], k, out[s], np.empty(k, np.int64),
                                    firsts[offsets[s]:offsets[s + 1]], span)


top_k_sets_listed_serial = serial_twin(top_k_sets_listed)

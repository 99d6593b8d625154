"""The index selection: each query's top-k compressed positions, torch's CPU tie order."""

from __future__ import annotations

import numpy as np
from numba import prange

from ..jit import njit
from ..numerics import serial_twin, sized_call
from ..topk import (ListedSpans, nth_element_set_into, partial_sort_set_hinted,
                    partial_sort_set_listed)

__all__ = ["select_rows", "top_k_sets"]


def select_rows(scores, clen, k, out, maxima=None):
    """The index selection: each row's top-k set (:func:`top_k_sets`). A name of its own, apart
    from the candidate blocks' top-k, which uses the same rule: a kernel with its own tie order
    replaces this one (tests/test_golden.py does) and must leave the candidates as they are.
    ``maxima = (block, block_scores)``: the candidate source's block scores of these rows (each
    at least its block's max), which let the scan skip runs of a row unread; or
    :class:`~ds41numba.topk.ListedSpans`, the only spans of the rows above -inf (a candidate
    consumer's), which the scan visits alone."""
    if isinstance(maxima, ListedSpans):
        top_k_sets(scores, clen, k, out, listed=maxima)
    elif maxima is not None:
        top_k_sets(scores, clen, k, out, hints=maxima[1], block=maxima[0])
    else:
        top_k_sets(scores, clen, k, out)


def top_k_sets(scores, clen, k, out, hints=None, block=0, listed=None):
    """Each row's top-k set (torch's CPU tie order) into ``out [rows, k]``, ascending, ``1 <= k
    <= width``; rows are -inf past ``clen`` (the scan of torch's heap branch stops there).

    torch's branch is the row width's, the same for every row, so each branch is a kernel of its
    own and a run compiles only the one its widths take (a small run's, all ``nth_element``,
    has none of the heap's code). In the ``partial_sort`` branch (``k * 64 <= width``, every long
    row) the scan stops at the row's visible length (at least k): past it every score is -inf,
    which never displaces the heap's top, so the set is the one the whole row gives, at a cost
    that grows with what the query sees. There ``hints`` with ``block`` > 0 (each at least its
    block's max) let it skip runs (:func:`~ds41numba.topk.partial_sort_set_hinted`), and
    ``listed`` (:class:`~ds41numba.topk.ListedSpans`: rows -inf outside them) makes it visit the
    spans alone. A decode step's one row is selected in the calling thread (``sized_call``)."""
    rows, width = scores.shape
    if k * 64 > width:
        sized_call(_whole_row_sets, rows, width, scores, k, out)
    elif listed is not None:
        sized_call(_heap_sets_listed, rows, width, scores, clen, k, out, *listed)
    else:
        sized_call(_heap_sets, rows, width, scores, clen, k, out,
                   scores if hints is None else hints, block)


@njit(parallel=True)
def _whole_row_sets(scores, k, out):
    """:func:`top_k_sets` in the ``nth_element`` branch (``k * 64 > width``): the whole row's set."""
    width = scores.shape[1]
    for s in prange(scores.shape[0]):
        nth_element_set_into(scores[s], k, out[s], np.empty(width, np.float32),
                             np.empty(width, np.int64))


_whole_row_sets_serial = serial_twin(_whole_row_sets)


@njit(parallel=True)
def _heap_sets(scores, clen, k, out, hints, block):
    """:func:`top_k_sets` in the ``partial_sort`` branch, runs skipped by ``hints`` where
    ``block`` > 0."""
    for s in prange(scores.shape[0]):
        n = min(scores.shape[1], max(k, clen[s]))
        partial_sort_set_hinted(scores[s, :n], k, out[s], np.empty(k, np.int64), hints[s], block)


_heap_sets_serial = serial_twin(_heap_sets)


@njit(parallel=True)
def _heap_sets_listed(scores, clen, k, out, offsets, firsts, span):
    """:func:`top_k_sets` in the ``partial_sort`` branch of rows that are -inf outside the spans
    of ``span`` positions at ``firsts[offsets[s]:offsets[s + 1]]``, which it visits alone."""
    for s in prange(scores.shape[0]):
        n = min(scores.shape[1], max(k, clen[s]))
        partial_sort_set_listed(scores[s, :n], k, out[s], np.empty(k, np.int64),
                                firsts[offsets[s]:offsets[s + 1]], span)


_heap_sets_listed_serial = serial_twin(_heap_sets_listed)

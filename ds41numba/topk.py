"""The index set torch's CPU ``topk`` returns, ties included.

The reference model picks its sparse-attention rows with ``torch.topk`` on bf16 score rows that are
full of ties (equal bf16 scores, and long runs of ``-inf`` for masked positions). Which of the tied
entries end up in the top k is not defined by the maths: it is whatever the C++ standard library
algorithm torch calls happens to do. torch pairs every value with its index, ``(v, i)`` in index
order, orders pairs with ``before(a, b) = (isnan(a.v) and not isnan(b.v)) or a.v > b.v`` (values
compared as f32; the index never breaks a tie) and then calls

* ``std::nth_element(begin, begin + k - 1, end, before)`` when ``k * 64 > n``, or
* ``std::partial_sort(begin, begin + k, end, before)`` when ``k * 64 <= n``;

the set is the first k pairs afterwards. To get the same set we replay libstdc++'s versions of those
algorithms step by step (introselect, and the heap select that ``partial_sort`` starts with),
including the exact shape of ``__adjust_heap``: a textbook heap or quickselect keeps different ties.
The steps move each pair as one int64 whose high half orders as ``before`` does (:func:`pair_key`).

Public functions validate at the Python boundary and call njit kernels. ``topk_set_into`` (and its
``partial_sort_set_into`` branch, with ``topk_scratch_len``) is the allocation-free core other
kernels call from inside their own ``prange`` loops.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import prange

from .jit import njit
from .numerics import is_int

#: 0 as an int64, where a literal 0 would make numba compile the called helper a second time,
#: specialised on the constant (seconds of a cold start; the hot loops gain nothing from it).
_ZERO = np.int64(0)

__all__ = ["torch_cpu_topk_set", "torch_cpu_topk_rows", "topk_set_into", "nth_element_set_into",
           "partial_sort_set_into", "partial_sort_set_hinted", "partial_sort_set_listed",
           "topk_scratch_len", "before", "pair_key", "hints_pass", "run_passes", "SCAN_RUN",
           "ListedSpans"]


# --------------------------------------------------------------------------- comparator


@njit
def before(a, b):
    """torch's ``largest=True`` comparator: NaN first, then larger values; never looks at the index."""
    # & and | rather than `and` / `or`: no branches, so a scan's test compiles to selects.
    return ((a != a) & (b == b)) | (a > b)


# --------------------------------------------------------------------------- a pair as one integer

# The pairs the algorithms below move are int64s: the value's key (pair_key) in the high 32
# bits, the index in the low 32. A heap step then moves one integer where it moved a value and
# an index, and compares two integers: the selection takes half the time it took on separate
# value and index arrays (a consumer's rows at 32,768 tokens, 2026-12-05).
_KEY_SHIFT = 32
_INDEX_BITS = 0xFFFFFFFF
_MAGNITUDE_BITS = 0x7FFFFFFF      # an f32's bits below its sign
_NAN_KEY = _MAGNITUDE_BITS        # above every number's key (+inf's 0x7F800000)


@njit
def pair_key(x):
    """An f32 as an integer in ``before``'s order: ``before(a, b) == (pair_key(a) >
    pair_key(b))`` for every two f32 values. A float's bits below the sign order its magnitude,
    so a negative float's key is minus them (-0 and +0, equal as floats, both 0); every NaN
    gets one key, above +inf's (first, and never before another NaN)."""
    if x != x:
        return np.int64(_NAN_KEY)
    bits = np.int64(np.float32(x).view(np.int32))
    return -(bits & np.int64(_MAGNITUDE_BITS)) if bits < 0 else bits


@njit
def pair(x, i):
    """The pair ``(x, i)`` as one int64 (``i`` below 2**32): it comes before another exactly
    when ``before(x, y)`` (:func:`_key`)."""
    return (pair_key(x) << _KEY_SHIFT) | i


@njit
def _key(p):
    return p >> _KEY_SHIFT


@njit
def _index(p):
    return p & _INDEX_BITS


# --------------------------------------------------------------------------- heap (libstdc++ shape)

# A heap's positions are unsigned: numba then indexes without testing for a negative position,
# which took a fifth of the heap's time.
_U0, _U1, _U2 = np.uint64(0), np.uint64(1), np.uint64(2)


@njit
def _adjust_heap(heap, hole, item):
    """libstdc++ ``__adjust_heap`` + ``__push_heap`` on the pairs ``heap``, ``hole`` a uint64.

    The hole walks all the way down to a leaf before the pair is pushed back up; stopping the walk
    early (a textbook sift-down) would keep different tied pairs.
    """
    length = np.uint64(heap.shape[0])
    top = hole
    child = hole
    while child < (length - _U1) // _U2:
        child = _U2 * (child + _U1)
        # The right child moves up unless it comes before the left one (the heap's top is the
        # pair LAST in `before` order); a subtraction, not a branch the data would mispredict.
        child -= np.uint64(_key(heap[child]) > _key(heap[child - _U1]))
        heap[hole] = heap[child]
        hole = child
    if (length & _U1) == _U0 and child == (length - _U2) // _U2:
        # A lone last left child.
        child = _U2 * (child + _U1)
        heap[hole] = heap[child - _U1]
        hole = child - _U1
    key = _key(item)
    while hole > top:
        parent = (hole - _U1) // _U2
        if not _key(heap[parent]) > key:
            break
        heap[hole] = heap[parent]
        hole = parent
    heap[hole] = item


@njit
def _make_heap(heap):
    """libstdc++ ``__make_heap``: re-seat the parents from ``(len - 2) / 2`` down to 0."""
    length = heap.shape[0]
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(heap, np.uint64(parent), heap[parent])
        if parent == 0:
            return
        parent -= 1


@njit
def _heap_select(pairs, first, middle, last):
    """libstdc++ ``__heap_select`` on ``pairs[first:last]`` in place (introselect at depth 0)."""
    heap = pairs[first:middle]
    _make_heap(heap)
    for i in range(middle, last):
        if _key(pairs[i]) > _key(heap[0]):
            item = pairs[i]
            pairs[i] = heap[0]
            _adjust_heap(heap, _U0, item)


@njit
def _heap_select_row(row, heap, hint, block):
    """``std::partial_sort``'s set: heap-select the first ``k = len(heap)`` pairs of ``row``
    into ``heap``.

    Same steps as ``_heap_select`` over the pairs ``(row[i], i)``, but the row itself is never
    copied: the displaced top would be written back to position i, which the scan never reads
    again, so only the k-pair heap needs storage. The hot loop compares against a cached top.
    With ``block`` > 0, ``hint[b]`` is at least the max of ``row[b * block : (b + 1) * block]``
    (NaN where one of them is): a run whose blocks' hints none passes the top is skipped
    without reading the row (a long row is read from memory otherwise; its hints are a
    ``block``-th of it).
    """
    n = row.shape[0]
    top = _heap_of_first(row, heap)
    i = heap.shape[0]
    while i < n:
        if top != top:
            return          # a NaN top is never displaced
        # The top only rises: a run of values none of which passes it now never will, and one
        # vector pass over the run says so (most of a long row).
        if i + SCAN_RUN <= n and not run_passes(row, i, top, hint, block):
            i += SCAN_RUN
            continue
        top = _heap_push_run(row, i, min(n, i + SCAN_RUN), heap, top)
        i += SCAN_RUN


@njit
def _heap_of_first(row, heap):
    """The heap select's start: the pairs of ``row``'s first ``len(heap)`` values made a heap
    in ``heap``; returns its top's value."""
    for j in range(heap.shape[0]):
        heap[j] = pair(row[j], j)
    _make_heap(heap)
    return row[_index(heap[0])]


@njit
def _heap_push_run(row, j0, j1, heap, top):
    """The heap select's step over ``row[j0:j1]``: each value that comes before the heap's
    ``top`` (its value) replaces it; returns the new top's value."""
    for j in range(j0, j1):
        x = row[j]
        # Inlined `before(x, top)`: the scan compares floats, and forms a pair only to push it.
        if x > top or (x != x and top == top):
            _adjust_heap(heap, _U0, pair(x, j))
            top = row[_index(heap[0])]
    return top


class ListedSpans(NamedTuple):
    """Where alone rows may hold a value above -inf: row ``s``'s spans of ``span`` positions
    start at ``firsts[offsets[s]:offsets[s + 1]]``, ascending and not overlapping; every other
    position of the row is -inf. A candidate consumer's masked rows are -inf outside the
    quarters of key blocks holding a candidate (its ``NeededKeys.spans``): the top-k and the
    golden's runners-up visit those alone instead of scanning (or skipping) a row 64 times
    longer at 1,048,576 positions, reading its scores at random."""
    offsets: np.ndarray
    firsts: np.ndarray
    span: int


@njit
def _heap_select_listed(row, heap, firsts, span):
    """:func:`_heap_select_row` of a row that is -inf outside the spans of ``span`` positions at
    ``firsts`` (ascending): the first k pairs fill the heap as they are, then only the spans'
    values from k on are visited, in order. The same steps: a -inf never comes before the
    heap's top, so every value the scan would skip is one it would not take."""
    n, k = row.shape[0], heap.shape[0]
    top = _heap_of_first(row, heap)
    for first in firsts:
        if top != top:
            return          # a NaN top is never displaced
        top = _heap_push_run(row, max(first, k), min(n, first + span), heap, top)


# Values of a row one test of _passes_any covers.
SCAN_RUN = 32


@njit
def _passes_any(row, i, top):
    """Whether any of ``row[i : i + SCAN_RUN]`` comes before ``top`` (larger, or a NaN): no
    early exit, so the loop vectorises."""
    hit = 0
    for j in range(i, i + SCAN_RUN):
        x = row[j]
        hit |= (x > top) | (x != x)
    return hit != 0


@njit
def hints_pass(hint, b0, b1, top):
    """Whether a value of the blocks ``b0 .. b1`` may come before ``top``, by their hints (each
    at least its block's max, NaN where one of its values is): no early exit, so the loop
    vectorises. A hint of +inf always passes: the candidate source pins its newest block to
    +inf whatever it holds, a NaN too, which a +inf top would otherwise hide."""
    hit = 0
    for b in range(b0, b1):
        x = hint[b]
        hit |= (x > top) | (x != x) | (x == np.inf)
    return hit != 0


@njit
def run_passes(row, i, top, hint, block):
    """Whether a value of the run ``row[i : i + SCAN_RUN]`` may come before ``top``: read from
    the row (:func:`_passes_any`), or with ``block`` > 0 from the block hints ``hint`` of its
    blocks of ``block`` positions (:func:`hints_pass`; a ``block``-th of the row to read)."""
    if not block:
        return _passes_any(row, i, top)
    return hints_pass(hint, i // block, (i + SCAN_RUN - 1) // block + 1, top)


# --------------------------------------------------------------------------- introselect


@njit
def _move_median_to_first(pairs, result, a, b, c):
    """libstdc++ ``__move_median_to_first``: swap the median of a, b, c (by ``before``) into result."""
    ka, kb, kc = _key(pairs[a]), _key(pairs[b]), _key(pairs[c])
    if ka > kb:
        if kb > kc:
            pick = b
        elif ka > kc:
            pick = c
        else:
            pick = a
    elif ka > kc:
        pick = a
    elif kb > kc:
        pick = c
    else:
        pick = b
    _swap(pairs, result, pick)


@njit
def _swap(pairs, i, j):
    t = pairs[i]
    pairs[i] = pairs[j]
    pairs[j] = t


@njit
def _unguarded_partition(pairs, first, last, pivot):
    """libstdc++ ``__unguarded_partition``: Hoare partition around ``pairs[pivot]``; returns
    the cut."""
    key = _key(pairs[pivot])
    while True:
        while _key(pairs[first]) > key:
            first += 1
        last -= 1
        while key > _key(pairs[last]):
            last -= 1
        if not first < last:
            return first
        _swap(pairs, first, last)
        first += 1


@njit
def _insertion_sort(pairs, first, last):
    """libstdc++ ``__insertion_sort`` (stable): straight to the front, else an unguarded walk back."""
    if first == last:
        return
    for i in range(first + 1, last):
        item = pairs[i]
        key = _key(item)
        j = i
        if key > _key(pairs[first]):
            while j > first:
                pairs[j] = pairs[j - 1]
                j -= 1
        else:
            while key > _key(pairs[j - 1]):
                pairs[j] = pairs[j - 1]
                j -= 1
        pairs[j] = item


@njit
def _floor_log2(n):
    r = 0
    while n > 1:
        n >>= 1
        r += 1
    return r


@njit
def _nth_element(pairs, n, nth):
    """libstdc++ ``std::nth_element(pairs, pairs + nth, pairs + n, before)``
    (``__introselect``) in place."""
    if n == 0 or nth == n:
        return
    first = _ZERO
    last = n
    depth = 2 * _floor_log2(n)
    while last - first > 3:
        if depth == 0:
            _heap_select(pairs, first, nth + 1, last)
            # libstdc++ then swaps first and nth; that does not change which pairs are in
            # [0, nth], so the set is already final.
            _swap(pairs, first, nth)
            return
        depth -= 1
        mid = first + (last - first) // 2
        _move_median_to_first(pairs, first, first + 1, mid, last - 1)
        cut = _unguarded_partition(pairs, first + 1, last, first)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(pairs, first, last)


# --------------------------------------------------------------------------- njit core


@njit
def topk_scratch_len(n, k):
    """Scratch entries ``topk_set_into`` needs for a row of n values: n when ``k * 64 > n``, else k."""
    if k * 64 > n:
        return n
    return k


@njit
def topk_set_into(row_vals, k, out_idx, scratch_vals, scratch_idx):
    """Write torch's CPU ``topk(row_vals, k)`` index set, sorted ascending, into ``out_idx[:k]``.

    Signature (all arrays 1-D, any layout; nothing is allocated):

    * ``row_vals``: float32 ``[n]``, read only (torch compares as f32; a float64 row would be
      compared unrounded in the partial_sort branch, so round it first).
    * ``k``: int, ``0 <= k <= n``.
    * ``out_idx``: int64 (any integer dtype that holds n - 1) ``[>= k]``; only ``[:k]`` is written.
    * ``scratch_vals``: float32, ``scratch_idx``: int64, each of length at least
      ``topk_scratch_len(n, k)`` (n when ``k * 64 > n``, the nth_element branch, which permutes
      the row's pairs in ``scratch_idx`` and marks its set in ``scratch_vals``; k otherwise,
      the partial_sort branch, which keeps a k-pair heap in ``scratch_idx``). Their contents on
      entry do not matter and are garbage on exit.

    Raises ValueError (from njit code) if k is out of range or the scratch is too short.
    Safe to call concurrently from a ``prange`` loop as long as each iteration has its own
    ``out_idx`` and scratch.
    """
    n = row_vals.shape[0]
    if k < 0 or k > n:
        raise ValueError("topk_set_into: k must be in [0, n]")
    if k == 0:
        return
    need = topk_scratch_len(n, k)
    if scratch_vals.shape[0] < need or scratch_idx.shape[0] < need:
        raise ValueError("topk_set_into: scratch shorter than topk_scratch_len(n, k)")
    if k * 64 > n:
        nth_element_set_into(row_vals, k, out_idx, scratch_vals, scratch_idx)
    else:
        partial_sort_set_into(row_vals, k, out_idx, scratch_idx)


@njit
def nth_element_set_into(row_vals, k, out_idx, scratch_vals, scratch_idx):
    """The ``k * 64 > n`` branch of :func:`topk_set_into` (``std::nth_element``), whatever n
    is, for ``1 <= k <= n`` and scratch of n entries each (unchecked). A kernel whose rows all
    take this branch calls it alone: none of the heap branch's code is compiled with it."""
    n = row_vals.shape[0]
    for j in range(n):
        scratch_idx[j] = pair(row_vals[j], j)
    _nth_element(scratch_idx, n, k - 1)
    # k > n / 64 here, so listing the set in index order by marking it in the value
    # scratch costs O(n), no more than the selection itself.
    for j in range(n):
        scratch_vals[j] = 0.0
    for j in range(k):
        scratch_vals[_index(scratch_idx[j])] = 1.0
    m = 0
    for j in range(n):
        if scratch_vals[j] != 0.0:
            out_idx[m] = j
            m += 1


@njit
def partial_sort_set_into(row_vals, k, out_idx, heap):
    """The ``k * 64 <= n`` branch of ``topk_set_into`` (``std::partial_sort``), whatever n is.

    For callers that know the row continues with values that can never enter the heap (-inf
    past a visible length): they may pass only the prefix, the branch being decided by the full
    length. ``heap``: int64 scratch of at least k entries.
    """
    partial_sort_set_hinted(row_vals, k, out_idx, heap, row_vals, _ZERO)


@njit
def partial_sort_set_hinted(row_vals, k, out_idx, heap, hint, block):
    """:func:`partial_sort_set_into` with the row's block maxima ``hint`` (or upper bounds of
    them; see :func:`_heap_select_row`), which only decide what is skipped: the set is the same."""
    if row_vals.shape[0] > k:
        _heap_select_row(row_vals, heap[:k], hint, block)
    _heap_set_out(row_vals.shape[0], k, heap, out_idx)


@njit
def partial_sort_set_listed(row_vals, k, out_idx, heap, firsts, span):
    """:func:`partial_sort_set_into` of a row that is -inf outside the spans of ``span``
    positions at ``firsts`` (ascending; :class:`ListedSpans`): the same set, visiting only
    those."""
    if row_vals.shape[0] > k:
        _heap_select_listed(row_vals, heap[:k], firsts, span)
    _heap_set_out(row_vals.shape[0], k, heap, out_idx)


@njit
def _heap_set_out(n, k, heap, out_idx):
    """The heap's k indices, ascending, into ``out_idx`` (a row of only k: all of them)."""
    for j in range(k):
        out_idx[j] = _index(heap[j]) if n > k else j
    out_idx[:k].sort()          # distinct indices: any correct sort gives the same


# --------------------------------------------------------------------------- batched kernel


@njit(parallel=True)
def _topk_rows_kernel(vals, ks, out):
    """One ``topk_set_into`` per row in parallel; each row allocates its own scratch.

    A row's result depends only on that row, so the output does not depend on the thread count
    or on how rows are scheduled.
    """
    rows = vals.shape[0]
    n = vals.shape[1]
    for r in prange(rows):
        k = ks[r]
        need = topk_scratch_len(n, k)
        sv = np.empty(need, dtype=np.float32)
        si = np.empty(need, dtype=np.int64)
        topk_set_into(vals[r], k, out[r], sv, si)


# --------------------------------------------------------------------------- public API


def _as_float32(vals, name):
    arr = np.asarray(vals)
    if not np.issubdtype(arr.dtype, np.floating):
        # bf16 from ml_dtypes is not an np.floating subclass but converts exactly.
        if arr.dtype.name != "bfloat16":
            raise TypeError(f"{name} must be a real floating-point array, got dtype {arr.dtype}")
    return arr


def _check_k(k, n, name="k"):
    if n >= 1 << 32:
        raise ValueError(f"rows of at most 2**32 - 1 values (a pair's index is 32 bits), got {n}")
    if not is_int(k):
        raise TypeError(f"{name} must be an integer, got {type(k).__name__}")
    k = int(k)
    if k < 0 or k > n:
        raise ValueError(f"{name} must be in [0, n] = [0, {n}], got {k}")
    return k


def torch_cpu_topk_set(vals, k):
    """The index set ``torch.topk(vals, k)`` returns on torch's CPU backend, sorted ascending.

    Parameters
    ----------
    vals : 1-D array of real floats, length n
        Converted to float32 (torch compares bf16 and f32 rows as f32; values that already are
        float32, or bf16 stored as float32, are used exactly). NaN, +inf and -inf are allowed.
    k : int, ``0 <= k <= n``

    Returns
    -------
    int64 array of length k: the indices of the pairs torch's ``largest=True`` topk keeps
    (NaN counts as the largest value; ties are settled as libstdc++'s ``nth_element`` when
    ``k * 64 > n``, or ``partial_sort`` when ``k * 64 <= n``, settles them), sorted ascending.
    ``sorted=True/False`` in torch never changes this set.
    """
    arr = _as_float32(vals, "vals")
    if arr.ndim != 1:
        raise ValueError(f"vals must be 1-D, got shape {arr.shape}")
    row = np.ascontiguousarray(arr, dtype=np.float32)
    n = row.shape[0]
    k = _check_k(k, n)
    out = np.empty(k, dtype=np.int64)
    if k == 0:
        return out
    need = topk_scratch_len(n, k)
    topk_set_into(row, k, out, np.empty(need, np.float32), np.empty(need, np.int64))
    return out


def torch_cpu_topk_rows(vals, k):
    """Row-wise :func:`torch_cpu_topk_set` on a ``[rows, n]`` array, rows in parallel.

    Parameters
    ----------
    vals : 2-D array of real floats ``[rows, n]`` (converted to C-contiguous float32)
    k : int, or integer array ``[rows]`` with a k per row; every k in ``[0, n]``

    Returns
    -------
    int64 ``[rows, max_k]``: row r holds its k[r] indices sorted ascending, then -1 padding.
    ``max_k`` is k for a scalar k and ``max(k)`` (0 when there are no rows) for an array.
    """
    arr = _as_float32(vals, "vals")
    if arr.ndim != 2:
        raise ValueError(f"vals must be 2-D [rows, n], got shape {arr.shape}")
    mat = np.ascontiguousarray(arr, dtype=np.float32)
    rows, n = mat.shape
    if is_int(k):
        kk = _check_k(k, n)
        ks = np.full(rows, kk, dtype=np.int64)
        max_k = kk
    elif isinstance(k, (bool, np.bool_)) or np.isscalar(k):
        raise TypeError(f"k must be an integer or an integer array, got {type(k).__name__}")
    else:
        karr = np.asarray(k)
        if karr.dtype == np.bool_ or not np.issubdtype(karr.dtype, np.integer):
            raise TypeError(f"k array must have an integer dtype, got {karr.dtype}")
        if karr.shape != (rows,):
            raise ValueError(f"k array must have shape ({rows},) to match vals, got {karr.shape}")
        ks = karr.astype(np.int64)
        if rows and (ks.min() < 0 or ks.max() > n):
            bad = int(np.flatnonzero((ks < 0) | (ks > n))[0])
            raise ValueError(f"k[{bad}] = {ks[bad]} is outside [0, n] = [0, {n}]")
        max_k = int(ks.max()) if rows else 0
    out = np.full((rows, max_k), -1, dtype=np.int64)
    if rows and max_k:
        _topk_rows_kernel(mat, ks, out)
    return out

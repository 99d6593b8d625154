"""The decode step's product: a few input rows against the held bf16 pairs of one weight, or of
several weights that read the same input, in one kernel call.

A decode step multiplies one row by every weight of the layer once: it is bound by reading the
weights from memory, and each kernel call wakes the threads, splits its work and waits for the
slower of them. The layer's projections of one input (its ``x``: ``wkv``, ``wq_a``, the
compressor's and the indexer's; its query latent: ``wq_b`` and the indexer's) therefore run as
one call (:func:`matvec_into` with several weights), their work items split evenly over the
threads as one list. Each output is summed whole by one work item in the reference's order
(:func:`_matvec_bf16_block`): which call, item or thread computes it changes no sum.
"""

from __future__ import annotations

import contextlib

import numba
import numpy as np
from numba import prange

from ..jit import njit
from .bf16_dot import DOT_LANES, MATVEC_BLOCKS, bf16_matvec_tile
from .formats import bf16_scalar
from .workers import claim_next, serial_twin, sized_call, work_beside

__all__ = ["MATVEC_MEMBERS", "matvec_into", "matvec_beside", "pair_lo", "pair_hi"]

#: Weights one call takes at most (a layer's projections of ``x`` are four); fewer are padded
#: with empty ones, so that one compiled kernel serves every count.
MATVEC_MEMBERS = 4


@njit
def pair_lo(pair):
    """The f32 value of a bf16 pair's low half (its even input)."""
    return np.uint32(pair << np.uint32(16)).view(np.float32)


@njit
def pair_hi(pair):
    """The f32 value of a bf16 pair's high half (its odd input)."""
    return np.uint32(pair & np.uint32(0xFFFF0000)).view(np.float32)


@njit(nogil=True)
def _matvec_bf16_block(x, pairs, out, groups, k_in, block, item, acc, part):
    """Work item ``item`` of ``out = bf16(x @ W.T)``: up to ``MATVEC_BLOCKS`` blocks of one group.

    The blocks of ``pairs`` split evenly into ``groups``; a group's blocks are covered by items of
    ``MATVEC_BLOCKS`` (the last fewer), group g reads inputs ``x[:, g*k_in : (g+1)*k_in]`` and
    writes outputs ``g*rank ..`` (``rank = out.shape[1] / groups``); padding lanes are dropped.
    Each output adds its products in the reference's order: runs of ``block`` inputs (even, see
    :func:`~.linear.bf16_k_block`) each from zero, every pair as ``(acc + x[2i+1]*w[2i+1]) +
    x[2i]*w[2i]`` (:func:`~.bf16_dot.bf16_matvec_tile`), an odd K's last product added alone,
    run sums added in order. ``acc [m, MATVEC_BLOCKS, DOT_LANES]`` and ``part [MATVEC_BLOCKS,
    DOT_LANES]`` (float32) are the item's sums, a thread's buffers for all its items.
    """
    m = x.shape[0]
    n_pairs = pairs.shape[1]
    per_group = pairs.shape[0] // groups
    items = -(-per_group // MATVEC_BLOCKS)
    g = item // items
    b0 = g * per_group + (item % items) * MATVEC_BLOCKS
    nq = min(MATVEC_BLOCKS, (g + 1) * per_group - b0)
    # An item short of four blocks repeats its last one (read from cache, its sums dropped).
    q1, q2, q3 = b0 + min(1, nq - 1), b0 + min(2, nq - 1), b0 + min(3, nq - 1)
    rank = out.shape[1] // groups
    both = k_in // 2              # the pairs holding two products
    acc[:] = 0
    for i in range(m):
        xi = x[i:i + 1, g * k_in:(g + 1) * k_in]
        for p0 in range(0, n_pairs, block // 2):
            p1 = min(n_pairs, p0 + block // 2)
            # The first run sums straight into the output row, later ones from zero apart.
            run = acc[i] if p0 == 0 else part
            if p0:
                run[:] = 0
            p_end = min(p1, both)
            if p_end > p0:
                bf16_matvec_tile(xi[:, 2 * p0:2 * p_end], pairs[b0, p0:p_end], pairs[q1, p0:p_end],
                                 pairs[q2, p0:p_end], pairs[q3, p0:p_end], run)
            if p1 > p_end:
                # An odd K: its last product alone, as the reference adds it (x holds no value
                # to pair it with).
                xl = xi[0, k_in - 1]
                for q in range(nq):
                    w0 = pairs[b0 + q, p_end]
                    for j in range(DOT_LANES):
                        run[q, j] += xl * pair_lo(w0[j])
            if p0:
                for q in range(MATVEC_BLOCKS):      # a loop: docs/architecture.md, cold start
                    for j in range(DOT_LANES):
                        acc[i, q, j] += part[q, j]
    first = (b0 - g * per_group) * DOT_LANES
    for i in range(m):
        for j in range(min(nq * DOT_LANES, rank - first)):
            out[i, g * rank + first + j] = bf16_scalar(acc[i, j // DOT_LANES, j % DOT_LANES])


@njit
def _item_ends(pairs, groups):
    """Per work item of the call's one list (each weight's items in order), the blocks of
    weights read up to its end: what a thread's share is measured in (the items of a weight's
    last blocks, and a small weight's only one, hold fewer than ``MATVEC_BLOCKS``)."""
    n = 0
    for j in range(MATVEC_MEMBERS):
        n += groups[j] * -(-(pairs[j].shape[0] // groups[j]) // MATVEC_BLOCKS)
    ends = np.empty(n, np.int64)
    item, total = 0, 0
    for j in range(MATVEC_MEMBERS):
        per_group = pairs[j].shape[0] // groups[j]
        for _ in range(groups[j]):
            for b0 in range(0, per_group, MATVEC_BLOCKS):
                total += min(MATVEC_BLOCKS, per_group - b0)
                ends[item] = total
                item += 1
    return ends


@njit
def _items_up_to(ends, blocks):
    """How many items end at or before ``blocks`` blocks (``ends`` ascending): a binary search
    (numba's ``np.searchsorted`` compiles for most of a second of a cold start)."""
    lo, hi = 0, len(ends)
    while lo < hi:
        mid = (lo + hi) // 2
        if ends[mid] <= blocks:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(nogil=True)
def _run_items(x, pairs, outs, groups, k_in, block, lo, hi):
    """Work items ``lo .. hi - 1`` of the call's one list."""
    acc = np.empty((x.shape[0], MATVEC_BLOCKS, DOT_LANES), np.float32)
    part = np.empty((MATVEC_BLOCKS, DOT_LANES), np.float32)
    j, first = 0, 0
    for item in range(lo, hi):
        while True:
            n = groups[j] * -(-(pairs[j].shape[0] // groups[j]) // MATVEC_BLOCKS)
            if item < first + n:
                break
            j, first = j + 1, first + n
        _matvec_bf16_block(x, pairs[j], outs[j], groups[j], k_in, block, item - first, acc, part)


@njit(parallel=True, nogil=True)
def _matvec_kernel(x, pairs, outs, groups, k_in, block, workers):
    # Each of ``workers`` takes one run of items holding an equal share of the blocks (numba's
    # own split of the items would give one thread a whole item more of four blocks where a
    # weight's last holds one), whole items in order.
    ends = _item_ends(pairs, groups)
    total = ends[-1] if len(ends) else 0
    for w in prange(workers):
        lo = _items_up_to(ends, total * w // workers)
        hi = _items_up_to(ends, total * (w + 1) // workers)
        if w == workers - 1:
            hi = len(ends)
        _run_items(x, pairs, outs, groups, k_in, block, lo, hi)


_matvec_kernel_serial = serial_twin(_matvec_kernel)


@njit(nogil=True)
def _claimed_kernel(x, pairs, outs, groups, k_in, block, next_item, most):
    """The call's work items, each run by the thread that claims it (``next_item[0]``), at most
    ``most`` of them: the calls of :func:`matvec_beside`'s two threads share them."""
    n = len(_item_ends(pairs, groups))
    for _ in range(most):
        item = claim_next(next_item)
        if item >= n:
            return
        _run_items(x, pairs, outs, groups, k_in, block, item, item + 1)


# What pads a call of fewer weights: no blocks, so no work items.
_NO_PAIRS = np.zeros((0, 1, DOT_LANES), np.uint32)
_NO_OUT = np.zeros((1, 0), np.float32)


def _call_args(name, x, pairs, groups, outs) -> tuple:
    """A call's weights, groups and outputs padded to ``MATVEC_MEMBERS`` (one compiled kernel
    for every count), its input writeable; checked."""
    n = len(pairs)
    if not 1 <= n <= MATVEC_MEMBERS or len(groups) != n or len(outs) != n:
        raise ValueError(f"{name}: 1 to {MATVEC_MEMBERS} weights, each with its groups and "
                         f"output, got {len(pairs)}, {len(groups)} and {len(outs)}")
    pad = MATVEC_MEMBERS - n
    if not x.flags.writeable:       # a read-only x would compile a kernel of its own (~5 s)
        x = x.copy()
    return (x, tuple(pairs) + (_NO_PAIRS,) * pad, tuple(outs) + (_NO_OUT,) * pad,
            tuple(int(g) for g in groups) + (1,) * pad)


def matvec_into(x, pairs, groups, k_in: int, block: int, outs) -> None:
    """``outs[j] = bf16(x @ W_j.T)`` for each held weight j, in one kernel call.

    ``x [m, in]`` float32 (C-contiguous, a few rows of bf16 values, every weight's input),
    ``pairs[j]`` weight j's pairs (``Bf16Matrix``'s layout, ``[blocks, ceil(k_in / 2),
    DOT_LANES]``, each group's rows padded to whole blocks) of ``groups[j]`` groups of ``k_in``
    inputs each (``in = groups[j] * k_in``), ``outs[j]`` float32 ``[m, out_j]``; ``block`` the
    reference's run length (even). At most ``MATVEC_MEMBERS`` weights.
    """
    x, pairs, outs, groups = _call_args("matvec_into", x, pairs, groups, outs)
    # Small weights (the indexer's key projection) run in the calling thread (sized_call).
    per_item = MATVEC_BLOCKS * DOT_LANES
    sized_call(_matvec_kernel, -(-sum(o.shape[1] for o in outs) // per_item),
               x.shape[0] * k_in * per_item, x, pairs, outs, groups, k_in, block,
               numba.get_num_threads())


#: What :func:`matvec_beside`'s calling thread reads before its block, while the helper thread
#: wakes (0.13-0.23 ms, measured on the 2-core Zen 4: about 4 MB at one core's rate).
LEAD_BYTES = 4 << 20


@contextlib.contextmanager
def matvec_beside(x, pairs, groups, k_in: int, block: int, outs):
    """:func:`matvec_into` beside the ``with`` block: read on a helper thread while the block
    runs on this one, then on both (:func:`~.workers.work_beside`); ``outs`` are complete when
    the block ends. This thread reads the first ``LEAD_BYTES`` (at most half the items) while
    the helper wakes. The same sums, each output whole by one work item."""
    x, pairs, outs, groups = _call_args("matvec_beside", x, pairs, groups, outs)
    items = len(_item_ends(pairs, groups))
    item_bytes = max(1, sum(p.nbytes for p in pairs) // max(items, 1))
    counter = np.zeros(1, np.int64)
    with work_beside(_claimed_kernel, x, pairs, outs, groups, k_in, block, counter, items):
        _claimed_kernel(x, pairs, outs, groups, k_in, block, counter,
                        min(LEAD_BYTES // item_bytes, items // 2))
        yield

"""Index scores on the packed kernels: one parallel kernel a layout, chosen by the layout's name.

Each kernel takes a tile's query heads (a layout of :mod:`.query_layouts`, query-major, padded
rows) and the packed key blocks of the same layout, and writes a tile's scores after the
visibility mask. Each worker takes a contiguous run of key blocks; for each block it forms the
dot products of the queries that see any of it (a suffix of the tile, as ``clen`` grows with
the query) and mixes them while they are in cache, in torch's head order
(:func:`~.blas_scores.mix_heads_by_head`), or takes them mixed from a tile kernel that mixes as
it forms them (AMX's and VNNI's folded rows; on VNNI's, the run's blocks every query sees
whole go first, a tile call each straight into the score rows). Every score is formed whole by
one worker, in a fixed order, so the result does not depend on the thread count. A candidate
consumer's tile on VNNI's folded rows runs by query instead: each worker takes a run of the
queries' groups of four candidate quarters (:func:`_vnni_quarters_kernel`), its multiply-adds
only the candidates'. In a decode step's block beside its weight reading
(:func:`~ds41numba.numerics.work_beside`), VNNI's and AVX2's scores go a run of key blocks at
a time to the thread that claims it, the step's or the helper once its reading is done
(:func:`_vnni_claimed`).

The layouts (:data:`LAYOUTS`): ``"bf16"`` (bf16 pairs, AVX512-BF16), ``"int8"`` (VNNI's
per-block layout, a scale a 32-value block), ``"vnni_folded"`` (VNNI's folded rows: one scale a
row, unsigned key bytes), ``"amx"`` (AMX's folded rows), ``"int8_pairs"`` (the per-block
layout on AVX2).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from ..jit import njit
from ..numerics import (AMX_ROWS, DOT_LANES, DOT_ROWS, MAX_BLOCK, QUARTER, amx_begin, amx_dot_tile,
                        amx_end, amx_mix_tile, bf16_dot_tile, claim_next, in_beside_block,
                        int8_dot_into, int8_pairs_into, pairs_mix_tile, serial_twin,
                        share_with_helper, sized_call, vnni_mix_quarters, vnni_mix_tile)
from .blas_scores import mix_heads_by_head
from .block_maxima import key_block_maxima, visible_block_maxima
from .candidate_scores import EVERY_KEY_BLOCK, NeededKeys
from .visibility import masked_buffer

__all__ = ["LAYOUTS", "tile_scores_packed"]

#: Key blocks a claim of :func:`_claimed_run` takes: 64 are 2,048 keys, about 45 us of one
#: query's scores on a Zen 4 core (the longest the step's thread waits for the helper's last).
SHARED_BLOCKS = 64


@njit
def _first_seeing(clen, T, t0):
    """The first of the ``T`` queries that sees a position of the key block at ``t0`` (``T``
    when none does): ``clen`` grows with the query."""
    s = 0
    while s < T and clen[s] <= t0:
        s += 1
    return s


@njit
def _next_run(need, b, a, T):
    """The next run ``[a, e)`` of queries from ``a`` that need key block ``b`` (``need [T,
    blocks]``; no column: every query needs every block), ``(T, T)`` when none does: the
    kernels form the scores of a run of queries at once, and none of a query that needs none."""
    if need.shape[1] == 0:
        return a, T
    while a < T and not need[a, b]:
        a += 1
    e = a
    while e < T and need[e, b]:
        e += 1
    return a, e


@njit
def _mix_dots(d, w, clen, t0, s_lo, out, block, block_max, finite):
    """The dot products ``d`` of a key block (a query head a row) of the queries ``s_lo ..``,
    mixed into ``out`` where visible, and their block maxima when ``block`` > 0. ``finite``:
    ``d`` are an integer kernel's exact dot products, never NaN."""
    T, ih = w.shape
    mix_heads_by_head(d[s_lo * ih:T * ih], w[s_lo:], clen[s_lo:], t0, out[s_lo:], finite)
    if block:
        key_block_maxima(out, clen, t0, s_lo, block, block_max)


@njit
def _mix_target(out, mixed, clen, s_lo, t0, block, block_max):
    """Where a mixing tile kernel writes the key block at ``t0``'s scores of the queries
    ``s_lo ..``: ``(scores, maxima_out, maxima, whole)``.

    Where every query sees the whole key block (``whole``) its scores go straight into the
    score rows, and with ``block`` = ``MAX_BLOCK`` (``maxima``) the candidate blocks' maxima
    come from the kernel's registers into ``maxima_out`` (otherwise a placeholder, unwritten);
    else into ``mixed`` (room for ``[T, DOT_LANES]``), for :func:`_finish_mixed` to copy.
    """
    T = out.shape[0]
    whole = t0 + DOT_LANES <= out.shape[1]
    for s in range(s_lo, T):
        whole = whole and clen[s] >= t0 + DOT_LANES
    maxima = whole and block == MAX_BLOCK
    j = t0 // MAX_BLOCK if maxima else 0
    maxima_out = block_max[s_lo:T, j:j + DOT_LANES // MAX_BLOCK]
    if whole:
        return out[s_lo:T, t0:t0 + DOT_LANES], maxima_out, maxima, True
    return mixed[:T - s_lo], maxima_out, maxima, False


@njit
def _finish_mixed(mixed, clen, s_lo, t0, out, whole, maxima, block, block_max):
    """After a mixing tile kernel wrote :func:`_mix_target`'s scores: the visible ones of a
    partly seen key block into ``out``, and the block maxima the kernel did not take."""
    if not whole:
        for s in range(s_lo, out.shape[0]):
            for j in range(min(DOT_LANES, clen[s] - t0)):
                out[s, t0 + j] = mixed[s - s_lo, j]
    if block and not maxima:
        key_block_maxima(out, clen, t0, s_lo, block, block_max)


@njit
def _bf16_run(pairs, blocks, w, clen, b, s_lo, e, d, out, block, block_max):
    """Key block ``b``'s scores of the queries ``s_lo .. e`` on AVX512-BF16."""
    ih = w.shape[1]
    first = s_lo * ih // DOT_ROWS * DOT_ROWS
    d[first:] = 0
    for r in range(first, e * ih, DOT_ROWS):
        bf16_dot_tile(pairs[r:r + DOT_ROWS], blocks[b], d[r:r + DOT_ROWS])
    _mix_dots(d, w[:e], clen[:e], b * DOT_LANES, s_lo, out[:e], block, block_max, False)


@njit(parallel=True, nogil=True)
def _bf16_kernel(q, keys, w, clen, n_blocks, workers, converts, out, block, block_max, need):
    """The scores on AVX512-BF16: ``q = (pairs,)``, ``keys = (blocks,)``."""
    T = w.shape[0]
    pairs, blocks = q[0], keys[0]
    for wk in prange(workers):
        d = np.empty((pairs.shape[0], DOT_LANES), np.float32)
        for b in range(wk * n_blocks // workers, (wk + 1) * n_blocks // workers):
            a, e = _next_run(need, b, _first_seeing(clen, T, b * DOT_LANES), T)
            while a < T:
                _bf16_run(pairs, blocks, w, clen, b, a, e, d, out, block, block_max)
                a, e = _next_run(need, b, e, T)


_bf16_kernel_serial = serial_twin(_bf16_kernel)


@njit
def _mixes_folded(q, ih):
    """Whether VNNI's queries ``q`` are folded rows (one correction a row) of whole row tiles a
    query (``ih`` heads): then :func:`~ds41numba.numerics.vnni_mix_tile` mixes them as formed."""
    return ih % AMX_ROWS == 0 and q[1].shape[1] == 1


@njit
def _vnni_run(q, keys, w, w_rows, clen, b, s_lo, e, d, mixed, converts, out, block, block_max):
    """Key block ``b``'s scores of the queries ``s_lo .. e`` on AVX512-VNNI."""
    ih = w.shape[1]
    quads, corr, scales = q
    key_quads, key_scales = keys
    t0 = b * DOT_LANES
    if _mixes_folded(q, ih):
        rows = slice(s_lo * ih, e * ih)
        got, got_max, maxima, whole = _mix_target(out[:e], mixed, clen[:e], s_lo, t0, block, block_max)
        vnni_mix_tile(quads[rows], corr[rows], scales[rows], w_rows[rows], key_quads[b],
                      key_scales[b], got, got_max, converts, maxima)
        _finish_mixed(mixed, clen[:e], s_lo, t0, out[:e], whole, maxima, block, block_max)
        return
    for r in range(s_lo * ih // DOT_ROWS * DOT_ROWS, e * ih, DOT_ROWS):
        int8_dot_into(quads[r:r + DOT_ROWS], corr[r:r + DOT_ROWS], scales[r:r + DOT_ROWS],
                      key_quads[b], key_scales[b], d[r:r + DOT_ROWS])
    _mix_dots(d, w[:e], clen[:e], t0, s_lo, out[:e], block, block_max, True)


@njit
def _seen_whole(clen, width, lo, hi, need, block):
    """The end of the key blocks from ``lo`` (up to ``hi``) that every query sees whole and
    needs, for a mixing kernel to score straight into the score rows: ``lo`` where ``need``
    lists a consumer's blocks, or where maxima of ``block`` keys are asked that the kernel does
    not take (only ``MAX_BLOCK``'s)."""
    if need.shape[1] or (block != 0 and block != MAX_BLOCK):
        return lo
    return max(lo, min(hi, min(clen.min(), width) // DOT_LANES))


@njit
def _whole_target(out, block_max, b, maxima):
    """Where a mixing kernel writes key block ``b``'s scores, seen whole by every query: its
    columns of the score rows, and (with ``maxima``) of the block maxima."""
    per = DOT_LANES // MAX_BLOCK if maxima else 0
    return out[:, b * DOT_LANES:(b + 1) * DOT_LANES], block_max[:, b * per:(b + 1) * per]


@njit
def _vnni_whole(q, keys, w_rows, lo, hi, converts, out, maxima, block_max):
    """Key blocks ``lo .. hi - 1``, each seen whole by every query, on VNNI's folded rows: a
    :func:`~ds41numba.numerics.vnni_mix_tile` call a block straight into the score rows (and,
    with ``maxima``, the blocks' maxima), none of :func:`_vnni_run`'s bookkeeping of partly
    seen blocks (a quarter of a decode step's scores at 65,536 keys, measured)."""
    for b in range(lo, hi):
        got, got_max = _whole_target(out, block_max, b, maxima)
        vnni_mix_tile(q[0], q[1], q[2], w_rows, keys[0][b], keys[1][b], got, got_max, converts,
                      maxima)


@njit(nogil=True)
def _vnni_blocks(q, keys, w, clen, lo, hi, converts, out, block, block_max, need, d, mixed):
    """Key blocks ``lo .. hi - 1`` of :func:`_vnni_kernel`'s scores (``d`` and ``mixed`` the
    caller's buffers)."""
    T, ih = w.shape
    w_rows = w.reshape((T * ih, 1))
    if _mixes_folded(q, ih):
        whole = _seen_whole(clen, out.shape[1], lo, hi, need, block)
        _vnni_whole(q, keys, w_rows, lo, whole, converts, out, block == MAX_BLOCK, block_max)
        lo = whole
    for b in range(lo, hi):
        a, e = _next_run(need, b, _first_seeing(clen, T, b * DOT_LANES), T)
        while a < T:
            _vnni_run(q, keys, w, w_rows, clen, b, a, e, d, mixed, converts, out, block,
                      block_max)
            a, e = _next_run(need, b, e, T)


@njit(parallel=True, nogil=True)
def _vnni_kernel(q, keys, w, clen, n_blocks, workers, converts, out, block, block_max, need):
    """The scores on AVX512-VNNI: ``q = (quads, corr, scales)``, ``keys = (quads, scales)``,
    per-block or folded. Folded rows (one correction a row) of whole row tiles a query are
    mixed as they are formed (:func:`~ds41numba.numerics.vnni_mix_tile`), the blocks every
    query sees whole first (:func:`_vnni_whole`) where the kernel takes any maxima asked."""
    for wk in prange(workers):
        d = np.empty((q[0].shape[0], DOT_LANES), np.float32)
        mixed = np.empty((w.shape[0], DOT_LANES), np.float32)
        _vnni_blocks(q, keys, w, clen, wk * n_blocks // workers, (wk + 1) * n_blocks // workers,
                     converts, out, block, block_max, need, d, mixed)


_vnni_kernel_serial = serial_twin(_vnni_kernel)


@njit(parallel=True, nogil=True)
def _vnni_quarters_kernel(q, keys, w, clen, offsets, firsts, group_at, workers, converts, out):
    """A candidate consumer's scores on VNNI's folded rows: each query's quarters (``firsts[
    offsets[s]:offsets[s + 1]]``, :func:`~.candidate_scores.candidate_quarters`) four to a
    :func:`~ds41numba.numerics.vnni_mix_quarters` call (a row's last group repeats its last
    quarter), their visible scores written. The groups of all queries in order (query ``s``'s
    from ``group_at[s]``), a contiguous run of them a worker."""
    T, ih = w.shape
    quads, corr, scales = q
    key_quads, key_scales = keys
    w_rows = w.reshape((T * ih, 1))
    n_groups = group_at[T]
    for wk in prange(workers):
        at = np.empty(4, np.int64)
        mixed = np.empty((1, DOT_LANES), np.float32)
        s = 0
        for g in range(wk * n_groups // workers, (wk + 1) * n_groups // workers):
            while group_at[s + 1] <= g:
                s += 1
            k0 = offsets[s] + 4 * (g - group_at[s])
            n = min(4, offsets[s + 1] - k0)
            for j in range(4):
                at[j] = firsts[k0 + min(j, n - 1)]
            rows = slice(s * ih, (s + 1) * ih)
            vnni_mix_quarters(quads[rows], corr[rows], scales[rows], w_rows[rows], key_quads,
                              key_scales, at, mixed, converts)
            for j in range(n):
                for i in range(min(QUARTER, clen[s] - at[j])):
                    out[s, at[j] + i] = mixed[0, QUARTER * j + i]


_vnni_quarters_kernel_serial = serial_twin(_vnni_quarters_kernel)


def _sparse_quarters(need):
    """The quarters ``need`` (:class:`~.candidate_scores.NeededKeys`) asks of each query, as
    ``(offsets, firsts, group_at)`` for :func:`_vnni_quarters_kernel`, or None where whole key
    blocks cost less: a group of four quarters costs about what a query's key block does, and a
    key block shared by a run of queries less (measured: every block a candidate, 128 queries,
    quarters 5-10% slower; 2,048 random blocks of 8 at 65,536 positions or more, 2.3-2.7x
    faster)."""
    offsets, firsts, _ = need.spans
    group_at = np.zeros(len(offsets), np.int64)
    np.cumsum((np.diff(offsets) + 3) // 4, out=group_at[1:])
    if group_at[-1] >= np.count_nonzero(need.key_blocks):
        return None
    return offsets, firsts, group_at


def _quarter_scores(q, keys, w, clen, quarters, converts, out):
    """:func:`_vnni_quarters_kernel` on :func:`_sparse_quarters`' groups."""
    offsets, firsts, group_at = quarters
    n_groups = int(group_at[-1])
    sized_call(_vnni_quarters_kernel, n_groups, q[0].shape[1] * w.shape[1] * DOT_LANES, q, keys, w,
               clen, offsets, firsts, group_at, min(numba.get_num_threads(), n_groups), converts, out)


@njit
def _amx_run(q, keys, w, w_rows, clen, b, s_lo, e, d, mixed, converts, out, block, block_max):
    """Key block ``b``'s scores of the queries ``s_lo .. e`` on AMX (the thread holds the tile
    state)."""
    ih = w.shape[1]
    quads, scales = q
    key_quads, key_scales = keys
    t0 = b * DOT_LANES
    if ih % AMX_ROWS:
        first = s_lo * ih // AMX_ROWS * AMX_ROWS
        d[first:] = 0
        for r in range(first, e * ih, AMX_ROWS):
            amx_dot_tile(quads[r:r + AMX_ROWS], scales[r:r + AMX_ROWS], key_quads[b],
                         key_scales[b], d[r:r + AMX_ROWS])
        _mix_dots(d, w[:e], clen[:e], t0, s_lo, out[:e], block, block_max, True)
        return
    rows = slice(s_lo * ih, e * ih)
    got, got_max, maxima, whole = _mix_target(out[:e], mixed, clen[:e], s_lo, t0, block, block_max)
    amx_mix_tile(quads[rows], scales[rows], w_rows[rows], key_quads[b], key_scales[b],
                 got, got_max, converts, maxima)
    _finish_mixed(mixed, clen[:e], s_lo, t0, out[:e], whole, maxima, block, block_max)


@njit
def _pairs_run(q, keys, w, w_rows, clen, b, s_lo, e, d, mixed, out, block, block_max):
    """Key block ``b``'s scores of the queries ``s_lo .. e`` on AVX2: mixed as they are formed
    (:func:`~ds41numba.numerics.pairs_mix_tile`) where a query is whole row tiles."""
    ih = w.shape[1]
    quads, corr, scales = q
    key_quads, key_scales = keys
    t0 = b * DOT_LANES
    if ih % DOT_ROWS == 0:
        rows = slice(s_lo * ih, e * ih)
        got, got_max, maxima, whole = _mix_target(out[:e], mixed, clen[:e], s_lo, t0, block, block_max)
        pairs_mix_tile(quads[rows], corr[rows], scales[rows], w_rows[rows], key_quads[b],
                       key_scales[b], got, got_max, maxima)
        _finish_mixed(mixed, clen[:e], s_lo, t0, out[:e], whole, maxima, block, block_max)
        return
    for r in range(s_lo * ih // DOT_ROWS * DOT_ROWS, e * ih, DOT_ROWS):
        int8_pairs_into(quads[r:r + DOT_ROWS], corr[r:r + DOT_ROWS], scales[r:r + DOT_ROWS],
                        key_quads[b], key_scales[b], d[r:r + DOT_ROWS])
    _mix_dots(d, w[:e], clen[:e], t0, s_lo, out[:e], block, block_max, True)


@njit
def _pairs_whole(q, keys, w_rows, lo, hi, out, maxima, block_max):
    """:func:`_vnni_whole` on AVX2: a :func:`~ds41numba.numerics.pairs_mix_tile` call a block."""
    for b in range(lo, hi):
        got, got_max = _whole_target(out, block_max, b, maxima)
        pairs_mix_tile(q[0], q[1], q[2], w_rows, keys[0][b], keys[1][b], got, got_max, maxima)


@njit(nogil=True)
def _pairs_blocks(q, keys, w, clen, lo, hi, out, block, block_max, need, d, mixed):
    """Key blocks ``lo .. hi - 1`` of :func:`_pairs_kernel`'s scores (``d`` and ``mixed`` the
    caller's buffers)."""
    T, ih = w.shape
    w_rows = w.reshape((T * ih, 1))
    if ih % DOT_ROWS == 0:
        whole = _seen_whole(clen, out.shape[1], lo, hi, need, block)
        _pairs_whole(q, keys, w_rows, lo, whole, out, block == MAX_BLOCK, block_max)
        lo = whole
    for b in range(lo, hi):
        a, e = _next_run(need, b, _first_seeing(clen, T, b * DOT_LANES), T)
        while a < T:
            _pairs_run(q, keys, w, w_rows, clen, b, a, e, d, mixed, out, block, block_max)
            a, e = _next_run(need, b, e, T)


@njit(parallel=True, nogil=True)
def _pairs_kernel(q, keys, w, clen, n_blocks, workers, converts, out, block, block_max, need):
    """The scores on AVX2: the per-block layout of :func:`_vnni_kernel`, ``q = (quads, corr,
    scales)``, ``keys = (quads, scales)``, through :func:`~ds41numba.numerics.int8_pairs_into`."""
    for wk in prange(workers):
        d = np.empty((q[0].shape[0], DOT_LANES), np.float32)
        mixed = np.empty((w.shape[0], DOT_LANES), np.float32)
        _pairs_blocks(q, keys, w, clen, wk * n_blocks // workers, (wk + 1) * n_blocks // workers,
                      out, block, block_max, need, d, mixed)


_pairs_kernel_serial = serial_twin(_pairs_kernel)


@njit(parallel=True, nogil=True)
def _amx_kernel(q, keys, w, clen, n_blocks, workers, converts, out, block, block_max, need):
    """The scores on AMX: ``q = (quads, scales)``, ``keys = (quads, scales)``, both folded.
    Queries of whole row tiles are mixed as they are formed
    (:func:`~ds41numba.numerics.amx_mix_tile`); each worker holds the tile state throughout."""
    T, ih = w.shape
    w_rows = w.reshape((T * ih, 1))
    for wk in prange(workers):
        d = np.empty((q[0].shape[0], DOT_LANES), np.float32)
        mixed = np.empty((T, DOT_LANES), np.float32)
        amx_begin()
        for b in range(wk * n_blocks // workers, (wk + 1) * n_blocks // workers):
            a, e = _next_run(need, b, _first_seeing(clen, T, b * DOT_LANES), T)
            while a < T:
                _amx_run(q, keys, w, w_rows, clen, b, a, e, d, mixed, converts, out, block,
                         block_max)
                a, e = _next_run(need, b, e, T)
        amx_end()


_amx_kernel_serial = serial_twin(_amx_kernel)


#: The packed layouts, each with the kernel that scores it.
LAYOUTS = {"bf16": _bf16_kernel, "int8": _vnni_kernel, "vnni_folded": _vnni_kernel,
           "amx": _amx_kernel, "int8_pairs": _pairs_kernel}


@njit
def _claimed_run(counter, n_blocks):
    """The next run of ``SHARED_BLOCKS`` key blocks, ``[lo, hi)``, claimed on ``counter``
    (empty when none is left)."""
    lo = min(n_blocks, claim_next(counter) * SHARED_BLOCKS)
    return lo, min(n_blocks, lo + SHARED_BLOCKS)


@njit(nogil=True)
def _vnni_claimed(q, keys, w, clen, n_blocks, converts, out, block, block_max, need, counter):
    """:func:`_vnni_kernel`'s key blocks a run at a time (:func:`_claimed_run`), each run by the
    thread that claims it: calls on two threads share them
    (:func:`~ds41numba.numerics.share_with_helper`)."""
    d = np.empty((q[0].shape[0], DOT_LANES), np.float32)
    mixed = np.empty((w.shape[0], DOT_LANES), np.float32)
    lo, hi = _claimed_run(counter, n_blocks)
    while lo < hi:
        _vnni_blocks(q, keys, w, clen, lo, hi, converts, out, block, block_max, need, d, mixed)
        lo, hi = _claimed_run(counter, n_blocks)


@njit(nogil=True)
def _pairs_claimed(q, keys, w, clen, n_blocks, converts, out, block, block_max, need, counter):
    """:func:`_vnni_claimed` on AVX2 (:func:`_pairs_kernel`'s blocks): a kernel of its own, as
    VNNI's instructions do not compile for a CPU without them."""
    d = np.empty((q[0].shape[0], DOT_LANES), np.float32)
    mixed = np.empty((w.shape[0], DOT_LANES), np.float32)
    lo, hi = _claimed_run(counter, n_blocks)
    while lo < hi:
        _pairs_blocks(q, keys, w, clen, lo, hi, out, block, block_max, need, d, mixed)
        lo, hi = _claimed_run(counter, n_blocks)


#: The layouts whose scores a decode step shares with the helper thread, each with its kernel.
_SHARED = {"int8": _vnni_claimed, "vnni_folded": _vnni_claimed, "int8_pairs": _pairs_claimed}

# The kernel's block maxima buffer when none are asked for (one type for every call).
_NO_MAXIMA = np.empty((1, 1), np.float32)


def tile_scores_packed(layout: str, q: tuple, keys: tuple, w: np.ndarray, clen: np.ndarray,
                       width: int, out: np.ndarray | None = None, dirty_to: int | None = None,
                       converts: bool = False, maxima: tuple | None = None,
                       need: NeededKeys | None = None) -> np.ndarray:
    """A tile's scores ``[T, width]`` after the visibility mask, from queries and keys packed
    in ``layout`` (a key of :data:`LAYOUTS`); ``converts``: AMX's and VNNI's mixers may round on
    the CPU's conversion (:func:`~ds41numba.numerics.converted_mix_exact`). With ``maxima =
    (block, block_max)`` also the rows' block maxima (:meth:`.IndexKeyCache.scores`): taken by
    the kernel while each key block is in cache where ``block`` divides DOT_LANES, else by a
    pass over the scores after them. ``need`` (:class:`~.candidate_scores.NeededKeys`, its key
    blocks at least ``ceil(max clen / DOT_LANES)`` a row): a candidate consumer's; only the
    scores of the key blocks holding a candidate are formed (VNNI's folded kernel, without
    maxima, where the candidates are sparse: only the quarters holding one), the other
    positions below ``clen`` left as they were (the caller writes them)."""
    T = w.shape[0]
    block, block_max = maxima if maxima is not None and DOT_LANES % maxima[0] == 0 else (0, _NO_MAXIMA)
    out = masked_buffer(out, (T, width), clen, dirty_to, "tile_scores_packed")
    n_vis = int(clen.max(initial=0))
    if keys[0].shape[0] * DOT_LANES < n_vis:
        raise ValueError(f"tile_scores_packed: packed keys {keys[0].shape} do not cover {n_vis} "
                         "positions")
    w = np.ascontiguousarray(w, np.float32)
    if n_vis:
        n_blocks = -(-n_vis // DOT_LANES)
        blocks = EVERY_KEY_BLOCK if need is None else need.key_blocks
        if need is not None and (blocks.dtype != np.uint8 or blocks.shape[0] != T
                                 or blocks.shape[1] < n_blocks):
            raise ValueError(f"tile_scores_packed: need's key blocks must be uint8 [{T}, >= "
                             f"{n_blocks}], got {blocks.dtype} {blocks.shape}")
        quarters = (_sparse_quarters(need) if need is not None and layout == "vnni_folded"
                    and not block and w.shape[1] % AMX_ROWS == 0 else None)
        if quarters is not None:
            _quarter_scores(q, keys, w, clen, quarters, converts, out)
        elif layout in _SHARED and in_beside_block() and n_blocks > SHARED_BLOCKS:
            # A decode step's scores beside its weight reading: the helper thread joins them
            # when its reading is done (at long context they outlast it).
            share_with_helper(_SHARED[layout], q, keys, w, clen, n_blocks, converts, out, block,
                              block_max, blocks, np.zeros(1, np.int64))
        else:
            # A key block's multiply-adds: every query row's packed words times the lanes (a
            # word's 2 or 4 products counted as one).
            sized_call(LAYOUTS[layout], n_blocks, q[0].size * DOT_LANES, q, keys, w, clen, n_blocks,
                       min(numba.get_num_threads(), n_blocks), converts, out, block, block_max,
                       blocks)
    if maxima is not None and not block:
        visible_block_maxima(out, clen, *maxima)
    return out

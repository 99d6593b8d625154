"""The lightning indexer: which compressed positions each query attends to.

Scoring every compressed position with full attention would cost as much as dense attention,
so V4.1 first scores them cheaply: a few small fp4-quantised index heads, ReLU'd dot products
against fp4 index keys, mixed by per-token head weights. Each query keeps the ``index_topk``
best positions, chosen exactly as torch's CPU ``topk`` chooses them (ties included). The
*candidate source* also publishes, per query, the best blocks of positions; later index sources
(candidate consumers) may only pick inside those blocks.

The scores are computed a tile of queries at a time, so a prefill never holds a
``[seqlen, positions]`` tensor unless the caller asks to capture it. Their dot products are of
fp4 values, exact in f32 whatever the summation order (unless a row's block scales lie ~2^10
apart), so they run wherever they run fastest: as integer dot products on AMX or AVX512-VNNI,
or on AVX512-BF16, against a packed copy of the keys (:class:`IndexKeyCache`), else through
numpy's f32 BLAS; all give the same scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from ml_dtypes import bfloat16 as BF16
from numba import njit, prange
from numba.extending import overload

from .numerics import (AMX_K, AMX_ROWS, DOT_LANES, DOT_ROWS, EMPTY_RANGE, INT8_GROUP, MAX_BLOCK,
                       aligned_empty, amx_begin, amx_dot_tile, amx_enabled, amx_end, amx_mix_tile,
                       bf16_dot_enabled, bf16_dot_tile, bf16_pairs, bf16_scalar, converted_mix_exact,
                       FOLDED_KEY_OFFSET, empty_folded_blocks, foldable, folded_corrections,
                       folded_rows, fp4_quant_e8m0_inplace, pack_offset_folded_blocks,
                       in_workers, int8_blocks_shape, int8_dot_enabled, int8_dot_exact,
                       int8_dot_into, int8_rows, linear_bf16, merge_ranges, nan_max, output_buffer,
                       pack_bf16_pairs, pack_folded_blocks, pack_int8_blocks, rms_norm,
                       split_range, to_bf16_rne, vnni_mix_tile, worth_parallel)
from .batch import SINGLE, BatchRow, checked_batch
from .rope import apply_rotary
from .topk import partial_sort_set_hinted, topk_set_into

__all__ = ["IndexerWeights", "IndexerCfg", "IndexKeyCache", "indexer", "index_keys",
           "select_candidate_blocks", "candidate_mask", "visible_lengths"]

# Elements of one tile's [tile, positions] scores: 64 MB of f32, whatever the sequence length.
_TILE_ELEMS = 1 << 24
# Queries of one tile at most: enough query heads for the packed kernels' rows of DOT_ROWS.
_TILE_MAX = 256
# Elements of one worker's [chunk, tile * heads] dot products: 4 MB of f32, mixed while in cache.
_SCORE_CHUNK_ELEMS = 1 << 20
# Rows of the indexer's query projection run as one product.
_PROJ_ROWS = 1024


@dataclass
class IndexerWeights:
    """``wq_b [ih*id, q_lora]``, ``weights_proj [ih, dim]``; key owners add ``wk [id, hd]`` and
    ``k_norm [id]``. All bf16 values."""

    wq_b: np.ndarray
    weights_proj: np.ndarray
    wk: np.ndarray | None = None
    k_norm: np.ndarray | None = None


@dataclass(frozen=True)
class IndexerCfg:
    """What one index source needs to know about its place in the stack."""

    n_heads: int
    head_dim: int
    topk: int
    ratio: int
    norm_eps: float
    candidate_source: bool = False
    use_candidates: bool = False
    candidate_topk_blocks: int = 1
    candidate_block_size: int = 1

    @classmethod
    def for_layer(cls, config, layer_id: int) -> "IndexerCfg":
        return cls(n_heads=config.index_n_heads, head_dim=config.index_head_dim,
                   topk=config.index_topk, ratio=config.ratio(layer_id), norm_eps=config.norm_eps,
                   candidate_source=config.is_candidate_source(layer_id),
                   use_candidates=config.uses_candidates(layer_id),
                   candidate_topk_blocks=config.candidate_topk_blocks,
                   candidate_block_size=config.candidate_block_size)


def visible_lengths(start_pos: int, seqlen: int, ratio: int, prefill: bool | None = None) -> np.ndarray:
    """Compressed positions each query may see: ``(s + 1) // r`` at prefill (s the query's
    position; ``prefill``, default ``start_pos == 0``, for a chunk of one), all at decode."""
    if start_pos == 0 if prefill is None else prefill:
        return (np.arange(start_pos + 1, start_pos + seqlen + 1, dtype=np.int64)) // ratio
    return np.full(seqlen, (start_pos + seqlen) // ratio, dtype=np.int64)


def index_keys(latents: np.ndarray, positions: np.ndarray, weights: IndexerWeights, table,
               norm_eps: float, ref_rows: int | None = None) -> np.ndarray:
    """Index keys of new latents (pre-RoPE): projected, normed, rotated, fp4 (e8m0) quantised.
    ``ref_rows``: the latents of the reference's call (a chunked prefill's whole), as in
    :func:`~ds41numba.numerics.linear_bf16`."""
    k = rms_norm(linear_bf16(latents, weights.wk, ref_rows=ref_rows), weights.k_norm, norm_eps)
    k = apply_rotary(k, positions, table, inplace=True)
    return fp4_quant_e8m0_inplace(k)


def _tile_rows(width: int) -> int:
    """Queries scored as one tile against ``width`` positions: as many as keep the tile's
    ``[tile, width]`` f32 scores within ``_TILE_ELEMS`` (at least one), at most ``_TILE_MAX``."""
    return max(1, min(_TILE_MAX, _TILE_ELEMS // max(width, 1)))


# Positions whose head mixing runs as one batch: enough independent sums to hide the add latency.
_MIX_GROUP = 8
# From this many query heads on (a prefill tile) the dot products are formed head-major.
_HEAD_MAJOR_MIN = 1024


@njit(cache=True)
def _relu_weighted(d, w):
    """``bf16(relu(bf16(d)) * w)``; a NaN passes relu, as torch's does."""
    v = bf16_scalar(d)
    if v < 0:
        v = np.float32(0.0)
    return bf16_scalar(v * w)


@njit(nogil=True, cache=True)
def _mix_heads(d, w, clen, t0, out):
    """``out[s, t0 + t] = bf16(sum_h bf16(relu(bf16(d[t, s * ih + h])) * w[s, h]))`` for visible t.

    ``d`` holds a chunk's dot products position-major (``[chunk, T * ih]``, a few queries). The
    head sum accumulates in f32 in head order, as torch sums a bf16 tensor over a non-innermost
    dimension; positions at or past ``clen[s]`` are left as they are (-inf). The products of a
    group of positions are formed first (they vectorise), then the group's sums run side by side.
    Runs without the GIL, in a worker thread.
    """
    T, ih = w.shape
    n = d.shape[0]
    vals = np.empty((_MIX_GROUP, ih), np.float32)
    acc = np.empty(_MIX_GROUP, np.float32)
    for a in range(0, n, _MIX_GROUP):
        g = min(n, a + _MIX_GROUP) - a
        for s in range(T):
            if t0 + a >= clen[s]:
                continue
            ws = w[s]
            for j in range(g):
                dj = d[a + j, s * ih:(s + 1) * ih]
                vj = vals[j]
                for h in range(ih):
                    vj[h] = _relu_weighted(dj[h], ws[h])
            acc[:] = 0
            for h in range(ih):
                for j in range(g):
                    acc[j] += vals[j, h]
            o = out[s, t0 + a:min(t0 + a + g, clen[s])]
            for j in range(o.shape[0]):
                o[j] = bf16_scalar(acc[j])


@njit(nogil=True, cache=True)
def _mix_heads_by_head(d, w, clen, t0, out):
    """:func:`_mix_heads` for dot products held head-major (``[T * ih, chunk]``, many queries):
    each head's row adds into the positions' sums at once, still in head order."""
    T, ih = w.shape
    acc = np.empty(d.shape[1], np.float32)
    for s in range(T):
        m = min(d.shape[1], clen[s] - t0)
        if m <= 0:
            continue
        a = acc[:m]
        a[:] = 0
        for h in range(ih):
            row = d[s * ih + h, :m]
            wh = w[s, h]
            for j in range(m):
                a[j] += _relu_weighted(row[j], wh)
        o = out[s, t0:t0 + m]
        for j in range(m):
            o[j] = bf16_scalar(a[j])


@njit(parallel=True, cache=True)
def _mask_kernel(out, clen, upto):
    for s in prange(out.shape[0]):
        out[s, min(max(clen[s], 0), upto):upto] = -np.inf


def _masked_buffer(out, shape, clen, dirty_to, name):
    """``out`` (or a new buffer) of ``shape`` with every row -inf from its ``clen`` on.

    The kernels write only the positions a row sees. ``dirty_to`` says the columns from there
    on already hold -inf in every row (a buffer reused tile after tile, whose queries see more
    and more positions): only the columns before it are masked, not the whole row, which in a
    long chunked prefill is the whole prefill wide while a query sees the positions before it.
    """
    fresh = out is None
    out = output_buffer(out, shape, name)
    upto = shape[1] if fresh or dirty_to is None else min(int(dirty_to), shape[1])
    _mask_kernel(out, np.ascontiguousarray(clen, np.int64), upto)
    return out


def _tile_scores(iq: np.ndarray, w: np.ndarray, keys: np.ndarray, clen: np.ndarray,
                 width: int, out: np.ndarray | None = None, dirty_to: int | None = None) -> np.ndarray:
    """Scores ``[T, width]`` of a tile of queries after the visibility mask (into ``out``, a
    float32 buffer of that shape, when given).

    The visible positions are split across the workers; each runs its range a chunk at a time,
    the chunk's dot products through BLAS and then their head mixing, while the chunk is still
    in cache. A tile of many queries forms them head-major (``iq @ keys^T``: the many query
    heads make the long side of the product, and each head's row of positions mixes as one
    vector); a decode step's few heads position-major (``keys @ iq^T``, faster for that shape).
    """
    T, ih, idim = iq.shape
    out = _masked_buffer(out, (T, width), clen, dirty_to, "_tile_scores")
    n_vis = int(clen.max(initial=0))
    flat = iq.reshape(T * ih, idim)
    chunk = max(_MIX_GROUP, _SCORE_CHUNK_ELEMS // (T * ih))
    head_major = T * ih >= _HEAD_MAJOR_MIN

    def score_range(lo, hi):
        buf = np.empty(min(chunk, hi - lo) * T * ih, np.float32)
        for a in range(lo, hi, chunk):
            b = min(hi, a + chunk)
            if head_major:
                d = buf[:T * ih * (b - a)].reshape(T * ih, b - a)
                np.matmul(flat, keys[a:b].T, out=d)
                _mix_heads_by_head(d, w, clen, a, out)
            else:
                d = buf[:(b - a) * T * ih].reshape(b - a, T * ih)
                np.matmul(keys[a:b], flat.T, out=d)
                _mix_heads(d, w, clen, a, out)

    # Handing work to the worker threads costs a few hundred microseconds: a short decode
    # step's scores (a few MFLOP) run in the calling thread.
    workers = numba.get_num_threads() if worth_parallel(T * n_vis * ih * idim, pool=True) else 1
    in_workers(score_range, split_range(n_vis, workers))
    return out


def _key_block_dots(q, keys, b, first, rows, d):
    """``d[r] = 0 + q[r] . keys[b]`` for the query rows ``first .. rows`` (in steps of
    :func:`_row_step`) against key block ``b``, on the kernel the operands were packed for:
    ``q``, ``keys`` are ``(pairs,)``, ``(blocks,)`` for AVX512-BF16; ``(quads, corr, scales)``,
    ``(quads, scales)`` for AVX512-VNNI (a scale a 32-value block, or folded: one a row, see
    :func:`_query_offset_folded`); ``(quads, scales)`` and ``(quads, scales)``, both
    folded (:func:`~ds41numba.numerics.folded_rows`), for AMX. ``first`` is a multiple of the
    row step."""


def _row_step(q):
    """Query rows one micro-kernel call of :func:`_key_block_dots` takes."""


def _tile_state(q, begin):
    """Load (``begin``) or release this thread's AMX tile state when ``q`` is AMX's operand."""


@overload(_row_step)
def _row_step_impl(q):
    step = AMX_ROWS if len(q.types) == 2 else DOT_ROWS
    return lambda q: step


@overload(_tile_state)
def _tile_state_impl(q, begin):
    if len(q.types) != 2:
        return lambda q, begin: None

    def amx_state(q, begin):
        if begin:
            amx_begin()
        else:
            amx_end()
    return amx_state


def _mixed_on_tiles(q, ih):
    """Whether a block's scores come mixed out of the tile kernel (:func:`_mixed_block`): AMX's
    operands, and each query's heads a whole number of its row tiles."""


def _mixed_block(q, keys, w_rows, clen, b, s_lo, mixed, out, converts, block, block_max):
    """The scores of key block ``b`` for the queries ``s_lo ..`` (see :func:`_tile_scores`) from
    :func:`~ds41numba.numerics.amx_mix_tile`, into ``out`` where visible; ``w_rows`` the head
    weights one a row (``[T * ih, 1]``), ``mixed`` room for ``[T, DOT_LANES]``, ``converts``
    as for that kernel. True where the kernel also wrote the block maxima (``block`` is its
    ``MAX_BLOCK`` and every query sees the whole key block; :func:`_scores_packed_kernel`)."""


@overload(_mixed_on_tiles)
def _mixed_on_tiles_impl(q, ih):
    if len(q.types) == 2:
        return lambda q, ih: ih % AMX_ROWS == 0
    if len(q.types) == 3:       # VNNI: folded rows only (one correction a row)
        return lambda q, ih: ih % AMX_ROWS == 0 and q[1].shape[1] == 1
    return lambda q, ih: False


def _mix_tile(q, rows, w, keys, b, out, block_max, converts, maxima):
    """The mixing tile kernel for ``q``'s layout: :func:`~ds41numba.numerics.amx_mix_tile` (AMX),
    :func:`~ds41numba.numerics.vnni_mix_tile` (folded rows on VNNI)."""


@overload(_mix_tile)
def _mix_tile_impl(q, rows, w, keys, b, out, block_max, converts, maxima):
    if len(q.types) == 2:
        def amx(q, rows, w, keys, b, out, block_max, converts, maxima):
            amx_mix_tile(q[0][rows], q[1][rows], w[rows], keys[0][b], keys[1][b], out, block_max,
                         converts, maxima)
        return amx

    def vnni(q, rows, w, keys, b, out, block_max, converts, maxima):
        vnni_mix_tile(q[0][rows], q[1][rows], q[2][rows], w[rows], keys[0][b], keys[1][b], out,
                      block_max, converts, maxima)
    return vnni


@overload(_mixed_block)
def _mixed_block_impl(q, keys, w_rows, clen, b, s_lo, mixed, out, converts, block, block_max):
    if len(q.types) not in (2, 3):
        return lambda q, keys, w_rows, clen, b, s_lo, mixed, out, converts, block, block_max: False

    def tile_mixed(q, keys, w_rows, clen, b, s_lo, mixed, out, converts, block, block_max):
        T = out.shape[0]
        ih = w_rows.shape[0] // T
        rows = slice(s_lo * ih, T * ih)
        t0 = b * DOT_LANES
        whole = t0 + DOT_LANES <= out.shape[1]
        for s in range(s_lo, T):
            whole = whole and clen[s] >= t0 + DOT_LANES
        if whole:
            # Every query sees the whole key block: its scores straight into the score rows,
            # and the candidate blocks' maxima from the kernel's registers.
            maxima = block == MAX_BLOCK
            j = t0 // MAX_BLOCK if maxima else 0
            # This key block's columns of block_max (a placeholder, unwritten, unless maxima).
            bm = block_max[s_lo:T, j:j + DOT_LANES // MAX_BLOCK]
            _mix_tile(q, rows, w_rows, keys, b, out[s_lo:T, t0:t0 + DOT_LANES], bm, converts, maxima)
            return maxima
        _mix_tile(q, rows, w_rows, keys, b, mixed[:T - s_lo], block_max, converts, False)
        for s in range(s_lo, T):
            for j in range(min(DOT_LANES, clen[s] - t0)):
                out[s, t0 + j] = mixed[s - s_lo, j]
        return False
    return tile_mixed


@overload(_key_block_dots)
def _key_block_dots_impl(q, keys, b, first, rows, d):
    if len(q.types) == 2:
        def amx_dots(q, keys, b, first, rows, d):
            d[first:] = 0
            for r in range(first, rows, AMX_ROWS):
                amx_dot_tile(q[0][r:r + AMX_ROWS], q[1][r:r + AMX_ROWS], keys[0][b], keys[1][b],
                             d[r:r + AMX_ROWS])
        return amx_dots
    if len(q.types) == 1:
        def bf16_dots(q, keys, b, first, rows, d):
            d[first:] = 0
            for r in range(first, rows, DOT_ROWS):
                bf16_dot_tile(q[0][r:r + DOT_ROWS], keys[0][b], d[r:r + DOT_ROWS])
        return bf16_dots

    def int8_dots(q, keys, b, first, rows, d):
        for r in range(first, rows, DOT_ROWS):
            int8_dot_into(q[0][r:r + DOT_ROWS], q[1][r:r + DOT_ROWS], q[2][r:r + DOT_ROWS],
                          keys[0][b], keys[1][b], d[r:r + DOT_ROWS])
    return int8_dots


@njit(cache=True)
def _row_block_maxima(row, n, block, out):
    """``out[b]``: the max (NaN wins) of ``row[b * block : (b + 1) * block]`` within its first
    ``n`` values, for every block holding one of them."""
    for b in range(-(-n // block)):
        best = np.float32(-np.inf)
        for t in range(b * block, min(n, (b + 1) * block)):
            best = nan_max(best, row[t])
        out[b] = best


@njit(cache=True)
def _key_block_maxima(out, clen, t0, s_lo, block, block_max):
    """Rows ``s_lo ..`` of ``block_max``: the maxima of the blocks of ``block`` positions (a
    divisor of DOT_LANES) in the key block at ``t0``, over the positions each row sees (NaN
    wins), taken while the block's scores are still in cache."""
    for s in range(s_lo, out.shape[0]):
        n = min(DOT_LANES, clen[s] - t0)
        _row_block_maxima(out[s, t0:t0 + n], n, block, block_max[s, t0 // block:])


@njit(parallel=True, cache=True)
def _scores_packed_kernel(q, keys, w, clen, n_blocks, workers, converts, out, block, block_max):
    """:func:`_tile_scores` with the dot products on a packed kernel (:func:`_key_block_dots`).

    ``q`` holds the tile's query heads (query-major, zero rows padding to a multiple of
    DOT_ROWS), ``keys`` the packed key blocks. Each worker takes a contiguous run of key blocks;
    for each block it forms the dot products of the queries that see any of it (a suffix of the
    tile when ``clen`` grows with the query, as it does) and mixes them while they are in cache.
    Every score is formed whole by one worker, in a fixed order, so the result does not depend
    on the thread count. ``converts``: the AMX kernel's mixing may round on the CPU's conversion
    (:func:`~ds41numba.numerics.converted_mix_exact`). With ``block`` > 0 each row's maxima of
    its visible blocks of that many positions go into ``block_max`` (:func:`_key_block_maxima`).
    """
    T, ih = w.shape
    step = _row_step(q)
    mixed_on_tiles = _mixed_on_tiles(q, ih)
    w_rows = w.reshape((T * ih, 1))
    for wk in prange(workers):
        d = np.empty((q[0].shape[0], DOT_LANES), np.float32)
        mixed = np.empty((T, DOT_LANES), np.float32)
        _tile_state(q, True)
        for b in range(wk * n_blocks // workers, (wk + 1) * n_blocks // workers):
            t0 = b * DOT_LANES
            s_lo = 0
            while s_lo < T and clen[s_lo] <= t0:
                s_lo += 1
            if s_lo == T:
                continue
            took = False
            if mixed_on_tiles:
                took = _mixed_block(q, keys, w_rows, clen, b, s_lo, mixed, out, converts, block,
                                    block_max)
            else:
                _key_block_dots(q, keys, b, s_lo * ih // step * step, T * ih, d)
                _mix_heads_by_head(d[s_lo * ih:T * ih], w[s_lo:], clen[s_lo:], t0, out[s_lo:])
            if block and not took:
                _key_block_maxima(out, clen, t0, s_lo, block, block_max)
        _tile_state(q, False)


def _query_rows(T: int, ih: int) -> int:
    """A tile's query heads, padded for every kernel's row step (DOT_ROWS divides AMX_ROWS)."""
    return -(-T * ih // AMX_ROWS) * AMX_ROWS


def _query_pairs_size(T: int, ih: int, idim: int) -> int:
    """uint32 elements of a tile's query heads as bf16 pairs (padded rows): also room for their
    int8 layouts (5/16 and 1/4 of a uint32 per value, against 1/2)."""
    return _query_rows(T, ih) * (idim // 2)


def _query_buffer(qbuf, T, ih, idim):
    """``qbuf`` if it holds a tile's query heads, else a fresh buffer that does."""
    size = _query_pairs_size(T, ih, idim)
    return qbuf if qbuf is not None and qbuf.size >= size else aligned_empty(size, np.uint32)


def _query_pairs(iq: np.ndarray, qbuf: np.ndarray) -> tuple:
    """A tile's query heads ``iq [T, ih, id]`` as the bf16 kernel's A operand, in ``qbuf``."""
    T, ih, idim = iq.shape
    qp = qbuf[:_query_pairs_size(T, ih, idim)].reshape(-1, idim // 2)
    bf16_pairs(iq.reshape(T * ih, idim), out=qp[:T * ih])
    qp[T * ih:] = 0
    return (qp,)


def _query_int8(iq: np.ndarray, qbuf: np.ndarray) -> tuple:
    """A tile's query heads ``iq [T, ih, id]`` as the VNNI kernel's A operand, in ``qbuf``:
    ``((quads, corr, scales), range)``, the padding rows zeros of scale 1."""
    T, ih, idim = iq.shape
    rows = _query_rows(T, ih)
    n_quads, n_groups = rows * idim // 4, rows * (idim // INT8_GROUP)
    quads = qbuf[:n_quads].reshape(rows, idim // 4)
    corr = qbuf[n_quads:n_quads + n_groups].view(np.int32).reshape(rows, -1)
    scales = qbuf[n_quads + n_groups:n_quads + 2 * n_groups].view(np.float32).reshape(rows, -1)
    *_, rng = int8_rows(iq.reshape(T * ih, idim), out=(quads, corr, scales))
    quads[T * ih:] = 0
    corr[T * ih:] = 0
    scales[T * ih:] = 1
    return (quads, corr, scales), rng


def _query_offset_folded(iq: np.ndarray, qbuf: np.ndarray) -> tuple:
    """A tile's query heads ``iq [T, ih, id]`` folded as the VNNI kernel's A operand against
    :func:`~ds41numba.numerics.pack_offset_folded_blocks`' keys, in ``qbuf``: ``((quads, corr,
    scales), range)``, :func:`_query_folded`'s operand with each row's correction (``[rows,
    1]``: one group a row) after it in the buffer."""
    T, ih, idim = iq.shape
    rows = _query_rows(T, ih)
    (quads, scales), rng = _query_folded(iq, qbuf)
    corr = qbuf[rows * (idim // 4 + 1):rows * (idim // 4 + 2)].view(np.int32).reshape(rows, 1)
    folded_corrections(quads, out=corr)
    return (quads, corr, scales), rng


def _query_folded(iq: np.ndarray, qbuf: np.ndarray) -> tuple:
    """A tile's query heads ``iq [T, ih, id]`` as the AMX kernel's A operand, in ``qbuf``:
    ``((quads, scales), range)``, the padding rows zeros of scale 1."""
    T, ih, idim = iq.shape
    rows = _query_rows(T, ih)
    quads = qbuf[:rows * idim // 4].reshape(rows, idim // 4)
    scales = qbuf[rows * idim // 4:rows * (idim // 4 + 1)].view(np.float32).reshape(rows, 1)
    *_, rng = folded_rows(iq.reshape(T * ih, idim), out=(quads, scales))
    quads[T * ih:] = 0
    scales[T * ih:] = 1
    return (quads, scales), rng


def _tile_scores_packed(q: tuple, keys: tuple, w: np.ndarray, clen: np.ndarray, width: int,
                        out: np.ndarray | None = None, dirty_to: int | None = None,
                        converts: bool = False, maxima: tuple | None = None) -> np.ndarray:
    """:func:`_tile_scores` from packed queries and keys (either kernel's, see
    :func:`_key_block_dots`; ``converts`` for AMX's, see :func:`_scores_packed_kernel`), and
    with ``maxima = (block, block_max)`` the block maxima (:meth:`IndexKeyCache.scores`)."""
    T = w.shape[0]
    block, block_max = maxima if maxima is not None and DOT_LANES % maxima[0] == 0 else (0, _NO_MAXIMA)
    out = _masked_buffer(out, (T, width), clen, dirty_to, "_tile_scores_packed")
    n_vis = int(clen.max(initial=0))
    if keys[0].shape[0] * DOT_LANES < n_vis:
        raise ValueError(f"_tile_scores_packed: packed keys {keys[0].shape} do not cover {n_vis} "
                         "positions")
    if n_vis:
        n_blocks = -(-n_vis // DOT_LANES)
        _scores_packed_kernel(q, keys, np.ascontiguousarray(w, np.float32), clen, n_blocks,
                              min(numba.get_num_threads(), n_blocks), converts, out, block, block_max)
    if maxima is not None and not block:
        _visible_block_maxima(out, clen, *maxima)
    return out


# The kernel's block maxima buffer when none are asked for (one type for every call).
_NO_MAXIMA = np.empty((1, 1), np.float32)


def _tile_scores_bf16(iq: np.ndarray, w: np.ndarray, keys: np.ndarray, clen: np.ndarray,
                      width: int, out: np.ndarray | None = None,
                      qbuf: np.ndarray | None = None, dirty_to: int | None = None,
                      maxima: tuple | None = None) -> np.ndarray:
    """:func:`_tile_scores` against packed keys (``[blocks, id / 2, DOT_LANES]``); ``qbuf`` a
    reusable uint32 buffer of at least :func:`_query_pairs_size` elements."""
    T, ih, idim = iq.shape
    if keys.shape[1] != idim // 2:
        raise ValueError(f"_tile_scores_bf16: packed keys {keys.shape} are not of {idim} dims")
    q = _query_pairs(iq, _query_buffer(qbuf, T, ih, idim))
    return _tile_scores_packed(q, (keys,), w, clen, width, out=out, dirty_to=dirty_to, maxima=maxima)


def _tile_scores_int8(iq: np.ndarray, w: np.ndarray, keys: tuple, key_range: np.ndarray,
                      clen: np.ndarray, width: int, out: np.ndarray | None = None,
                      qbuf: np.ndarray | None = None,
                      dirty_to: int | None = None, maxima: tuple | None = None) -> np.ndarray | None:
    """:func:`_tile_scores` on AVX512-VNNI against keys packed by
    :func:`~ds41numba.numerics.pack_int8_blocks` (``(quads, scales)`` and their range), or None
    when these queries and keys are not all fp4 values whose dot products are exact in f32
    (:func:`~ds41numba.numerics.int8_dot_exact`): only then is the integer dot product the f32
    value the other kernels give, and the caller runs one of them instead."""
    T, ih, idim = iq.shape
    if keys[0].shape[1] != idim // 4:
        raise ValueError(f"_tile_scores_int8: packed keys {keys[0].shape} are not of {idim} dims")
    q, q_range = _query_int8(iq, _query_buffer(qbuf, T, ih, idim))
    if not int8_dot_exact(q_range, key_range, idim):
        return None
    return _tile_scores_packed(q, keys, w, clen, width, out=out, dirty_to=dirty_to, maxima=maxima)


def _tile_scores_folded(query, name: str, iq: np.ndarray, w: np.ndarray, keys: tuple,
                        key_range: np.ndarray, clen: np.ndarray, width: int,
                        out: np.ndarray | None = None, qbuf: np.ndarray | None = None,
                        dirty_to: int | None = None, maxima: tuple | None = None) -> np.ndarray | None:
    """:func:`_tile_scores_packed` on folded rows, the queries folded by ``query``
    (:func:`_query_folded`, :func:`_query_offset_folded`), or None when the queries or keys do
    not fold or their products are not exact; the mix rounds on the conversion where
    :func:`~ds41numba.numerics.converted_mix_exact` allows (the query scales are the operand's
    last array)."""
    T, ih, idim = iq.shape
    if keys[0].shape[1] != idim // 4:
        raise ValueError(f"{name}: packed keys {keys[0].shape} are not of {idim} dims")
    q, q_range = query(iq, _query_buffer(qbuf, T, ih, idim))
    if not (foldable(q_range, key_range) and int8_dot_exact(q_range, key_range, idim)):
        return None
    converts = converted_mix_exact(q[-1], key_range, w)
    return _tile_scores_packed(q, keys, w, clen, width, out=out, dirty_to=dirty_to, converts=converts,
                               maxima=maxima)


def _tile_scores_offset_folded(iq, w, keys, key_range, clen, width, **kwargs):
    """:func:`_tile_scores_int8` with both sides folded (one scale a row, one integer a dot
    product, mixed as it is formed) against keys packed by
    :func:`~ds41numba.numerics.pack_offset_folded_blocks`, or None where they do not fold or
    are not exact: the caller then runs the per-block layout."""
    return _tile_scores_folded(_query_offset_folded, "_tile_scores_offset_folded", iq, w, keys,
                               key_range, clen, width, **kwargs)


def _tile_scores_amx(iq, w, keys, key_range, clen, width, **kwargs):
    """:func:`_tile_scores_int8` on AMX against keys packed by
    :func:`~ds41numba.numerics.pack_folded_blocks`, or None when the queries or keys do not fold
    (:func:`~ds41numba.numerics.foldable`) or their products are not exact: the caller then
    runs the VNNI kernel (which any foldable rows also pass)."""
    return _tile_scores_folded(_query_folded, "_tile_scores_amx", iq, w, keys, key_range, clen,
                               width, **kwargs)


def _int8_scored(head_dim: int) -> bool:
    """Index scores of this head size run on AVX512-VNNI: the tier is on, and the heads split
    into the fp4 quantiser's blocks (which any quantised head does)."""
    return int8_dot_enabled() and head_dim % INT8_GROUP == 0


def _amx_scored(head_dim: int) -> bool:
    """... and first on AMX: that tier is on, and the heads split into its tile products."""
    return amx_enabled() and head_dim % AMX_K == 0


def _vnni_folded(head_dim: int) -> bool:
    """... and first on folded rows: the VNNI tier (not AMX), heads as long as AMX's."""
    return _int8_scored(head_dim) and not amx_enabled() and head_dim % AMX_K == 0


class IndexKeyCache:
    """The index keys a key owner writes and every index source scores against.

    ``keys`` holds the rows (f32 ``[capacity, id]``, bf16 values: the fp4-quantised keys). When
    the products run on a packed kernel (:func:`~ds41numba.numerics.backend`) the cache keeps
    the same rows a second time in the layout that kernel reads, written together with them: a
    decode step scores every key, and repacking them all each step would cost more than scoring
    them (15 ms at 65,536 keys). On AMX that is ``folded`` (``(quads, scales)``, see
    :func:`~ds41numba.numerics.pack_folded_blocks`, with ``folded_range``, what decides whether
    they fold); on AVX512-VNNI ``vfolded`` (``(quads, scales)`` folded for ``vpdpbusd``, see
    :func:`~ds41numba.numerics.pack_offset_folded_blocks`, with ``vfolded_range``) for heads of
    a multiple of 64 values, else ``int8`` (``(quads, scales)``, see
    :func:`~ds41numba.numerics.pack_int8_blocks`, with ``int8_range``, what decides whether their
    integer dot products are exact); on AVX512-BF16 ``blocks`` (see
    :func:`~ds41numba.numerics.pack_bf16_pairs`). A tier also packs the next tier's layout,
    once, the first time its own kernel cannot score the keys (rows that do not fold, products
    not exact as integers). :meth:`scores` picks the kernel; every kernel gives the same scores.
    """

    __slots__ = ("keys", "blocks", "int8", "int8_range", "folded", "folded_range", "vfolded",
                 "vfolded_range")

    def __init__(self, keys: np.ndarray, packed_rows: int | None = None):
        """Wrap ``keys`` (kept as given, not copied); its first ``packed_rows`` rows (all by
        default) hold keys already and are packed."""
        self.keys = keys
        self.blocks = self.int8 = self.folded = self.vfolded = None
        self.int8_range = self.folded_range = self.vfolded_range = EMPTY_RANGE
        rows = keys.shape[0] if packed_rows is None else packed_rows
        if _amx_scored(keys.shape[1]):
            self._pack_folded(rows)
        if _vnni_folded(keys.shape[1]):
            self._pack_vfolded(rows)
        if _int8_scored(keys.shape[1]) and not self._folds():
            self._pack_int8(rows)
        if bf16_dot_enabled() and not (self._folds() or (self.int8 is not None and not self.int8_range[0])):
            self._pack_all(rows)

    @classmethod
    def empty(cls, capacity: int, head_dim: int) -> "IndexKeyCache":
        """A key owner's cache of ``capacity`` rows, none written yet."""
        return cls(np.zeros((capacity, head_dim), np.float32), packed_rows=0)

    def _pack_all(self, rows: int) -> None:
        n, d = self.keys.shape
        self.blocks = np.zeros((-(-n // DOT_LANES), d // 2, DOT_LANES), np.uint32)
        if rows:
            pack_bf16_pairs(self.keys[:rows], self.blocks, 0)

    def _folds(self) -> bool:
        """Whether the cache holds folded keys (either layout) and they all fold."""
        return ((self.folded is not None and foldable(self.folded_range, EMPTY_RANGE))
                or (self.vfolded is not None and foldable(self.vfolded_range, EMPTY_RANGE)))

    def _pack_vfolded(self, rows: int) -> None:
        self.vfolded = empty_folded_blocks(*self.keys.shape, FOLDED_KEY_OFFSET)
        self.vfolded_range = EMPTY_RANGE
        if rows:
            self.vfolded_range = pack_offset_folded_blocks(self.keys[:rows], self.vfolded, 0)[2]

    def _pack_folded(self, rows: int) -> None:
        self.folded = empty_folded_blocks(*self.keys.shape)
        self.folded_range = EMPTY_RANGE
        if rows:
            self.folded_range = pack_folded_blocks(self.keys[:rows], self.folded, 0)[2]

    def _pack_int8(self, rows: int) -> None:
        quads, scales = int8_blocks_shape(*self.keys.shape)
        # The rows not written yet: zeros (bytes 0 + KEY_OFFSET) of scale 1.
        self.int8 = (np.full(quads, np.uint32(0x0C0C0C0C)), np.ones(scales, np.float32))
        self.int8_range = EMPTY_RANGE
        if rows:
            self.int8_range = pack_int8_blocks(self.keys[:rows], self.int8, 0)[2]

    def write(self, first_row: int, keys: np.ndarray) -> None:
        """Keys of rows ``first_row .. first_row + len(keys)``, into every layout kept. The
        range only widens (rows written over keep counting), which can only send a tile to the
        bf16 kernel, never give a wrong score; keys that are not fp4 values (a bad range) start
        the bf16 layout at once."""
        self.keys[first_row:first_row + len(keys)] = keys
        if not len(keys):
            return
        rows = self.keys[first_row:first_row + len(keys)]
        if self.blocks is not None:
            pack_bf16_pairs(rows, self.blocks, first_row)
        if self.folded is not None:
            self.folded_range = merge_ranges(self.folded_range,
                                             pack_folded_blocks(rows, self.folded, first_row)[2])
        if self.vfolded is not None:
            self.vfolded_range = merge_ranges(self.vfolded_range, pack_offset_folded_blocks(
                rows, self.vfolded, first_row)[2])
        if (self.folded is not None or self.vfolded is not None) and not self._folds() \
                and self.int8 is None:                      # keys the per-block layout will score
            self._pack_int8(self.keys.shape[0])
        if self.int8 is not None:
            self.int8_range = merge_ranges(self.int8_range,
                                           pack_int8_blocks(rows, self.int8, first_row)[2])
            if self.int8_range[0] and self.blocks is None:    # keys the bf16 kernel will score
                self._pack_all(self.keys.shape[0])

    def scores(self, iq: np.ndarray, w: np.ndarray, clen: np.ndarray, width: int,
               out: np.ndarray | None = None, qbuf: np.ndarray | None = None,
               dirty_to: int | None = None, maxima: tuple | None = None) -> np.ndarray:
        """A tile's scores ``[T, width]`` after the visibility mask (see :func:`_tile_scores`);
        ``dirty_to``: the columns of ``out`` from there on hold -inf already (:func:`_masked_buffer`).

        ``maxima = (block, block_max)``: also each row's maxima of the blocks of ``block``
        positions it sees, into ``block_max [T, >= ceil(width / block)]`` (float32): entry
        ``[s, j]`` for ``j < ceil(clen[s] / block)`` the max (NaN wins) over the positions ``j *
        block ..`` below ``clen[s]``, the rest left as they were. The packed kernels take them
        while each key block's scores are in cache (``block`` dividing DOT_LANES); otherwise a
        pass over the scores after them.
        """
        if maxima is not None:
            block, block_max = maxima
            if block < 1 or block_max.dtype != np.float32 or block_max.shape[0] < len(clen) \
                    or block_max.shape[1] < -(-width // block):
                raise ValueError(f"IndexKeyCache.scores: block maxima of {block} positions need a "
                                 f"float32 [{len(clen)}, {-(-width // max(block, 1))}] buffer, got "
                                 f"{block_max.dtype} {block_max.shape}")
        if not bf16_dot_enabled():
            got = _tile_scores(iq, w, self.keys[:width], clen, width, out=out, dirty_to=dirty_to)
            if maxima is not None:
                _visible_block_maxima(got, clen, *maxima)
            return got
        if _amx_scored(self.keys.shape[1]):
            if self.folded is None:     # made while the products ran on another tier
                self._pack_folded(self.keys.shape[0])
            got = _tile_scores_amx(iq, w, self.folded, self.folded_range, clen, width, out=out,
                                   qbuf=qbuf, dirty_to=dirty_to, maxima=maxima)
            if got is not None:
                return got
        if _vnni_folded(self.keys.shape[1]):
            if self.vfolded is None:    # made while the products ran on another tier
                self._pack_vfolded(self.keys.shape[0])
            got = _tile_scores_offset_folded(iq, w, self.vfolded, self.vfolded_range, clen, width,
                                             out=out, qbuf=qbuf, dirty_to=dirty_to, maxima=maxima)
            if got is not None:
                return got
        if _int8_scored(self.keys.shape[1]):
            if self.int8 is None:       # made while the products ran on another tier
                self._pack_int8(self.keys.shape[0])
            got = _tile_scores_int8(iq, w, self.int8, self.int8_range, clen, width, out=out,
                                    qbuf=qbuf, dirty_to=dirty_to, maxima=maxima)
            if got is not None:
                return got
        if self.blocks is None:
            self._pack_all(self.keys.shape[0])
        return _tile_scores_bf16(iq, w, self.blocks, clen, width, out=out, qbuf=qbuf,
                                 dirty_to=dirty_to, maxima=maxima)


@njit(parallel=True, cache=True)
def _visible_block_maxima(scores, clen, block, out):
    """Per row, the max (NaN wins) over each block of ``block`` positions it sees: ``out[s, j]``
    for the blocks ``j`` holding positions below ``clen[s]``, over those positions only."""
    width = scores.shape[1]
    for s in prange(scores.shape[0]):
        _row_block_maxima(scores[s], min(width, max(clen[s], 0)), block, out[s])


@njit(cache=True)
def _finish_block_scores(bs, clen, block, valid):
    """The block scores of rows whose visible blocks hold their maxima: -inf from there to
    ``valid`` blocks, the newest visible block pinned to +inf."""
    for s in range(bs.shape[0]):
        seen = -(-max(clen[s], 0) // block)
        bs[s, seen:max(seen, min(bs.shape[1], valid))] = -np.inf
        if clen[s] > 0:
            bs[s, (clen[s] - 1) // block] = np.inf


def _block_scores(scores, clen, block, masked, valid, block_max=None):
    """Per row, the max over each block of ``block`` positions; the newest visible block is +inf.

    With ``masked`` the positions at or past ``clen[s]`` are known to hold -inf (the indexer's
    visibility mask), so their blocks hold -inf and only the visible ones are scanned: in a long
    chunked prefill a row is the whole prefill wide (1,048,576 positions) while a query sees
    only the positions before it. Then only a row's first ``valid`` blocks (at least) are
    written, the rest left undefined: the top-k that reads them scans no further
    (:func:`_candidate_picks`). ``block_max``: the visible blocks' maxima already taken (a
    buffer :meth:`IndexKeyCache.scores` filled), finished in place.
    """
    rows, width = scores.shape
    nb = -(-width // block)
    if block_max is None:
        block_max = np.empty((rows, nb), np.float32)
        _visible_block_maxima(scores, clen if masked else np.full(rows, width, np.int64), block,
                              block_max)
    else:
        block_max = block_max[:rows, :nb]
    _finish_block_scores(block_max, clen, block, valid if masked else 0)
    return block_max


def _candidate_picks(scores: np.ndarray, clen: np.ndarray, topk_blocks: int, block: int,
                     masked: bool, block_max: np.ndarray | None = None) -> tuple:
    """Per row, the block scores (:func:`_block_scores`, from ``block_max`` when taken already) and
    the blocks torch's top-k picks from them, ``[rows, min(topk_blocks, n_blocks)]``
    (``masked``: the scores past ``clen`` are -inf)."""
    clen = clen.astype(np.int64)
    nb = -(-scores.shape[1] // block)
    k = min(topk_blocks, nb)
    # The blocks a row sees; past them (masked) every block is -inf: _top_k_sets scans only
    # these where torch's branch is the heap's (k * 64 <= n_blocks), which -inf never enters,
    # and -inf picks are dropped anyway; it reads no block past the first k of them then.
    # Unmasked rows are scanned whole.
    heap = masked and k * 64 <= nb
    bs = _block_scores(np.ascontiguousarray(scores, np.float32), clen, block, masked,
                       k if heap else nb, block_max)
    seen = (clen + block - 1) // block if masked else np.full(len(clen), nb, np.int64)
    picked = np.empty((scores.shape[0], k), np.int64)
    _top_k_sets(bs, seen, k, picked, bs, 0)
    return bs, picked


def _candidate_block_mask(scores: np.ndarray, clen: np.ndarray, topk_blocks: int,
                          block: int) -> np.ndarray:
    """Per row, which blocks are candidates: ``[rows, n_blocks]`` bool, every score read (the
    indexer's rows, -inf past ``clen``, take :func:`_candidate_block_bits`)."""
    bs, picked = _candidate_picks(scores, clen, topk_blocks, block, False)
    rows, k = picked.shape
    mask = np.zeros(bs.shape, dtype=bool)
    if k:
        r = np.repeat(np.arange(rows), k)
        c = picked.reshape(-1)
        keep = bs[r, c] > -np.inf
        mask[r[keep], c[keep]] = True
    return mask


@njit(cache=True)
def _pack_picks(bs, picked, out):
    """The picked blocks scoring above -inf as bits of ``out`` (zeros), packed along each row in
    ``np.packbits``' order (block 0 the first byte's highest bit)."""
    for s in range(picked.shape[0]):
        for c in picked[s]:
            if bs[s, c] > -np.inf:
                out[s, c >> 3] |= np.uint8(0x80 >> (c & 7))


def _candidate_block_bits(scores: np.ndarray, clen: np.ndarray, topk_blocks: int, block: int,
                          out: np.ndarray, block_max: np.ndarray | None = None) -> None:
    """:func:`_candidate_block_mask` of rows that are -inf past ``clen`` (so scanned only as far
    as they see), as bits packed along each row into ``out`` (zeros; ``np.packbits``' layout),
    without a row-wide bool array: a long chunked prefill's rows are 131,072 blocks wide while a
    query picks 2,048. ``block_max``: the visible blocks' maxima, taken with the scores."""
    bs, picked = _candidate_picks(scores, clen, topk_blocks, block, True, block_max)
    _pack_picks(bs, picked, out)


def _select_rows(scores, clen, k, out, maxima=None):
    """The index selection: each row's top-k set (:func:`_top_k_sets`). A name of its own, apart
    from the candidate blocks' top-k, which uses the same rule: a kernel with its own tie order
    replaces this one (tests/test_golden.py does) and must leave the candidates as they are.
    ``maxima = (block, block_scores)``: the candidate source's block scores of these rows (each
    at least its block's max), which let the scan skip runs of a row unread."""
    block, hint = maxima if maxima is not None else (0, scores)
    _top_k_sets(scores, clen, k, out, hint, block)


@njit(parallel=True, cache=True)
def _top_k_sets(scores, clen, k, out, hint, block):
    """Each row's top-k set (torch's CPU tie order) into ``out [rows, k]``, ascending.

    In the ``partial_sort`` branch (``k * 64 <= width``, every long row) the scan stops at the
    row's visible length: past it every score is -inf, which never displaces the heap's top, so
    the set is the one the whole row gives, at a cost that grows with what the query sees.
    With ``block`` > 0 that scan skips runs by ``hint``, the rows' block maxima (see
    :func:`~ds41numba.topk.partial_sort_set_hinted`).
    """
    rows, width = scores.shape
    for s in prange(rows):
        if k * 64 <= width:
            n = min(width, max(k, clen[s]))
            sv = np.empty(k, np.float32)
            si = np.empty(k, np.int64)
            partial_sort_set_hinted(scores[s, :n], k, out[s], sv, si, hint[s], block)
        else:
            sv = np.empty(width, np.float32)
            si = np.empty(width, np.int64)
            topk_set_into(scores[s], k, out[s], sv, si)


def candidate_mask(packed_blocks: np.ndarray, width: int, block_size: int) -> np.ndarray:
    """Expand per-block candidates (bits packed along each row, ``np.packbits``) to ``[rows, width]``."""
    n_blocks = -(-width // block_size)
    blocks = np.unpackbits(packed_blocks, axis=1, count=n_blocks).astype(bool)
    return np.repeat(blocks, block_size, axis=1)[:, :width]


def select_candidate_blocks(scores: np.ndarray, clen, topk_blocks: int,
                            block_size: int) -> np.ndarray:
    """The candidate mask ``[rows, width]`` bool of the candidate source.

    Blocks of ``block_size`` positions score their max; each row's newest visible block is
    pinned; torch's top-k over the block scores picks ``min(topk_blocks, n_blocks)`` blocks
    and those scoring above -inf are kept, expanded back to positions.
    """
    scores = np.asarray(scores)
    if not (np.issubdtype(scores.dtype, np.floating) or scores.dtype.name == "bfloat16"):
        raise TypeError(f"scores must be a real floating-point array, got dtype {scores.dtype}")
    scores = scores.astype(np.float32, copy=False)
    if scores.ndim != 2:
        raise ValueError(f"scores must be [rows, width], got shape {scores.shape}")
    rows, width = scores.shape
    clen = np.asarray(clen)
    if clen.dtype == np.bool_ or not np.issubdtype(clen.dtype, np.integer):
        raise TypeError(f"clen must be integers, got dtype {clen.dtype}")
    if clen.shape not in ((), (rows,)):
        raise ValueError(f"clen must be one integer or one per row ({rows}), got shape {clen.shape}")
    clen = np.broadcast_to(clen.astype(np.int64), (rows,))
    for name, v in (("topk_blocks", topk_blocks), ("block_size", block_size)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be an integer, got {v!r}")
    if topk_blocks < 1 or block_size < 1:
        raise ValueError(f"topk_blocks ({topk_blocks}) and block_size ({block_size}) must be >= 1")
    if np.any(clen < 0) or np.any(clen > width):
        raise ValueError(f"clen must lie in 0..{width}")
    blocks = _candidate_block_mask(scores, clen, topk_blocks, block_size)
    return np.repeat(blocks, block_size, axis=1)[:, :width]


def _check_indexer_args(x, qr, start_pos, cfg, weights, index_k, offset, candidate_blocks, tile,
                        prefill_len):
    """The shapes the scoring kernels index by must agree: a mismatch is an error, not a stray read."""
    def bad(msg):
        raise ValueError(f"indexer: {msg}")

    def is_int(v, lo):
        return not isinstance(v, (bool, np.bool_)) and isinstance(v, (int, np.integer)) and v >= lo

    if not isinstance(cfg, IndexerCfg):
        raise TypeError(f"indexer: cfg must be an IndexerCfg, got {type(cfg).__name__}")
    for name in ("n_heads", "head_dim", "topk", "ratio", "candidate_topk_blocks", "candidate_block_size"):
        if not is_int(getattr(cfg, name), 1):
            bad(f"cfg.{name} must be a positive integer, got {getattr(cfg, name)!r}")
    if not is_int(start_pos, 0) or not is_int(offset, 0):
        bad(f"start_pos and offset must be integers >= 0, got {start_pos!r} and {offset!r}")
    if tile is not None and not is_int(tile, 1):
        bad(f"tile must be None or a positive integer, got {tile!r}")
    if isinstance(index_k, IndexKeyCache):
        index_k = index_k.keys
    for name, a in (("x", x), ("qr", qr), ("index_k", index_k)):
        dtypes = (np.float32, BF16) if name == "x" else (np.float32,)
        if not isinstance(a, np.ndarray) or a.dtype not in dtypes or a.ndim != 2:
            bad(f"{name} must be a 2-D float32 array, got {getattr(a, 'dtype', type(a).__name__)} "
                f"{getattr(a, 'shape', '')}")
    seqlen = x.shape[0]
    if seqlen == 0 or qr.shape[0] != seqlen:
        bad(f"x and qr must have the same number (>= 1) of rows, got {x.shape} and {qr.shape}")
    ih, idim = cfg.n_heads, cfg.head_dim
    for name, w, want in (("weights_proj", weights.weights_proj, (ih, x.shape[1])),
                          ("wq_b", weights.wq_b, (ih * idim, qr.shape[1]))):
        if tuple(getattr(w, "shape", ())) != want:
            bad(f"weights.{name} must have shape {list(want)}, got {list(getattr(w, 'shape', ()))}")
    if prefill_len is not None and not (is_int(prefill_len, 1) and start_pos + seqlen <= prefill_len):
        bad(f"prefill_len must be an integer >= {start_pos + seqlen} (the chunk's end), got "
            f"{prefill_len!r}")
    width = (start_pos + seqlen if prefill_len is None else prefill_len) // cfg.ratio
    if index_k.shape[0] < width or index_k.shape[1] != idim:
        bad(f"index_k must be [>= {width}, {idim}] (the keys of every position scored), got "
            f"{list(index_k.shape)}")
    if cfg.use_candidates:
        nb = -(-width // cfg.candidate_block_size)
        want = (seqlen, (nb + 7) // 8)
        if (not isinstance(candidate_blocks, np.ndarray) or candidate_blocks.dtype != np.uint8
                or candidate_blocks.shape != want):
            bad(f"candidate_blocks must be the candidate source's packed uint8 mask of shape "
                f"{list(want)}, got {getattr(candidate_blocks, 'shape', candidate_blocks)}")


def indexer(x: np.ndarray, qr: np.ndarray, start_pos: int, cfg: IndexerCfg,
            weights: IndexerWeights, table, index_k, offset: int,
            candidate_blocks: np.ndarray | None = None, tile: int | None = None,
            capture: bool = False, prefill_len: int | None = None, observer=None,
            batch: BatchRow = SINGLE):
    """Select each query's compressed positions.

    ``index_k`` holds the shared index keys (at least ``end_pos // r`` rows): an
    :class:`IndexKeyCache` (a key owner's, kept in the scorer's layout as keys are written) or
    an array of bf16 values (the fp4-quantised keys), packed here when the scorer needs it.
    ``offset`` is added to every kept index (the number of window rows ahead of the compressed
    rows). Returns ``(topk_idxs [seqlen, k] int32, candidate_blocks or None, index_score or
    None)``: the candidate source's per-block mask (bits packed along rows, see
    :func:`candidate_mask`), and with ``capture`` the scores after the visibility mask and
    before candidate masking.

    ``prefill_len`` makes the step rows ``start_pos ..`` of a prefill of that many tokens (a
    chunk): each query sees ``(s + 1) // r`` positions as in the one-shot prefill, and the rows
    (scores of the one-shot's width ``prefill_len // r``, selection, candidates, every sum) are
    that prefill's rows. ``index_k`` then needs the keys up to the chunk's end only.
    ``batch``: one sequence of a batch in lockstep; the projections (``weights_proj``,
    ``wq_b``) sum as the batch's products of B times the step's rows do
    (:mod:`ds41numba.batch`); the scores and the selection are per query.

    ``observer`` (the golden captures' hook, :mod:`ds41numba.golden.captures`), if given, sees
    every tile of queries (``s0`` counts from this call's first row, a chunk's too) while its
    buffers are live (copy what it keeps):
    ``observer.index_scores(s0, iq, w, scores)`` with the fp4-rounded queries ``[T, ih, id]``,
    the head weights ``[T, ih]`` and the scores after the visibility mask, before candidate
    masking; then ``observer.index_selection(s0, scores, topk)`` with the scores top-k chose
    from (candidate-masked) and the tile's rows of ``topk_idxs``. It changes nothing computed.
    """
    _check_indexer_args(x, qr, start_pos, cfg, weights, index_k, offset, candidate_blocks, tile,
                        prefill_len)
    batch = checked_batch(batch, "indexer")
    seqlen = x.shape[0]
    end_pos = start_pos + seqlen
    r = cfg.ratio
    chunk = prefill_len is not None
    width = (prefill_len if chunk else end_pos) // r
    ref_rows = batch.rows(prefill_len if chunk else seqlen)
    k = min(cfg.topk, width)
    clen = visible_lengths(start_pos, seqlen, r, prefill=chunk or start_pos == 0)
    positions = np.arange(start_pos, end_pos, dtype=np.int64)
    if not isinstance(index_k, IndexKeyCache):
        try:
            index_k = IndexKeyCache(index_k[:width])
        except ValueError:
            raise ValueError("indexer: index_k must hold bf16 values (the fp4-quantised keys)") from None
    scale = np.float32(cfg.head_dim ** -0.5 * cfg.n_heads ** -0.5)
    w_all = to_bf16_rne(linear_bf16(x, weights.weights_proj, ref_rows=ref_rows) * scale)

    topk_idxs = np.empty((seqlen, k), np.int32)
    published = None
    if cfg.candidate_source:
        # One bit per block and query: the mask must outlive the step's later layers, and at
        # long lengths a bool per position would be the largest array of the step.
        nb = (width + cfg.candidate_block_size - 1) // cfg.candidate_block_size
        published = np.zeros((seqlen, (nb + 7) // 8), dtype=np.uint8)
    score_capture = np.empty((seqlen, width), np.float32) if capture else None
    tile = tile or _tile_rows(width)
    # The query projection runs for several tiles at once: a 256-row product is well below
    # BLAS's speed.
    proj_rows = tile * max(1, _PROJ_ROWS // tile)
    # Buffers reused by every tile (fresh arrays this size cost page faults each time).
    iq_buf = np.empty((min(proj_rows, seqlen), cfg.n_heads, cfg.head_dim), np.float32)
    score_buf = np.empty((min(tile, seqlen), width), np.float32)
    dirty_to = None              # score_buf's columns from here on hold -inf (None: unknown)
    qbuf = (np.empty(_query_pairs_size(min(tile, seqlen), cfg.n_heads, cfg.head_dim), np.uint32)
            if bf16_dot_enabled() else None)
    # The candidate source's block maxima, taken by the score kernel while the scores are in
    # cache (a second pass over a tile's rows, 64 MB at 1M positions, costs more).
    max_buf = (np.empty((min(tile, seqlen), -(-width // cfg.candidate_block_size)), np.float32)
               if cfg.candidate_source else None)
    for s0 in range(0, seqlen, tile):
        s1 = min(seqlen, s0 + tile)
        if s0 % proj_rows == 0:
            p1 = min(seqlen, s0 + proj_rows)
            iq_rows = linear_bf16(qr[s0:p1], weights.wq_b, out=iq_buf[:p1 - s0], ref_rows=ref_rows)
            iq_rows = iq_rows.reshape(p1 - s0, cfg.n_heads, cfg.head_dim)
            iq_rows = fp4_quant_e8m0_inplace(apply_rotary(iq_rows, positions[s0:p1], table, inplace=True))
        iq = iq_rows[s0 % proj_rows:s0 % proj_rows + s1 - s0]
        maxima = None if max_buf is None else (cfg.candidate_block_size, max_buf[:s1 - s0])
        scores = index_k.scores(iq, w_all[s0:s1], clen[s0:s1], width, out=score_buf[:s1 - s0],
                                qbuf=qbuf, dirty_to=dirty_to, maxima=maxima)
        # What the tile wrote: below each row's clen (later writers only write -inf).
        dirty_to = max(int(clen[s0:s1].max(initial=0)), 0)
        if capture:
            score_capture[s0:s1] = scores
        if observer is not None:
            observer.index_scores(s0, iq, w_all[s0:s1], scores)
        if cfg.candidate_source:
            _candidate_block_bits(scores, clen[s0:s1], cfg.candidate_topk_blocks,
                                  cfg.candidate_block_size, published[s0:s1], maxima[1])
        if cfg.use_candidates:
            allowed = candidate_mask(candidate_blocks[s0:s1], width, cfg.candidate_block_size)
            scores[~allowed] = -np.inf
        picked = np.zeros((s1 - s0, k), np.int64)
        if k:
            # The candidate source's block scores bound its rows' blocks (the pinned block's
            # +inf too): the top-k's scan skips by them.
            _select_rows(scores, clen[s0:s1], k, picked,
                         maxima if cfg.candidate_source else None)
        # Positions past a query's visible range are dropped; a candidate-masked position
        # inside it that top-k still picked (fewer candidates than k) stays valid.
        topk_idxs[s0:s1] = np.where(picked >= clen[s0:s1, None], -1, picked + offset)
        if observer is not None:
            observer.index_selection(s0, scores, topk_idxs[s0:s1])
    return topk_idxs, published, score_capture

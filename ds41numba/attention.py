"""One compressed-attention layer for any ``compress_ratio``: ``attention_any``.

Every query attends to two sets of rows: the sliding window of the last ``window_size``
tokens (fp8-quantised KV, kept in a ring) and, for ratio > 0, the compressed positions its
index source selected (fp4 latents of the shared compressed cache). Attention is sparse over
those listed rows, with a per-head *sink* logit that absorbs probability mass without
contributing a value. The heads' outputs are projected back in ``o_groups`` independent groups
(``wo_a``) and then mixed (``wo_b``).

The forward builds what every query needs first (window rows, latents, index keys, the
index selection) and then runs the queries in tiles end to end, so memory grows with
``seqlen * (dim + head_dim)`` rather than ``seqlen * heads * head_dim``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numba
import numpy as np
from numba import njit

from .compressor import compressor, latent_positions
from .indexer import IndexerCfg, index_keys, indexer
from .numerics import (MATVEC_MAX_ROWS, _output, act_quant_fp8_inplace, fp4_quant_e4m3_inplace,
                       in_workers, linear_bf16, nan_max, rms_norm, round_bf16_inplace,
                       single_threaded_blas, split_range)
from .rope import apply_rotary, yarn_freqs_cis

__all__ = ["CompAttnRun", "attention_any", "sparse_attn", "window_index_rows", "index_rows",
           "output_projection", "layer_rope_table"]


@dataclass
class CompAttnRun:
    """One layer's step. ``out`` is always set; the rest only with ``capture=True``.

    ``q`` queries after RoPE ``[seqlen, H, hd]``; ``kv_rows`` the rows attention received
    (window rows, then compressed rows); ``idx`` the index rows ``[seqlen, topk]`` int32
    (window entries, then compressed entries; -1 = skip); ``o`` the attention output before
    the inverse RoPE; ``index_score`` the indexer's scores after the visibility mask (index
    sources only).
    """

    out: np.ndarray
    q: np.ndarray | None = None
    kv_rows: np.ndarray | None = None
    idx: np.ndarray | None = None
    topk: int | None = None
    o: np.ndarray | None = None
    index_score: np.ndarray | None = None


@functools.lru_cache(maxsize=4)
def _cached_table(dim, length, original_seq_len, base, factor, beta_fast, beta_slow):
    return yarn_freqs_cis(dim, length, original_seq_len, base, factor, beta_fast, beta_slow)


def layer_rope_table(config, ratio: int, end_pos: int):
    """The layer's ``(cos, sin)`` table covering positions ``0 .. end_pos - 1`` at least.

    Ratio-0 layers rotate with ``rope_theta`` and no YaRN; compressed layers with
    ``compress_rope_theta`` and YaRN. Table rows do not depend on the table's length, so a
    longer cached table serves shorter needs.
    """
    length = min(config.max_seq_len, max(1024, 1 << (max(end_pos, 1) - 1).bit_length()))
    if ratio == 0:
        return _cached_table(config.rope_head_dim, length, 0, float(config.rope_theta), 1.0, 0, 0)
    return _cached_table(config.rope_head_dim, length, config.original_seq_len,
                         float(config.compress_rope_theta), float(config.rope_factor),
                         config.beta_fast, config.beta_slow)


def window_index_rows(start_pos: int, seqlen: int, window: int) -> np.ndarray:
    """Index rows into the window KV rows; -1 marks an entry to skip.

    Prefill: query t sees the new rows ``max(0, t - win + 1) ..`` (``min(seqlen, win)`` entries,
    future ones -1). Decode: the whole ring, oldest slot first, slots not yet filled -1.
    """
    for name, v, lo in (("start_pos", start_pos, 0), ("seqlen", seqlen, 1), ("window", window, 1)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"window_index_rows: {name} must be an integer >= {lo}, got {v!r}")
    if start_pos > 0 and seqlen != 1:
        raise ValueError(f"window_index_rows: a decode (start_pos {start_pos} > 0) has one token, got {seqlen}")
    if start_pos == 0:
        n = min(seqlen, window)
        t = np.arange(seqlen)[:, None]
        pos = np.maximum(0, t - window + 1) + np.arange(n)[None, :]
        return np.where(pos > t, -1, pos).astype(np.int32)
    first = start_pos % window + 1
    slots = (np.arange(window) + first) % window
    return np.where(slots > start_pos, -1, slots).astype(np.int32)[None, :]


def index_rows(start_pos: int, seqlen: int, window: int, compressed=None) -> np.ndarray:
    """The index rows sparse attention receives, ``[seqlen, width]`` int32: the window entries
    (:func:`window_index_rows`), then ``compressed``, the compressed entries (the shared
    selection, offsets applied; None for a ratio-0 layer)."""
    win = window_index_rows(start_pos, seqlen, window)
    return win if compressed is None else np.concatenate([win, compressed], axis=1)


# Queries whose attention runs as one batch of small products: enough to spread numpy's
# per-call cost, few enough that the gathered rows ([block, rows, hd]) stay near the caches
# (1 to 8 measured within noise of each other here).
_ATTN_BLOCK = 4


@njit(nogil=True, cache=True)
def _gather_valid_rows(parts, starts, idx, rows):
    """For each query b, its listed rows (``idx[b] >= 0``, in list order) into ``rows[b, :n]``
    and zeros after them (padding gets weight 0, and 0 times a stale NaN would be NaN).
    ``parts`` are row blocks that stack to the KV rows; ``starts`` their first row ids. Runs
    without the GIL, in a worker thread."""
    for b in range(idx.shape[0]):
        n = 0
        for e in range(idx.shape[1]):
            r = idx[b, e]
            if r < 0:
                continue
            p = len(starts) - 1
            while starts[p] > r:
                p -= 1
            rows[b, n, :] = parts[p][r - starts[p]]
            n += 1
        rows[b, n:, :] = 0


@njit(nogil=True, cache=True)
def _shifted_scores(scores, counts, sink, scale):
    """In place: ``scores[b, j, h] * scale - m[b, h]`` for listed rows, -inf for padding, where
    ``m`` is the larger of the best scaled score and the sink (NaN if either is). Returns ``m``.

    Shifting by the larger of the best score and the sink means a sink far above every score
    underflows the scores instead of overflowing ``exp(sink - m)`` to inf.
    """
    B, _, H = scores.shape
    m = np.empty((B, H), np.float32)
    for b in range(B):
        n = counts[b]
        best = np.full(H, -np.inf, np.float32)
        for j in range(n):
            row = scores[b, j]
            for h in range(H):
                v = row[h] * scale
                row[h] = v
                best[h] = nan_max(best[h], v)
        for h in range(H):
            m[b, h] = nan_max(best[h], sink[h])
        for j in range(n):
            row = scores[b, j]
            for h in range(H):
                row[h] -= m[b, h]
        scores[b, n:, :] = -np.inf
    return m


@njit(nogil=True, cache=True)
def _row_sums(p, counts):
    """``sum_j p[b, j, h]`` over each query's listed rows, in row order."""
    B, _, H = p.shape
    out = np.zeros((B, H), np.float32)
    for b in range(B):
        acc = out[b]
        for j in range(counts[b]):
            row = p[b, j]
            for h in range(H):
                acc[h] += row[h]
    return out


def _attend_block(q, rows, counts, sink, scale):
    """Attention of queries ``q [B, h, hd]`` over their gathered rows ``rows [B, n, hd]`` (row
    ``j >= counts[b]`` is padding); returns ``[B, h, hd]`` f32 (zeros for a query with no row)."""
    # Scores as [B, rows, heads]: both products then run untransposed through BLAS.
    scores = np.matmul(rows, q.transpose(0, 2, 1))
    m = _shifted_scores(scores, counts, sink, scale)
    p = np.exp(scores, out=scores)
    denom = _row_sums(p, counts) + np.exp(sink - m)
    out = np.matmul(p.transpose(0, 2, 1), rows)
    out /= denom[:, :, None]
    out[counts == 0] = 0
    return out


def _gathered(parts, starts, idx):
    """``(rows [B, n, hd], counts [B])``: each query's listed rows, padded to the longest list."""
    counts = np.count_nonzero(idx >= 0, axis=1)
    rows = np.empty((idx.shape[0], int(counts.max(initial=0)), parts[0].shape[1]), np.float32)
    _gather_valid_rows(parts, starts, idx, rows)
    return rows, counts


def _attend_queries(q, parts, starts, idx, sink, scale, o, lo, hi):
    """Queries ``lo .. hi-1`` of :func:`sparse_attn`, a block at a time, written into ``o``."""
    for a in range(lo, hi, _ATTN_BLOCK):
        b = min(hi, a + _ATTN_BLOCK)
        rows, counts = _gathered(parts, starts, idx[a:b])
        o[a:b] = _attend_block(q[a:b], rows, counts, sink, scale)


def _check_sparse_attn(q, kv, idx, attn_sink):
    """Shapes and index range, checked before any row is gathered: a bad entry is an error."""
    parts = tuple(kv) if isinstance(kv, (tuple, list)) else (kv,)
    if not isinstance(q, np.ndarray) or q.dtype != np.float32 or q.ndim != 3:
        raise ValueError(f"sparse_attn: q must be float32 [S, H, hd], got {getattr(q, 'shape', q)!r}")
    S, H, hd = q.shape
    for p in parts:
        if not isinstance(p, np.ndarray) or p.dtype != np.float32 or p.ndim != 2 or p.shape[1] != hd:
            raise ValueError(f"sparse_attn: kv rows must be float32 [rows, {hd}], got "
                             f"{getattr(p, 'dtype', type(p).__name__)} {getattr(p, 'shape', '')}")
    if not isinstance(idx, np.ndarray) or idx.dtype == np.bool_ or not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"sparse_attn: idx must be an integer array, got {getattr(idx, 'dtype', idx)!r}")
    if idx.ndim != 2 or idx.shape[0] != S:
        raise ValueError(f"sparse_attn: idx must be [{S}, W], got {list(idx.shape)}")
    n_rows = sum(p.shape[0] for p in parts)
    if idx.size and (idx.min() < -1 or idx.max() >= n_rows):
        raise ValueError(f"sparse_attn: idx entries must be -1 (skip) or a row 0..{n_rows - 1}, "
                         f"got {int(idx.min())}..{int(idx.max())}")
    if np.shape(attn_sink) != (H,):
        raise ValueError(f"sparse_attn: attn_sink must be [{H}], got {list(np.shape(attn_sink))}")


def sparse_attn(q: np.ndarray, kv: np.ndarray, idx: np.ndarray, attn_sink: np.ndarray,
                softmax_scale: float, out: np.ndarray | None = None) -> np.ndarray:
    """Attention of each query over its listed KV rows, with a sink logit per head.

    ``q [S, H, hd]``, ``kv [rows, hd]`` (shared by all heads; or a tuple of row blocks that
    stack to it, e.g. the window rows and the compressed cache, so that they need not be copied
    together), ``idx [S, W]`` (-1 = skip), ``attn_sink [H]``. Softmax in f32 over the listed
    scores plus the sink, which joins only the denominator. A query with no listed row outputs
    zeros. Result rounded to bf16, written into ``out`` (a C-contiguous float32 buffer) if given.

    All heads of a query read the same rows, so each query is two small matrix products
    (``[n, hd] x [hd, H]`` and ``[H, n] x [n, hd]``) over its gathered valid rows, run for a block
    of queries at a time (rows padded to the block's longest list; padding scores -inf). Such
    products are too small to split well across BLAS threads, so a prefill's blocks are split
    across ``numba.get_num_threads()`` workers instead, each with single-threaded BLAS; a step
    with fewer queries than workers (a decode step, about a millisecond of products) runs in
    the calling thread, which costs less than handing it over. A query's arithmetic is the
    same whichever thread runs it.
    """
    _check_sparse_attn(q, kv, idx, attn_sink)
    S, H, hd = q.shape
    scale = np.float32(softmax_scale)
    sink = attn_sink.astype(np.float32)
    parts = tuple(np.ascontiguousarray(p) for p in (kv if isinstance(kv, (tuple, list)) else (kv,)))
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]]).astype(np.int64)
    o = _output(out, (S, H, hd), "sparse_attn")       # every query's row is written below
    workers = numba.get_num_threads()
    if S >= workers:
        # Whole blocks to each worker: a block's products, and so its rounding, do not depend
        # on the number of workers.
        blocks = -(-S // _ATTN_BLOCK)
        in_workers(_attend_queries, [(q, parts, starts, idx, sink, scale, o, lo * _ATTN_BLOCK,
                                      min(S, hi * _ATTN_BLOCK))
                                     for lo, hi in split_range(blocks, workers)])
    else:
        # A decode step: ~1 ms of BLAS, less than splitting it across threads costs.
        rows, counts = _gathered(parts, starts, idx)
        with single_threaded_blas():
            o[:] = _attend_block(q, rows, counts, sink, scale)
    return round_bf16_inplace(o)


def output_projection(o: np.ndarray, wo_a, wo_b, out=None, mid=None,
                      ref_rows: int | None = None) -> np.ndarray:
    """Grouped low-rank output projection: ``o [S, H*hd]`` through ``wo_a``, a grouped
    :class:`Bf16Matrix` (head group g through its own block of rows), then through ``wo_b``.
    ``out`` and ``mid`` optionally take the result and the low-rank intermediate (buffers a
    tiled loop reuses); ``ref_rows`` is the step's length when ``o`` is one tile of it (the
    reference's summation order depends on it, see ``linear_bf16``)."""
    return linear_bf16(linear_bf16(o, wo_a, mid, ref_rows), wo_b, out, ref_rows)


def _default_tile(seqlen: int) -> int:
    """Queries per tile: enough rows for the projections to run at BLAS speed."""
    return max(1, min(1024, seqlen))


def _window_rows(config, weights, state, x, start_pos, positions, table):
    """This step's window: the KV rows attention reads, and the offset.

    The new rows are normed, rotated and fp8-quantised. A prefill attends to all its new rows
    and the ring keeps the last ``window_size`` of them; a decode step writes its row into the
    ring and attends to the whole ring. The offset is the number of window rows, which the
    compressed entries of an index row are shifted by.
    """
    seqlen, win = x.shape[0], config.window_size
    kv = rms_norm(linear_bf16(x, weights.wkv), weights.kv_norm, config.norm_eps)
    kv = act_quant_fp8_inplace(apply_rotary(kv, positions, table, inplace=True))
    if start_pos == 0:
        keep = min(seqlen, win)
        state.window_kv[positions[-keep:] % win] = kv[-keep:]
        rows = kv
    else:
        state.window_kv[start_pos % win] = kv[0]
        rows = state.window_kv.copy()
    return rows, len(rows)


def _compressed_rows(config, layer_id, weights, state, shared, x, qr, start_pos, table, offset,
                     capture):
    """Steps 4-7 for a ratio > 0 layer: compress, index, publish; return what attention reads.

    Returns ``(rows, idx, index_score)``: the shared compressed cache up to ``end_pos // r``, the
    compressed index entries (the shared selection, offsets applied) and, for index sources
    with ``capture``, the scores.
    """
    c = config
    seqlen = x.shape[0]
    r = c.ratio(layer_id)
    width = (start_pos + seqlen) // r
    first_row = start_pos // r
    latents = lpos = index_score = None
    if c.is_kv_source(layer_id):
        latents = compressor(x, start_pos, r, weights.compressor, state.compressor, c.norm_eps)
        lpos = latent_positions(start_pos, seqlen, r)
    if c.is_index_source(layer_id):
        if c.is_key_owner(layer_id) and latents is not None:
            # The key owner publishes its cache only on a step that wrote keys: otherwise the
            # slot keeps the previous writer's cache (even another ratio's), as in the
            # reference, and this layer scores against that.
            keys = index_keys(latents, lpos, weights.indexer, table, c.norm_eps)
            state.index_cache[first_row:first_row + len(keys)] = keys
            shared.index_k = state.index_cache
            shared.index_k_packed = state.index_packed
            if state.index_packed is not None:
                state.index_packed.write(first_row, len(keys))
        if width == 0:
            shared.topk_idxs = np.zeros((seqlen, 0), np.int32)
        else:
            cands = shared.candidate_blocks if c.uses_candidates(layer_id) else None
            shared.topk_idxs, published, index_score = indexer(
                x, qr, start_pos, IndexerCfg.for_layer(c, layer_id), weights.indexer, table,
                shared.index_k, offset, candidate_blocks=cands, capture=capture,
                packed_keys=shared.index_k_packed, observer=shared.observer)
            if published is not None:
                shared.candidate_blocks = published
                shared.candidate_width = width
                shared.candidate_block_size = c.candidate_block_size
    if latents is not None:
        lat = fp4_quant_e4m3_inplace(apply_rotary(latents, lpos, table, inplace=True))
        state.compress_cache[first_row:first_row + len(lat)] = lat
    if c.is_kv_source(layer_id):
        shared.compress_kv = state.compress_cache
    return shared.compress_kv[:width], shared.topk_idxs, index_score


def attention_any(config, layer_id: int, weights, state, shared, x: np.ndarray, start_pos: int,
                  capture: bool = False, tile: int | None = None) -> CompAttnRun:
    """One layer's forward for any ratio; updates ``state`` and the ``shared`` slots.

    Inputs are assumed valid (``AttentionStack.forward`` checks them). What every query needs
    is built first (window rows, latents, index keys, the index selection); then the queries
    run in tiles: projection, RoPE, sparse attention, inverse RoPE, output projection.
    A decode step's products are all small, and BLAS's threads would only contend with the
    numba kernels between them: BLAS runs single-threaded for it.
    """
    if x.shape[0] <= MATVEC_MAX_ROWS:
        with single_threaded_blas():
            return _attention_step(config, layer_id, weights, state, shared, x, start_pos,
                                   capture, tile)
    return _attention_step(config, layer_id, weights, state, shared, x, start_pos, capture, tile)


def _attention_step(config, layer_id, weights, state, shared, x, start_pos, capture, tile):
    c = config
    seqlen = x.shape[0]
    H, hd = c.n_heads, c.head_dim
    positions = np.arange(start_pos, start_pos + seqlen, dtype=np.int64)
    table = layer_rope_table(c, c.ratio(layer_id), start_pos + seqlen)

    qr = rms_norm(linear_bf16(x, weights.wq_a), weights.q_norm, c.norm_eps)
    window, offset = _window_rows(c, weights, state, x, start_pos, positions, table)
    kv_rows, idx_comp, index_score = (window,), None, None
    if c.ratio(layer_id) > 0:
        comp, idx_comp, index_score = _compressed_rows(c, layer_id, weights, state, shared, x, qr,
                                                       start_pos, table, offset, capture)
        kv_rows = (window, comp)
    idx = index_rows(start_pos, seqlen, c.window_size, idx_comp)

    out = np.empty((seqlen, c.dim), np.float32)
    q_cap = np.empty((seqlen, H, hd), np.float32) if capture else None
    o_cap = np.empty((seqlen, H, hd), np.float32) if capture else None
    step = tile or _default_tile(seqlen)
    # One set of tile buffers for every tile (fresh arrays this size cost page faults each time).
    q_buf = np.empty((min(step, seqlen), H, hd), np.float32)
    o_buf = np.empty((min(step, seqlen), H, hd), np.float32)
    mid_buf = np.empty((min(step, seqlen), weights.wo_a.shape[0]), np.float32)
    for s0 in range(0, seqlen, step):
        s1 = min(seqlen, s0 + step)
        n = s1 - s0
        q = linear_bf16(qr[s0:s1], weights.wq_b, out=q_buf[:n], ref_rows=seqlen).reshape(n, H, hd)
        q = apply_rotary(q, positions[s0:s1], table, inplace=True)
        o = sparse_attn(q, kv_rows, idx[s0:s1], weights.attn_sink, hd ** -0.5, out=o_buf[:n])
        if capture:
            q_cap[s0:s1] = q
            o_cap[s0:s1] = o
        if shared.observer is not None:   # golden captures (SharedRuntime.observer)
            shared.observer.attention_tile(s0, q, o, kv_rows, idx[s0:s1])
        o = apply_rotary(o, positions[s0:s1], table, inverse=True, inplace=True)
        output_projection(o.reshape(n, H * hd), weights.wo_a, weights.wo_b, out=out[s0:s1],
                          mid=mid_buf[:n], ref_rows=seqlen)
    if not capture:
        return CompAttnRun(out=out)
    return CompAttnRun(out=out, q=q_cap, kv_rows=np.concatenate(kv_rows), idx=idx,
                       topk=idx.shape[1], o=o_cap, index_score=index_score)

"""Index scores through numpy's f32 BLAS (the blas tier): a tile's dot products a chunk of
positions at a time, then their ReLU'd head mix while the chunk is in cache.

The dot products are of fp4 values, exact in f32 whatever BLAS's summation order, so only the
mix's order matters; it is torch's (:func:`mix_heads_by_head`), which the packed kernels share.
"""

from __future__ import annotations

import numba
import numpy as np

from ..jit import njit
from ..numerics import bf16_scalar, bf16_scalar_no_payload, in_workers, split_range, worth_parallel
from .visibility import masked_buffer

__all__ = ["tile_scores", "mix_heads_by_head"]

# Elements of one worker's [chunk, tile * heads] dot products: 4 MB of f32, mixed while in cache.
_SCORE_CHUNK_ELEMS = 1 << 20
# Positions whose head mixing runs as one batch: enough independent sums to hide the add latency.
_MIX_GROUP = 8
# From this many query heads on (a prefill tile) the dot products are formed head-major.
_HEAD_MAJOR_MIN = 1024


@njit
def _head_weight(w):
    """A head's weight as :func:`_relu_weighted` takes it: a NaN made quiet with no payload."""
    return bf16_scalar(w) if w != w else w


@njit
def _relu_weighted(d, w, finite=False):
    """``bf16(relu(bf16(d)) * w)``; a NaN passes relu, as torch's does. ``w`` as
    :func:`_head_weight` leaves it; ``finite``: ``d`` is no NaN (an integer kernel's exact dot
    product), so its rounding needs no NaN branch (a third of a mixed element's work on AVX2)."""
    v = bf16_scalar_no_payload(d) if finite else bf16_scalar(d)
    if v < 0:
        v = np.float32(0.0)
    # The product is a NaN only as a quiet one with no payload (v's, w's, or the CPU's default
    # NaN for 0 * inf), which is its own rounding: no NaN branch, a sixth of the mix's work.
    return bf16_scalar_no_payload(v * w)


@njit(nogil=True)
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
    weights = np.empty((T, ih), np.float32)
    for s in range(T):
        for h in range(ih):
            weights[s, h] = _head_weight(w[s, h])
    for a in range(0, n, _MIX_GROUP):
        g = min(n, a + _MIX_GROUP) - a
        for s in range(T):
            if t0 + a >= clen[s]:
                continue
            ws = weights[s]
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


@njit(nogil=True)
def mix_heads_by_head(d, w, clen, t0, out, finite=False):
    """:func:`_mix_heads` for dot products held head-major (``[T * ih, chunk]``, many queries):
    each head's row adds into the positions' sums at once, still in head order. ``finite``: the
    dot products hold no NaN (see :func:`_relu_weighted`)."""
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
            wh = _head_weight(w[s, h])
            for j in range(m):
                a[j] += _relu_weighted(row[j], wh, finite)
        o = out[s, t0:t0 + m]
        for j in range(m):
            o[j] = bf16_scalar(a[j])


def tile_scores(iq: np.ndarray, w: np.ndarray, keys: np.ndarray, clen: np.ndarray,
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
    out = masked_buffer(out, (T, width), clen, dirty_to, "tile_scores")
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
                mix_heads_by_head(d, w, clen, a, out)
            else:
                d = buf[:(b - a) * T * ih].reshape(b - a, T * ih)
                np.matmul(keys[a:b], flat.T, out=d)
                _mix_heads(d, w, clen, a, out)

    # Handing work to the worker threads costs a few hundred microseconds: a short decode
    # step's scores (a few MFLOP) run in the calling thread.
    workers = numba.get_num_threads() if worth_parallel(T * n_vis * ih * idim, pool=True) else 1
    in_workers(score_range, split_range(n_vis, workers))
    return out


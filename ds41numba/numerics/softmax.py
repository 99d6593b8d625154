"""torch's CPU softmax, bit for bit: Sleef's ``expf`` (``Sleef_expf16_u10``, torch's
``Vectorized<float>::exp`` on AVX512) and ``_vec_softmax_lastdim``'s order of the max, the
exponentials, the 16-lane sum and the scaling, as sparse attention runs it over a query's heads
(:func:`softmax_rows`).
"""

from __future__ import annotations

import numpy as np

from ..jit import njit
from .formats import fma_f32, nan_max

__all__ = ["SOFTMAX_LANES", "expf_u10", "softmax_rows"]

#: Lanes of torch's Vectorized<float> on AVX512: the softmax's sum runs 16 lane accumulators.
SOFTMAX_LANES = 16

# Sleef_expf16_u10 (Sleef 3's xexpf), torch's Vectorized<float>::exp on AVX512; its multiply-adds
# are fused (vfmadd).
_R_LN2F = np.float32(1.442695040888963407359924681001892137426645954152985934135449406931)
_L2UF = np.float32(0.693145751953125)
_L2LF = np.float32(1.428606765330187045e-06)
_EXP_C0 = np.float32(0.000198527617612853646278381)
_EXP_C1 = np.float32(0.00139304355252534151077271)
_EXP_C2 = np.float32(0.00833336077630519866943359)
_EXP_C3 = np.float32(0.0416664853692054748535156)
_EXP_C4 = np.float32(0.166666671633720397949219)
_EXP_C5 = np.float32(0.5)
# Adding and subtracting 1.5 * 2^23 rounds |t| < 2^22 to an integer, ties to even (as cvtps2dq).
_RINT_MAGIC = np.float32(12582912.0)


@njit
def _pow2i(e):
    """2^e as f32 for -126 <= e <= 127 (Sleef's vpow2i: the exponent field alone)."""
    return np.uint32((e + 127) << 23).view(np.float32)


@njit
def expf_u10(d):
    """e^d as Sleef_expf16_u10 computes it, bit for bit (d float32)."""
    t = d * _R_LN2F
    if not abs(t) < np.float32(4096.0):
        t = np.float32(0.0)          # non-finite or far out of range: the selects below decide
    q = (t + _RINT_MAGIC) - _RINT_MAGIC
    s = fma_f32(q, -_L2UF, d)
    s = fma_f32(q, -_L2LF, s)
    u = fma_f32(_EXP_C0, s, _EXP_C1)
    u = fma_f32(u, s, _EXP_C2)
    u = fma_f32(u, s, _EXP_C3)
    u = fma_f32(u, s, _EXP_C4)
    u = fma_f32(u, s, _EXP_C5)
    u = np.float32(1.0) + fma_f32(s * s, u, s)
    qi = np.int64(q)
    h = qi >> 1
    u = (u * _pow2i(h)) * _pow2i(qi - h)
    if d < np.float32(-104.0):
        u = np.float32(0.0)
    if d > np.float32(100.0):
        u = np.float32(np.inf)
    return u


@njit(nogil=True)
def softmax_rows(x, pos, listed, n, W, sink, scale, lo, hi, lanes):
    """In place over ``x[:n, lo:hi]`` (the dot products of the compacted list): torch's AVX512
    ``_vec_softmax_lastdim`` of each head's row ``[scores * scale (-inf at -1 entries), sink]``
    of W + 1 columns, the sink's column dropped: ``x`` becomes the probabilities.

    Max over the row (NaN wins), ``e = exp(v - max)`` (Sleef), the sum by ``vec::reduce_all``:
    16 lane sums (lane l takes the columns l, l + 16, ... in order; the last partial vector,
    the sink's column among it, joins lanes 0 ..), then lanes i + 8, i + 4, i + 2, i + 1 added
    into lane i; a row shorter than 16 is summed column by column. Then ``p = e * (1 / sum)``.
    The columns a compacted list leaves out are -1 entries: their e is +0, which leaves every
    lane sum as it is (or the whole row is NaN anyway).
    """
    # Every loop runs from 0 over a row's slice ``[c, lo:hi]``, contiguous: over ``range(lo, hi)``
    # numba keeps negative-index wraparound in the body, and a row of a 2-d slice has strides
    # unknown to LLVM; either leaves the loop scalar (6x slower, measured).
    H = hi - lo
    sk = sink[lo:hi]
    m = sk.copy()
    for c in range(n):
        row = x[c, lo:hi]
        if listed[c]:
            for h in range(H):
                v = row[h] * scale
                row[h] = v
                m[h] = nan_max(m[h], v)
        else:           # -inf never raises the max
            row[:] = -np.inf
    e_sink = np.empty(H, np.float32)
    for h in range(H):
        e_sink[h] = expf_u10(sk[h] - m[h])
    for c in range(n):
        row = x[c, lo:hi]
        for h in range(H):
            row[h] = expf_u10(row[h] - m[h])
    total = np.zeros(H, np.float32)
    if W + 1 < SOFTMAX_LANES:
        for c in range(n):
            row = x[c, lo:hi]
            for h in range(H):
                total[h] += row[h]
        for h in range(H):
            total[h] += e_sink[h]
    else:
        lanes[:, lo:hi] = 0
        for c in range(n):
            lane, row = lanes[pos[c] % SOFTMAX_LANES, lo:hi], x[c, lo:hi]
            for h in range(H):
                lane[h] += row[h]
        lane = lanes[W % SOFTMAX_LANES, lo:hi]
        for h in range(H):
            lane[h] += e_sink[h]
        half = SOFTMAX_LANES // 2
        while half:
            for i in range(half):
                into, add = lanes[i, lo:hi], lanes[i + half, lo:hi]
                for h in range(H):
                    into[h] += add[h]
            half //= 2
        for h in range(H):     # a loop: docs/architecture.md, cold start
            total[h] = lanes[0, lo + h]
    for h in range(H):
        total[h] = np.float32(1.0) / total[h]
    for c in range(n):
        row = x[c, lo:hi]
        for h in range(H):
            row[h] *= total[h]

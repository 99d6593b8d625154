"""Rotary position embedding as the reference computes it: the (YaRN) frequency table and the rotation.

The reference builds its table in f32 torch ops and rotates in complex64, rounding the rotated values
to bf16. Each f32 step is reproduced here in f32 with the same operand order, because a one-ulp change
of a frequency or of a product can flip the bf16 rounding of a rotated value and, through the fp8/fp4
quantisers, a whole quantisation step.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from numba import prange

from .jit import njit
from .numerics import bf16_scalar, fma_f32, is_int, worth_parallel

__all__ = ["yarn_freqs_cis", "apply_rotary", "fma_f32"]

# A rotated pair (or a table entry), in multiply-adds (numerics.worth_parallel).
_PAIR_COST = 16

# torch's CPU complex64 multiply (the reference's rotation) runs each inner loop of the broadcast
# product in blocks of 2 x Vectorized<complex<float>>::size() pairs with separately rounded products,
# and the remaining pairs through the scalar c10::complex operator*, which GCC contracts into FMAs.
# mul is registered with REGISTER_DISPATCH, so an AVX512 machine runs the AVX2 build: 2 x 4 pairs.
TORCH_VEC_PAIRS = 8


def _check_int(value, name, minimum):
    if not is_int(value):
        raise TypeError(f"yarn_freqs_cis: {name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"yarn_freqs_cis: {name} must be >= {minimum}, got {value}")
    return int(value)


def _check_real(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"yarn_freqs_cis: {name} must be a real number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"yarn_freqs_cis: {name} must be finite and > 0, got {value}")
    return value


def _inv_freqs(dim, original_seq_len, base, factor, beta_fast, beta_slow):
    f32 = np.float32
    exponent = np.arange(0, dim, 2, dtype=f32) / f32(dim)  # 2k/dim, an f32 quotient
    # The f32 power base^(2k/dim): computed in float64 and rounded once, the correctly rounded f32.
    power = np.power(np.float64(f32(base)), exponent.astype(np.float64)).astype(f32)
    freqs = f32(1.0) / power
    if original_seq_len > 0:

        def corr(rot):  # float64, as the reference's math.* helpers
            return dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), dim - 1)
        ramp = (np.arange(dim // 2, dtype=f32) - f32(low)) / f32(max(high - low, 0.001))
        ramp = np.minimum(np.maximum(ramp, f32(0.0)), f32(1.0))
        smooth = f32(1.0) - ramp
        # f32 throughout, in this order: (f / factor) * (1 - smooth) + f * smooth.
        freqs = freqs / f32(factor) * (f32(1.0) - smooth) + freqs * smooth
    return freqs.astype(f32)


@njit
def _table_rows(freqs, cos, sin, lo, hi):
    for p in range(lo, hi):
        fp = np.float32(p)
        for k in range(freqs.shape[0]):
            a = fp * freqs[k]  # the f32 angle
            # The reference's torch.polar calls the C library's single-precision cosf/sinf, which
            # are not correctly rounded (glibc's are off by one ulp in ~2% of this table, e.g.
            # position 1228 of the v41-flash table): math.cos of an f32 calls the same cosf.
            cos[p, k] = math.cos(a)
            sin[p, k] = math.sin(a)


@njit(parallel=True)
def _table_kernel(freqs, cos, sin, chunk):
    n = cos.shape[0]
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        _table_rows(freqs, cos, sin, lo, min(lo + chunk, n))


def yarn_freqs_cis(dim, seqlen, original_seq_len, base, factor, beta_fast, beta_slow):
    """The rotary table ``(cos, sin)``, each float32 ``[seqlen, dim // 2]``, for positions
    ``0 .. seqlen - 1``. ``original_seq_len == 0`` gives the plain table (no YaRN;
    factor and betas are then unused). Row p depends only on p, so a longer table serves shorter needs.
    """
    dim = _check_int(dim, "dim", 2)
    if dim % 2:
        raise ValueError(f"yarn_freqs_cis: dim must be even, got {dim}")
    seqlen = _check_int(seqlen, "seqlen", 0)
    original_seq_len = _check_int(original_seq_len, "original_seq_len", 0)
    base = _check_real(base, "base")
    if original_seq_len > 0:
        factor = _check_real(factor, "factor")
        beta_fast = _check_real(beta_fast, "beta_fast")
        beta_slow = _check_real(beta_slow, "beta_slow")
        if base == 1.0:
            raise ValueError("yarn_freqs_cis: base must not be 1 with YaRN (original_seq_len > 0): "
                             "its correction range divides by log(base)")
    freqs = _inv_freqs(dim, original_seq_len, base, factor, beta_fast, beta_slow)
    cos = np.empty((seqlen, dim // 2), dtype=np.float32)
    sin = np.empty((seqlen, dim // 2), dtype=np.float32)
    if worth_parallel(seqlen * (dim // 2), _PAIR_COST):
        _table_kernel(freqs, cos, sin, max(1, 4096 // (dim // 2)))
    elif seqlen:
        _table_rows(freqs, cos, sin, 0, seqlen)
    return cos, sin


@njit
def _rotate_pairs(v, cos_p, sin_p, negate, split):
    """One vector's rotary pairs ``(v[2k], v[2k + 1])`` turned by ``(cos_p[k], sin_p[k])`` (the
    conjugate when ``negate``, for the inverse rotation), rounded to bf16. Pairs before ``split``
    take torch's vectorized product (every product rounded to f32, then one f32 add), the rest
    its scalar tail (``a*c - b*d``, ``a*d + b*c`` contracted: the first product stays exact).
    Loops from 0 over one contiguous vector, so that LLVM vectorises the first."""
    for k in range(split):
        c = cos_p[k]
        s = -sin_p[k] if negate else sin_p[k]
        a = v[2 * k]
        b = v[2 * k + 1]
        v[2 * k] = bf16_scalar(a * c - b * s)
        v[2 * k + 1] = bf16_scalar(a * s + b * c)
    for k in range(split, cos_p.shape[0]):
        c = cos_p[k]
        s = -sin_p[k] if negate else sin_p[k]
        a = v[2 * k]
        b = v[2 * k + 1]
        v[2 * k] = bf16_scalar(fma_f32(a, c, -(b * s)))
        v[2 * k + 1] = bf16_scalar(fma_f32(a, s, b * c))


@njit
def _rotate_rows(y, pos, cos, sin, negate, coalesce, lo, hi):
    w = cos.shape[1]
    off = y.shape[2] - 2 * w
    # Pairs before vec_end in the reference's inner-loop numbering (the row's pairs, or with
    # ``coalesce`` the rows' pairs one after another) take the vectorized product.
    loop_len = y.shape[0] * w if coalesce else w
    vec_end = (loop_len // TORCH_VEC_PAIRS) * TORCH_VEC_PAIRS
    for i in range(lo, hi):
        p = pos[i]
        split = min(max(vec_end - i * w, 0), w) if coalesce else min(vec_end, w)
        for h in range(y.shape[1]):
            _rotate_pairs(y[i, h, off:], cos[p], sin[p], negate, split)


@njit(parallel=True)
def _rotate_kernel(y, pos, cos, sin, negate, coalesce):
    for i in prange(y.shape[0]):
        _rotate_rows(y, pos, cos, sin, negate, coalesce, i, i + 1)


def _check_table(table):
    if not isinstance(table, (tuple, list)) or len(table) != 2:
        raise TypeError("apply_rotary: table must be the (cos, sin) pair yarn_freqs_cis returns")
    cos, sin = np.asarray(table[0]), np.asarray(table[1])
    if cos.dtype != np.float32 or sin.dtype != np.float32:
        raise TypeError(f"apply_rotary: table arrays must be float32, got {cos.dtype} and {sin.dtype}")
    if cos.ndim != 2 or cos.shape != sin.shape:
        raise ValueError(
            f"apply_rotary: cos and sin must be 2-D of one shape [positions, rd/2], got {cos.shape} "
            f"and {sin.shape}"
        )
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)


def apply_rotary(x, positions, table, inverse=False, coalesce_rows=None, inplace=False):
    """Rotate the last ``rd = 2 * table_width`` elements of every vector of ``x`` at its row's position.

    ``x`` is float32 ``[n, ..., d]`` (n rows, any number of head dims), ``positions`` n integers, one per
    row, ``table`` the ``(cos, sin)`` pair of ``yarn_freqs_cis``. Pairs ``(x[2k], x[2k+1])`` of the tail
    are multiplied as complex numbers by ``cos + i sin`` (the conjugate when ``inverse``) in f32 and
    rounded to bf16; the first ``d - rd`` elements are copied unchanged. Returns a new array.

    The f32 product is the one torch's CPU complex multiply gives the reference (see
    ``TORCH_VEC_PAIRS``): pairs inside whole 8-pair blocks of its inner loop have both products
    rounded before the add; the remaining pairs of the loop are computed as
    ``fma(a, c, -f32(b s))`` / ``fma(a, s, f32(b c))``. The inner loop is one vector's ``rd/2`` pairs
    when x has heads (the table row broadcasts over them); with a single vector per row (``[n, d]``)
    torch coalesces all ``n * rd/2`` pairs of the call into one loop, which ``coalesce_rows=None``
    (auto) assumes. Pass ``coalesce_rows=False`` when the reference's table slice for these rows is not
    contiguous (every r-th position), so each row is its own loop.

    With ``inplace=True`` a writeable C-contiguous ``x`` is rotated in place and returned (no copy
    of the untouched head elements).
    """
    arr = np.asarray(x)
    if arr.dtype != np.float32:
        raise TypeError(f"apply_rotary: x must be a float32 array, got dtype {arr.dtype}")
    if arr.ndim < 2:
        raise ValueError(f"apply_rotary: x must be [n, ..., d] with at least 2 dims, got shape {arr.shape}")
    cos, sin = _check_table(table)
    rd = 2 * cos.shape[1]
    if arr.shape[-1] < rd:
        raise ValueError(
            f"apply_rotary: the last dimension of x (shape {arr.shape}) is shorter than rd = {rd}"
        )
    pos = np.asarray(positions)
    if pos.dtype.kind not in "iu":             # integers (not bool)
        raise TypeError(f"apply_rotary: positions must be integers, got dtype {pos.dtype}")
    if pos.shape != (arr.shape[0],):
        raise ValueError(
            f"apply_rotary: positions must have shape ({arr.shape[0]},) to match x of shape {arr.shape}, "
            f"got {pos.shape}"
        )
    # No rows have no position to check, whatever the table (an empty one too). A decode step's
    # one position is read as it is (min and max are reductions).
    if pos.size:
        lo, hi = (pos[0], pos[0]) if pos.size == 1 else (pos.min(), pos.max())
        if lo < 0 or hi >= cos.shape[0]:
            bad = pos[(pos < 0) | (pos >= cos.shape[0])][0]
            span = f"0 .. {cos.shape[0] - 1}" if cos.shape[0] else "it is empty"
            raise ValueError(f"apply_rotary: position {bad} is outside the table ({span})")
    pos = np.ascontiguousarray(pos, dtype=np.int64)
    n = arr.shape[0]
    heads = math.prod(arr.shape[1:-1])
    if inplace:
        if not (arr.flags.c_contiguous and arr.flags.writeable):
            raise ValueError("apply_rotary: inplace=True needs a writeable C-contiguous x")
        y = arr.reshape(n, heads, arr.shape[-1])
    else:
        y = np.array(arr, dtype=np.float32, order="C", copy=True).reshape(n, heads, arr.shape[-1])
    if coalesce_rows is None:
        coalesce = heads == 1
    elif coalesce_rows and heads != 1:
        raise ValueError(
            f"apply_rotary: coalesce_rows=True needs one vector per row, x has shape {arr.shape}"
        )
    else:
        coalesce = bool(coalesce_rows)
    negate = bool(inverse)
    if worth_parallel(n * heads * (rd // 2), _PAIR_COST) and n > 1:
        _rotate_kernel(y, pos, cos, sin, negate, coalesce)
    elif n and heads and rd:
        _rotate_rows(y, pos, cos, sin, negate, coalesce, 0, n)
    return y.reshape(arr.shape)

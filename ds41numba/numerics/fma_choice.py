"""When the FMA twin of the AVX512-BF16 kernel runs: :func:`.bf16_dot.bf16_fma_tile` gives
``vdpbf16ps``'s sums only for inputs whose ranges keep denormals, infinities and NaNs away
(:func:`values_range`, :func:`fma_safe`), and it runs only where it is the faster of the two on
this CPU (:func:`fma_faster`, measured once a process). Both give the same sums, so the choice
moves only speed.
"""

from __future__ import annotations

import os
import time

import numpy as np
from numba import prange

from ..jit import njit
from .bf16_dot import DOT_LANES, DOT_ROWS, tile_product
from .bf16_layouts import bf16_pairs
from .formats import ELEMENT_COST
from .workers import serial_twin, sized_call

__all__ = ["values_range", "magnitudes_range", "fma_safe", "safe_partner", "fma_faster"]

# An input range: (ok, lowest, highest biased exponent of the non-zero values); ok is False for
# a denormal, an inf or NaN, or a value that is not a bf16 value.
_NO_VALUES = (True, 255, 0)
_U32 = np.uint32


@njit
def magnitudes_range(low_bits, smallest_less_one, largest, shift):
    """A range from magnitude bits: the smallest non-zero magnitude (less one: a zero's wraps
    to the top) and the largest, their exponent above bit ``shift`` (255: inf or NaN), and
    ``low_bits``, what a bf16 value leaves zero."""
    if largest == 0:
        return low_bits == 0, np.int64(255), np.int64(0)
    lo = np.int64(_U32(smallest_less_one + _U32(1)) >> shift)
    hi = np.int64(largest >> shift)
    return low_bits == 0 and lo != 0 and hi != 255, lo, hi


@njit
def _row_range(row, pairs):
    """The range of one row of bits: f32 values, or (``pairs``) pairs of bf16 values. One pass
    of unsigned minima, maxima and ors over the magnitudes' bits: an inf or NaN is a largest
    magnitude, a denormal a smallest one. Every step is kept to uint32 and the loop indexes the
    row, or LLVM leaves it scalar."""
    low_bits, largest, smallest = _U32(0), _U32(0), _U32(0xFFFFFFFF)
    if pairs:       # bf16 values by construction: no low bits to check
        for i in range(row.shape[0]):
            a, b = _U32(row[i] & _U32(0x7FFF)), _U32((row[i] >> _U32(16)) & _U32(0x7FFF))
            largest = max(largest, max(a, b))
            smallest = min(smallest, min(_U32(a - _U32(1)), _U32(b - _U32(1))))
        return magnitudes_range(low_bits, smallest, largest, _U32(7))
    for i in range(row.shape[0]):
        m = _U32(row[i] & _U32(0x7FFFFFFF))
        low_bits = _U32(low_bits | (row[i] & _U32(0xFFFF)))
        largest = max(largest, m)
        smallest = min(smallest, _U32(m - _U32(1)))
    return magnitudes_range(low_bits, smallest, largest, _U32(23))


@njit(parallel=True)
def _bits_range(bits, pairs):
    """The range of ``bits [n, m]``: f32 values that should hold bf16 values, or (``pairs``)
    pairs of bf16 values. Rows in parallel, then their ranges together."""
    n = bits.shape[0]
    oks = np.empty(n, np.bool_)
    los = np.empty(n, np.int64)
    his = np.empty(n, np.int64)
    for i in prange(n):
        oks[i], los[i], his[i] = _row_range(bits[i], pairs)
    ok, lo, hi = _NO_VALUES
    for i in range(n):
        ok, lo, hi = ok and oks[i], min(lo, los[i]), max(hi, his[i])
    return ok, lo, hi


_bits_range_serial = serial_twin(_bits_range)


def values_range(x: np.ndarray) -> tuple:
    """``(ok, lowest, highest)`` biased exponent of the non-zero values of f32 ``x`` (or of the
    pairs ``x`` holds, when uint32); ok False when one is denormal, inf, NaN or not bf16."""
    x = np.ascontiguousarray(x)
    pairs = x.dtype == np.uint32
    bits = x if pairs else np.ascontiguousarray(x, np.float32).view(np.uint32)
    rows = bits.reshape(-1, bits.shape[-1] if bits.ndim else 1)
    return sized_call(_bits_range, rows.shape[0], rows.shape[1] * ELEMENT_COST, rows, pairs)


def fma_safe(a_range: tuple, b_range: tuple, k: int) -> bool:
    """Whether :func:`.bf16_dot.bf16_fma_tile` gives ``vdpbf16ps``'s sums for inputs of these
    ranges and ``k`` products a sum: no denormal, inf or NaN among them (``vdpbf16ps`` reads
    denormals as zero), and no partial sum can be denormal or overflow. A product of bf16 values
    of biased exponents ``Ea``, ``Eb`` is a multiple of ``2^(Ea + Eb - 268)``, so is every sum
    of such products and its f32 rounding: with ``Ea + Eb >= 142`` for the smallest no non-zero
    sum lies below ``2^-126``. Each product is below ``2^(Ea + Eb - 252)``, k of them below
    ``2^(bits(k) + Ea + Eb - 252)``: at most ``2^127`` when the largest add up to ``379 - bits(k)``.
    """
    if not (a_range[0] and b_range[0]):
        return False
    if b_range[1] > b_range[2]:
        return True         # a side of zeros
    lowest, highest = safe_partner(a_range, k)
    return lowest <= b_range[1] and b_range[2] <= highest


def safe_partner(a_range: tuple, k: int) -> tuple:
    """The biased exponents ``(lowest, highest)`` the non-zero values of an operand must keep
    for :func:`fma_safe` to hold against an operand of ``a_range`` (whose ``ok`` the caller has
    checked), as an operand checked piece by piece asks: any normal value against a side of
    zeros."""
    if a_range[1] > a_range[2]:
        return 1, 254
    return 142 - a_range[1], 379 - int(k).bit_length() - a_range[2]


_fma_choice: list = []


def fma_faster() -> bool:
    """Whether :func:`.bf16_dot.bf16_fma_tile` beats :func:`.bf16_dot.bf16_dot_tile` on this CPU,
    measured once a process (a few milliseconds; both give the same sums, so only speed rides on
    it); ``DS41NUMBA_BF16_FMA=1`` / ``0`` decides instead."""
    if not _fma_choice:
        forced = os.environ.get("DS41NUMBA_BF16_FMA")
        _fma_choice.append(forced == "1" if forced in ("0", "1") else _measure_fma_faster())
    return _fma_choice[0]


@njit
def _hot_tiles(a, b, out, reps):
    for _ in range(reps):
        tile_product(a, b, out, False)


def _measure_fma_faster() -> bool:
    pairs = 256
    x = np.full((DOT_ROWS, 2 * pairs), 1.0, np.float32)
    b = np.full((pairs, DOT_LANES), np.uint32(0x3C003C00))
    out = np.zeros((DOT_ROWS, DOT_LANES), np.float32)
    a = bf16_pairs(x)
    best = {}
    for _ in range(3):
        for name, operand in (("dot", a), ("fma", x)):
            t0 = time.perf_counter()
            _hot_tiles(operand, b, out, 200)
            best[name] = min(best.get(name, np.inf), time.perf_counter() - t0)
    return best["fma"] < 0.95 * best["dot"]

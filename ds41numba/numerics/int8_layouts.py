"""The per-block integer layouts of fp4 rows, the operands of the AVX512-VNNI kernel
(:mod:`.int8_dot`): each value of an fp4 (e8m0) row as a small integer and each 32-value block's
power of two, packed into bytes, and the range of the packed rows that tells
:func:`.int8_dot.int8_dot_exact` whether their dot products are exact.

The folded layouts (one power of two a row, :mod:`.folded_layouts`) build on the same
decomposition and checks (:func:`group_exponent`, :func:`range_of`, :func:`check_out`,
:func:`blocks_out`).
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..jit import njit
from .bf16_dot import DOT_LANES
from .formats import ELEMENT_COST, FP4_BLOCK, as_f32_array
from .workers import serial_twin, sized_call

__all__ = ["INT8_GROUP", "INT8_MAX", "KEY_OFFSET", "EMPTY_RANGE", "int8_rows", "pack_int8_blocks",
           "int8_blocks_shape", "merge_ranges"]


# An fp4 (e8m0) quantised block is ``e2m1 * s`` with ``s`` a power of two, and twice an e2m1
# value is an integer in [-12, 12]: each value of a block is ``n * 2^e``, ``|n| <= 12``, one
# ``e`` for the block.

#: Values that share one power of two (the fp4 quantiser's block).
INT8_GROUP = FP4_BLOCK
#: The largest ``|n|`` of a value ``n * 2^e`` (twice e2m1's largest, 6).
INT8_MAX = 12
#: ``vpdpbusd`` multiplies unsigned by signed bytes: the B operand (the keys) is stored as
#: ``n + KEY_OFFSET`` in [0, 24], and the A operand's rows carry ``-KEY_OFFSET * sum(n)`` per
#: group to take the offset's products back out.
KEY_OFFSET = INT8_MAX

# A range summarises packed rows for :func:`.int8_dot.int8_dot_exact`: int64 [bad rows, lowest
# exponent, highest exponent, widest spread of one row's exponents], exponents over non-zero groups
# only.
NO_EXP = 1 << 20
#: The range of no rows (or rows of zeros).
EMPTY_RANGE = np.array([0, NO_EXP, -NO_EXP, 0], np.int64)
# Products stay normal f32 numbers (vdpbf16ps flushes denormals, BLAS does not) and finite.
MIN_EXP, MAX_EXP = -126, 124


@njit
def group_exponent(blk):
    """The ``e`` of a group: the smallest with ``INT8_MAX * 2^e >= max |x|``, read from the bits
    of ``max |x|`` (no division that could round); ``NO_EXP`` for a group of zeros, and
    ``-NO_EXP`` when ``max |x|`` is not a finite normal number (a NaN's bits, as an integer,
    lie above every finite value's)."""
    top = np.int32(0)
    for j in range(blk.shape[0]):
        top = max(top, np.float32(blk[j]).view(np.int32) & np.int32(0x7FFFFFFF))
    if top == 0:
        return NO_EXP
    biased = top >> 23
    if biased == 0 or biased == 255:
        return -NO_EXP
    # max |x| = m * 2^E, m in [1, 2): 12 * 2^(E-3) = 1.5 * 2^E covers it when m <= 1.5.
    return biased - 127 - (3 if (top & 0x7FFFFF) <= 0x400000 else 2)


@njit
def _decompose_row(row, ints, scales):
    """``row [d]`` as ``ints[i] * scales[i // INT8_GROUP]`` with ``|ints| <= INT8_MAX`` and
    power-of-two scales (1 for a group of zeros); returns ``(bad, emin, emax)`` over the
    non-zero groups, ``bad`` when some value is not of that form (not fp4-quantised, NaN, inf,
    denormal) or a scale would leave the range where the products stay normal and finite. Every
    value is checked by rebuilding it from its integer, so a bad row is never packed as good."""
    bad = False
    emin, emax = NO_EXP, -NO_EXP
    for g in range(row.shape[0] // INT8_GROUP):
        blk = row[g * INT8_GROUP:(g + 1) * INT8_GROUP]
        e = group_exponent(blk)
        if e == NO_EXP:
            scales[g] = 1.0
            ints[g * INT8_GROUP:(g + 1) * INT8_GROUP] = 0
            continue
        if e < MIN_EXP or e > MAX_EXP:
            bad = True
            e = 0
        emin, emax = min(emin, e), max(emax, e)
        s = np.uint32((e + 127) << 23).view(np.float32)
        inv = np.uint32((127 - e) << 23).view(np.float32)
        miss = 0
        for j in range(INT8_GROUP):
            t = blk[j] * inv
            # Out of int32's range (or NaN) the conversion is undefined: convert 0 instead.
            n = np.int32(t if abs(t) <= INT8_MAX else 0)
            miss += (np.float32(n) != t) | (np.float32(n) * s != blk[j])
            ints[g * INT8_GROUP + j] = n
        bad |= miss > 0
        scales[g] = s
    return bad, emin, emax


@njit
def _quad(ints, p, offset):
    """Values ``4p .. 4p + 3`` of ``ints`` plus ``offset`` as the bytes of one uint32, value
    ``4p`` in the low byte (x86 is little-endian: byte k of the lane is byte k in memory)."""
    q = np.uint32(0)
    for k in range(4):
        q |= np.uint32((ints[4 * p + k] + offset) & 0xFF) << np.uint32(8 * k)
    return q


@njit
def range_of(bad, emin, emax):
    """The range (see ``EMPTY_RANGE``) of rows with these per-row results."""
    out = EMPTY_RANGE.copy()
    for i in range(bad.shape[0]):
        out[0] += bad[i]
        if emin[i] <= emax[i]:
            out[1] = min(out[1], emin[i])
            out[2] = max(out[2], emax[i])
            out[3] = max(out[3], emax[i] - emin[i])
    return out


@njit(parallel=True)
def _rows_kernel(x, quads, corr, scales):
    """A operand: row i of ``x`` as signed bytes ``quads [n, d / 4]``, its per-group scales and
    ``-KEY_OFFSET * sum(n)`` per group (``corr``); returns the rows' range."""
    n, d = x.shape
    bad = np.zeros(n, np.int64)
    emin = np.empty(n, np.int64)
    emax = np.empty(n, np.int64)
    for i in prange(n):
        ints = np.empty(d, np.int32)
        bad[i], emin[i], emax[i] = _decompose_row(x[i], ints, scales[i])
        for g in range(d // INT8_GROUP):
            corr[i, g] = -KEY_OFFSET * ints[g * INT8_GROUP:(g + 1) * INT8_GROUP].sum()
        for p in range(d // 4):
            quads[i, p] = _quad(ints, p, 0)
    return range_of(bad, emin, emax)


_rows_kernel_serial = serial_twin(_rows_kernel)


@njit(parallel=True)
def _blocks_kernel(x, quads, scales, first):
    """B operand: row i of ``x`` into lane ``(first + i) % DOT_LANES`` of block ``(first + i) //
    DOT_LANES``, bytes ``n + KEY_OFFSET``; returns the rows' range."""
    n, d = x.shape
    bad = np.zeros(n, np.int64)
    emin = np.empty(n, np.int64)
    emax = np.empty(n, np.int64)
    for i in prange(n):
        r = first + i
        blk, lane = r // DOT_LANES, r % DOT_LANES
        ints = np.empty(d, np.int32)
        s = np.empty(d // INT8_GROUP, np.float32)
        bad[i], emin[i], emax[i] = _decompose_row(x[i], ints, s)
        scales[blk, :, lane] = s
        for p in range(d // 4):
            quads[blk, p, lane] = _quad(ints, p, KEY_OFFSET)
    return range_of(bad, emin, emax)


_blocks_kernel_serial = serial_twin(_blocks_kernel)


def int8_input(x, name):
    x = np.ascontiguousarray(as_f32_array(x, name))
    if x.ndim != 2 or x.shape[1] % INT8_GROUP:
        raise ValueError(f"{name}: x must be [n, d] with d a multiple of {INT8_GROUP}, got shape "
                         f"{x.shape}")
    return x


def check_out(a, shape, dtype, name, what):
    if (not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape[1:] != shape[1:]
            or a.shape[0] < shape[0] or not a.flags.c_contiguous):
        raise ValueError(f"{name}: {what} must be a C-contiguous {np.dtype(dtype).name} array "
                         f"[>= {shape[0]}, {', '.join(map(str, shape[1:]))}], got "
                         f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")


def int8_rows(x: np.ndarray, out: tuple | None = None) -> tuple:
    """fp4-valued rows ``x [n, d]`` as the A operand of :func:`.int8_dot.int8_dot_tile`: ``(quads
    uint32 [n, d / 4], corr int32 [n, d / 32], scales float32 [n, d / 32], range)``; into the first
    n rows of ``out = (quads, corr, scales)`` when given. The range tells
    :func:`.int8_dot.int8_dot_exact` whether the products are exact; rows that are not fp4 values
    are counted there as bad (and packed as anything), not refused: the caller then takes another
    path. A zero's sign is not kept: its products add nothing to a sum that starts at +0, in any
    kernel."""
    x = int8_input(x, "int8_rows")
    n, d = x.shape
    shapes = ((n, d // 4), (n, d // INT8_GROUP), (n, d // INT8_GROUP))
    dtypes = (np.uint32, np.int32, np.float32)
    if out is None:
        out = tuple(np.empty(s, t) for s, t in zip(shapes, dtypes))
    for a, s, t, what in zip(out, shapes, dtypes, ("quads", "corr", "scales")):
        check_out(a, s, t, "int8_rows", what)
    quads, corr, scales = (a[:n] for a in out)
    # A decode step's few rows run in the calling thread (workers.sized_call).
    return quads, corr, scales, sized_call(_rows_kernel, n, d * ELEMENT_COST, x, quads, corr,
                                           scales)


def int8_blocks_shape(n: int, d: int) -> tuple:
    """Shapes of the B operand of ``n`` rows of ``d`` values: ``(quads, scales)``."""
    blocks = -(-n // DOT_LANES)
    return (blocks, d // 4, DOT_LANES), (blocks, d // INT8_GROUP, DOT_LANES)


def pack_int8_blocks(x: np.ndarray, out: tuple | None = None, first: int = 0) -> tuple:
    """fp4-valued rows ``x [n, d]`` as the B operand of :func:`.int8_dot.int8_dot_tile`: ``(quads
    uint32 [blocks, d / 4, DOT_LANES], scales float32 [blocks, d / 32, DOT_LANES], range)``, row
    ``first + i`` in lane ``(first + i) % DOT_LANES`` of block ``(first + i) // DOT_LANES``. Into
    ``out = (quads, scales)`` when given (its other rows untouched), else into fresh arrays (the
    padding lanes zero, scale 1) with ``first = 0``. Bad rows as in :func:`int8_rows`."""
    x = int8_input(x, "pack_int8_blocks")
    n, d = x.shape
    shapes = int8_blocks_shape(n, d)
    out = blocks_out(out, shapes, n, first, "pack_int8_blocks",
                      lambda: (np.full(shapes[0], np.uint32(KEY_OFFSET * 0x01010101)), np.ones(shapes[1], np.float32)))
    return out[0], out[1], sized_call(_blocks_kernel, n, d * ELEMENT_COST, x, out[0], out[1],
                                      first)


def blocks_out(out, shapes, n, first, name, fresh):
    """``out = (quads, scales)`` checked for rows ``first .. first + n`` of a B operand of
    ``shapes``, or ``fresh()`` (then ``first`` must be 0)."""
    if out is None:
        if first:
            raise ValueError(f"{name}: first needs an out array")
        out = fresh()
    for a, s, t, what in zip(out, shapes, (np.uint32, np.float32), ("quads", "scales")):
        check_out(a, (1,) + s[1:], t, name, what)
    if out[0].shape[0] != out[1].shape[0] or not 0 <= first <= out[0].shape[0] * DOT_LANES - n:
        raise ValueError(f"{name}: out has no room for rows {first}..{first + n}")
    return out


def merge_ranges(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The range of the rows of two ranges together."""
    return np.array([a[0] + b[0], min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3])], np.int64)

"""The folded layouts of fp4 rows: each row's block scales folded into its bytes, one power of
two left a row, so that a dot product of two rows is one integer times one power of two.

AMX's tile products (:mod:`.amx_dot`) sum 64 values at a time across two of the fp4 quantiser's
blocks, so the blocks' scales must be in the integers already: a row's values are
``n_g * 2^e_g`` (``|n_g| <= 12``), that is ``(n_g * 2^(e_g - e_min)) * 2^e_min``, and while the
row's exponents lie at most ``FOLD_SPREAD`` apart the folded integers are still signed bytes.
The VNNI tier reads the same folding with the keys offset into unsigned bytes
(:func:`pack_offset_folded_blocks`, :func:`folded_corrections`). :func:`foldable` says whether
rows were folded whole.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..jit import njit
from .bf16_dot import DOT_LANES
from .formats import ELEMENT_COST, aligned_empty
from .int8_layouts import (INT8_GROUP, INT8_MAX, MAX_EXP, MIN_EXP, NO_EXP, blocks_out, check_out,
                           group_exponent, int8_blocks_shape, int8_input, range_of)
from .workers import serial_twin, sized_call

__all__ = ["AMX_K", "AMX_ROWS", "FOLD_SPREAD", "FOLDED_KEY_OFFSET", "folded_rows",
           "pack_folded_blocks", "folded_blocks_shape", "empty_folded_blocks",
           "pack_offset_folded_blocks", "folded_corrections", "foldable"]

#: The widest spread of one row's block exponents whose folded integers stay signed bytes
#: (``12 * 2^3 = 96 <= 127``).
FOLD_SPREAD = 3
#: Values one AMX tile product takes (64 bytes): a folded row's length is a multiple of it.
AMX_K = 64
#: Rows of A one AMX tile product multiplies (a tile register's rows); A is padded to a
#: multiple.
AMX_ROWS = 16


@njit
def _pow2(e):
    """``2^e`` as an f32, for ``-126 <= e <= 127``."""
    return np.uint32((e + 127) << 23).view(np.float32)


@njit
def _fold_row(row, ints, exps):
    """``row`` as folded integers in ``ints`` (``n_g * 2^(e_g - e_min)``; those past a byte, in a
    row that cannot be folded, as 0); returns ``(bad, emin, emax, scale)``, ``scale = 2^e_min`` (1
    for a row of zeros), the group exponents and the test of every value as :mod:`.int8_layouts`'
    decomposition. Branch-free over the values, so the loops vectorise: the folded integer is the
    value times ``2^-e_min``, an exact scaling."""
    bad = False
    emin, emax = NO_EXP, -NO_EXP
    for g in range(exps.shape[0]):
        e = group_exponent(row[g * INT8_GROUP:(g + 1) * INT8_GROUP])
        if e != NO_EXP:
            if e < MIN_EXP or e > MAX_EXP:
                bad = True
                e = 0
            emin, emax = min(emin, e), max(emax, e)
        exps[g] = e
    if emin > emax:
        ints[:] = 0
        return bad, emin, emax, np.float32(1.0)
    to_folded = _pow2(-emin)
    miss = 0
    for g in range(exps.shape[0]):
        # a group of zeros: any scale reads its values as zeros
        to_ints = _pow2(-exps[g]) if exps[g] != NO_EXP else np.float32(1.0)
        for j in range(g * INT8_GROUP, (g + 1) * INT8_GROUP):
            v = row[j]
            n = v * to_ints
            # Out of int32's range (or NaN) a conversion is undefined: convert 0 instead.
            whole = np.float32(np.int32(n if abs(n) <= INT8_MAX else np.float32(0.0)))
            miss += whole != n
            t = v * to_folded
            ints[j] = np.int32(t if abs(t) <= 127 else np.float32(0.0))
    return bad or miss > 0, emin, emax, _pow2(emin)


# Rows one worker folds with one scratch buffer (a buffer a row cost as much as the row).
_FOLD_CHUNK = 64


@njit(parallel=True)
def _fold_kernel(x, out, scales, first, offset):
    """Row i of ``x`` folded into lane ``L = (first + i) % lanes`` of block ``(first + i) //
    lanes``: its bytes plus ``offset`` ``out[block, p, 4L .. 4L + 3]`` (``out`` the quads' bytes,
    ``[blocks, d / 4, 4 * lanes]`` uint8; offset 0 keeps a signed byte's bits) and
    ``scales[block, 0, L]``. The A operand is blocks of one lane."""
    n, d = x.shape
    lanes = scales.shape[2]
    bad = np.zeros(n, np.int64)
    emin = np.empty(n, np.int64)
    emax = np.empty(n, np.int64)
    for c in prange(-(-n // _FOLD_CHUNK)):
        ints = np.empty(d, np.int32)
        exps = np.empty(d // INT8_GROUP, np.int64)
        for i in range(c * _FOLD_CHUNK, min(n, (c + 1) * _FOLD_CHUNK)):
            blk, lane = (first + i) // lanes, (first + i) % lanes
            bad[i], emin[i], emax[i], scales[blk, 0, lane] = _fold_row(x[i], ints, exps)
            for p in range(d // 4):
                for k in range(4):
                    out[blk, p, 4 * lane + k] = np.uint8((ints[4 * p + k] + offset) & 0xFF)
    return range_of(bad, emin, emax)


_fold_kernel_serial = serial_twin(_fold_kernel)


def _fold(x, out, scales, first, offset):
    """:func:`_fold_kernel`, in the calling thread for a few rows (a decode step's key, its query
    heads: workers.sized_call)."""
    n, d = x.shape
    return sized_call(_fold_kernel, -(-n // _FOLD_CHUNK), _FOLD_CHUNK * d * ELEMENT_COST,
                      x, out, scales, first, offset)


def _folded_input(x, name):
    x = int8_input(x, name)
    if x.shape[1] % AMX_K:
        raise ValueError(f"{name}: rows must be a multiple of {AMX_K} values long, got {x.shape[1]}")
    return x


def folded_rows(x: np.ndarray, out: tuple | None = None) -> tuple:
    """fp4-valued rows ``x [n, d]`` (``d`` a multiple of ``AMX_K``) as the A operand of
    :func:`.amx_dot.amx_dot_tile`: ``(quads uint32 [n, d / 4] of signed bytes, scales float32 [n,
    1], range)``, into the first n rows of ``out = (quads, scales)`` when given. Rows that are not
    fp4 values count as bad in the range, rows whose exponents spread wider than FOLD_SPREAD in its
    spread: :func:`foldable` says whether the products are exact."""
    x = _folded_input(x, "folded_rows")
    n, d = x.shape
    shapes = ((n, d // 4), (n, 1))
    if out is None:
        out = (np.empty(shapes[0], np.uint32), np.empty(shapes[1], np.float32))
    for a, s, t, what in zip(out, shapes, (np.uint32, np.float32), ("quads", "scales")):
        check_out(a, s, t, "folded_rows", what)
    quads, scales = out[0][:n], out[1][:n]
    return quads, scales, _fold(x, quads.view(np.uint8).reshape(n, d // 4, 4),
                                scales.reshape(n, 1, 1), 0, 0)


def folded_blocks_shape(n: int, d: int) -> tuple:
    """Shapes of the B operand of ``n`` rows of ``d`` values: ``(quads, scales)``."""
    quads = int8_blocks_shape(n, d)[0]
    return quads, (quads[0], 1, DOT_LANES)


def pack_folded_blocks(x: np.ndarray, out: tuple | None = None, first: int = 0) -> tuple:
    """fp4-valued rows ``x [n, d]`` as the B operand of :func:`.amx_dot.amx_dot_tile`: ``(quads
    uint32 [blocks, d / 4, DOT_LANES] of signed bytes, scales float32 [blocks, 1, DOT_LANES],
    range)``, row ``first + i`` in lane ``(first + i) % DOT_LANES`` of block ``(first + i) //
    DOT_LANES``; into ``out`` when given (its other rows untouched), else fresh arrays (padding
    lanes zero, scale 1) with ``first = 0``. The range as in :func:`folded_rows`."""
    return _pack_folded(x, out, first, 0, "pack_folded_blocks")


def _pack_folded(x, out, first, offset, name):
    """:func:`pack_folded_blocks` with each byte plus ``offset`` (0, or FOLDED_KEY_OFFSET for
    :func:`pack_offset_folded_blocks`), the padding of fresh arrays bytes ``offset``."""
    x = _folded_input(x, name)
    n, d = x.shape
    out = blocks_out(out, folded_blocks_shape(n, d), n, first, name,
                      lambda: empty_folded_blocks(n, d, offset))
    return out[0], out[1], _fold(x, out[0].view(np.uint8), out[1], first, offset)


def empty_folded_blocks(n: int, d: int, offset: int = 0) -> tuple:
    """A folded B operand of ``n`` rows of ``d`` values, none packed: ``(quads, scales)``, quads
    of zeros (bytes ``offset``; 64-byte aligned: whole cache lines for the tile loads), scales
    of 1."""
    shapes = folded_blocks_shape(n, d)
    quads = aligned_empty(shapes[0], np.uint32)
    quads[:] = np.uint32(offset * 0x01010101)
    return quads, np.ones(shapes[1], np.float32)


# vpdpbusd multiplies unsigned by signed bytes. Folded for it, the keys are unsigned bytes
# n + FOLDED_KEY_OFFSET (n in [-96, 96]), and each query row carries -FOLDED_KEY_OFFSET * sum(n)
# to take the offset's products back out: one group of all the row's values, one scale a row,
# one integer a dot product. The same exact products as AMX's, on int8_dot_tile.
#: The offset of the folded keys' unsigned bytes.
FOLDED_KEY_OFFSET = 128


def pack_offset_folded_blocks(x: np.ndarray, out: tuple | None = None, first: int = 0) -> tuple:
    """fp4-valued rows ``x [n, d]`` folded as the B operand of :func:`.int8_dot.int8_dot_tile`:
    ``(quads uint32 [blocks, d / 4, DOT_LANES] of unsigned bytes n + FOLDED_KEY_OFFSET, scales
    float32 [blocks, 1, DOT_LANES], range)``, laid out and ranged as :func:`pack_folded_blocks`; the
    A operand is :func:`folded_rows` with :func:`folded_corrections`."""
    return _pack_folded(x, out, first, FOLDED_KEY_OFFSET, "pack_offset_folded_blocks")


@njit(parallel=True)
def _corrections_kernel(quads, out):
    for i in prange(quads.shape[0]):
        total = 0
        for q in quads[i]:
            for k in range(4):
                total += np.int32(np.int8((q >> np.uint32(8 * k)) & np.uint32(0xFF)))
        out[i, 0] = -FOLDED_KEY_OFFSET * total


_corrections_kernel_serial = serial_twin(_corrections_kernel)


def folded_corrections(quads: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """For folded rows (the signed bytes ``quads [n, d / 4]`` of :func:`folded_rows`), int32 ``[n,
    1]``: ``-FOLDED_KEY_OFFSET`` times each row's sum, what :func:`.int8_dot.int8_dot_tile` starts a
    row from against :func:`pack_offset_folded_blocks`' keys (into ``out`` when given)."""
    if not isinstance(quads, np.ndarray) or quads.dtype != np.uint32 or quads.ndim != 2 \
            or not quads.flags.c_contiguous:
        raise ValueError("folded_corrections: quads must be a C-contiguous uint32 [n, d / 4]")
    out = np.empty((quads.shape[0], 1), np.int32) if out is None else out
    check_out(out, (quads.shape[0], 1), np.int32, "folded_corrections", "out")
    sized_call(_corrections_kernel, quads.shape[0], 4 * quads.shape[1], quads, out)
    return out


def foldable(a_range: np.ndarray, b_range: np.ndarray) -> bool:
    """Whether rows of these two ranges were folded whole (no bad rows, every row's exponents within
    FOLD_SPREAD). With :func:`.int8_dot.int8_dot_exact` true as well, :func:`.amx_dot.amx_dot_tile`
    gives the exact dot products."""
    return bool(not (a_range[0] or b_range[0]) and max(a_range[3], b_range[3]) <= FOLD_SPREAD)

"""Exact dot products of fp4 (e2m1, power-of-two block scale) vectors as integer dot products on
AVX512-VNNI: the layouts the operands are packed into, the LLVM-IR micro-kernel, and the test of
when its f32 result is the one every f32 summation order gives.

Whether it runs is read from :func:`.backend.int8_dot_enabled`.
"""

from __future__ import annotations

import llvmlite.ir as ir
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .bf16_dot import DOT_LANES, DOT_ROWS
from .formats import FP4_BLOCK, aligned_empty, as_f32_array
from .vector_ir import (F32, I32, V16F, V16I, close_loop, i64, open_loop, row_operands,
                        row_pointer, splat)

__all__ = ["INT8_GROUP", "INT8_MAX", "KEY_OFFSET", "EMPTY_RANGE", "int8_dot_tile", "int8_dot_into",
           "int8_rows", "pack_int8_blocks", "int8_blocks_shape", "merge_ranges", "int8_dot_exact",
           "AMX_K", "FOLD_SPREAD", "folded_rows", "pack_folded_blocks", "folded_blocks_shape",
           "empty_folded_blocks", "foldable", "FOLDED_KEY_OFFSET", "pack_offset_folded_blocks",
           "folded_corrections"]


# An fp4 (e8m0) quantised block is ``e2m1 * s`` with ``s`` a power of two, and twice an e2m1
# value is an integer in [-12, 12]: each value of a block is ``n * 2^e``, ``|n| <= 12``, one
# ``e`` for the block. A dot product of two such vectors is then, per block, an integer sum of
# products of small integers times one power of two: ``vpdpbusd`` forms those sums (64 byte
# products per instruction, twice ``vdpbf16ps``'s 32) exactly in int32, and two f32 products by
# powers of two place them. numba has no vector types, so the micro-kernel is LLVM IR, as
# :func:`.bf16_dot.bf16_dot_tile` is.

#: Values that share one power of two (the fp4 quantiser's block).
INT8_GROUP = FP4_BLOCK
#: The largest ``|n|`` of a value ``n * 2^e`` (twice e2m1's largest, 6).
INT8_MAX = 12
#: ``vpdpbusd`` multiplies unsigned by signed bytes: the B operand (the keys) is stored as
#: ``n + KEY_OFFSET`` in [0, 24], and the A operand's rows carry ``-KEY_OFFSET * sum(n)`` per
#: group to take the offset's products back out.
KEY_OFFSET = INT8_MAX

# A range summarises packed rows for :func:`int8_dot_exact`: int64 [bad rows, lowest exponent,
# highest exponent, widest spread of one row's exponents], exponents over non-zero groups only.
_NO_EXP = 1 << 20
#: The range of no rows (or rows of zeros).
EMPTY_RANGE = np.array([0, _NO_EXP, -_NO_EXP, 0], np.int64)
# Products stay normal f32 numbers (vdpbf16ps flushes denormals, BLAS does not) and finite.
_MIN_EXP, _MAX_EXP = -126, 124


@njit(cache=True)
def _group_exponent(blk):
    """The ``e`` of a group: the smallest with ``INT8_MAX * 2^e >= max |x|``, read from the bits
    of ``max |x|`` (no division that could round); ``_NO_EXP`` for a group of zeros, and
    ``-_NO_EXP`` when ``max |x|`` is not a finite normal number (a NaN's bits, as an integer,
    lie above every finite value's)."""
    top = np.int32(0)
    for j in range(blk.shape[0]):
        top = max(top, np.float32(blk[j]).view(np.int32) & np.int32(0x7FFFFFFF))
    if top == 0:
        return _NO_EXP
    biased = top >> 23
    if biased == 0 or biased == 255:
        return -_NO_EXP
    # max |x| = m * 2^E, m in [1, 2): 12 * 2^(E-3) = 1.5 * 2^E covers it when m <= 1.5.
    return biased - 127 - (3 if (top & 0x7FFFFF) <= 0x400000 else 2)


@njit(cache=True)
def _decompose_row(row, ints, scales):
    """``row [d]`` as ``ints[i] * scales[i // INT8_GROUP]`` with ``|ints| <= INT8_MAX`` and
    power-of-two scales (1 for a group of zeros); returns ``(bad, emin, emax)`` over the
    non-zero groups, ``bad`` when some value is not of that form (not fp4-quantised, NaN, inf,
    denormal) or a scale would leave the range where the products stay normal and finite. Every
    value is checked by rebuilding it from its integer, so a bad row is never packed as good."""
    bad = False
    emin, emax = _NO_EXP, -_NO_EXP
    for g in range(row.shape[0] // INT8_GROUP):
        blk = row[g * INT8_GROUP:(g + 1) * INT8_GROUP]
        e = _group_exponent(blk)
        if e == _NO_EXP:
            scales[g] = 1.0
            ints[g * INT8_GROUP:(g + 1) * INT8_GROUP] = 0
            continue
        if e < _MIN_EXP or e > _MAX_EXP:
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


@njit(cache=True)
def _quad(ints, p, offset):
    """Values ``4p .. 4p + 3`` of ``ints`` plus ``offset`` as the bytes of one uint32, value
    ``4p`` in the low byte (x86 is little-endian: byte k of the lane is byte k in memory)."""
    q = np.uint32(0)
    for k in range(4):
        q |= np.uint32((ints[4 * p + k] + offset) & 0xFF) << np.uint32(8 * k)
    return q


@njit(cache=True)
def _range_of(bad, emin, emax):
    """The range (see ``EMPTY_RANGE``) of rows with these per-row results."""
    out = EMPTY_RANGE.copy()
    for i in range(bad.shape[0]):
        out[0] += bad[i]
        if emin[i] <= emax[i]:
            out[1] = min(out[1], emin[i])
            out[2] = max(out[2], emax[i])
            out[3] = max(out[3], emax[i] - emin[i])
    return out


@njit(parallel=True, cache=True)
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
    return _range_of(bad, emin, emax)


@njit(parallel=True, cache=True)
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
    return _range_of(bad, emin, emax)


def _int8_input(x, name):
    x = np.ascontiguousarray(as_f32_array(x, name))
    if x.ndim != 2 or x.shape[1] % INT8_GROUP:
        raise ValueError(f"{name}: x must be [n, d] with d a multiple of {INT8_GROUP}, got shape "
                         f"{x.shape}")
    return x


def _check_out(a, shape, dtype, name, what):
    if (not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape[1:] != shape[1:]
            or a.shape[0] < shape[0] or not a.flags.c_contiguous):
        raise ValueError(f"{name}: {what} must be a C-contiguous {np.dtype(dtype).name} array "
                         f"[>= {shape[0]}, {', '.join(map(str, shape[1:]))}], got "
                         f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")


def int8_rows(x: np.ndarray, out: tuple | None = None) -> tuple:
    """fp4-valued rows ``x [n, d]`` as the A operand of :func:`int8_dot_tile`: ``(quads uint32
    [n, d / 4], corr int32 [n, d / 32], scales float32 [n, d / 32], range)``; into the first n
    rows of ``out = (quads, corr, scales)`` when given. The range tells :func:`int8_dot_exact`
    whether the products are exact; rows that are not fp4 values are counted there as bad (and
    packed as anything), not refused: the caller then takes another path. A zero's sign is not
    kept: its products add nothing to a sum that starts at +0, in any kernel."""
    x = _int8_input(x, "int8_rows")
    n, d = x.shape
    shapes = ((n, d // 4), (n, d // INT8_GROUP), (n, d // INT8_GROUP))
    dtypes = (np.uint32, np.int32, np.float32)
    if out is None:
        out = tuple(np.empty(s, t) for s, t in zip(shapes, dtypes))
    for a, s, t, what in zip(out, shapes, dtypes, ("quads", "corr", "scales")):
        _check_out(a, s, t, "int8_rows", what)
    quads, corr, scales = (a[:n] for a in out)
    return quads, corr, scales, _rows_kernel(x, quads, corr, scales)


def int8_blocks_shape(n: int, d: int) -> tuple:
    """Shapes of the B operand of ``n`` rows of ``d`` values: ``(quads, scales)``."""
    blocks = -(-n // DOT_LANES)
    return (blocks, d // 4, DOT_LANES), (blocks, d // INT8_GROUP, DOT_LANES)


def pack_int8_blocks(x: np.ndarray, out: tuple | None = None, first: int = 0) -> tuple:
    """fp4-valued rows ``x [n, d]`` as the B operand of :func:`int8_dot_tile`: ``(quads uint32
    [blocks, d / 4, DOT_LANES], scales float32 [blocks, d / 32, DOT_LANES], range)``, row
    ``first + i`` in lane ``(first + i) % DOT_LANES`` of block ``(first + i) // DOT_LANES``.
    Into ``out = (quads, scales)`` when given (its other rows untouched), else into fresh arrays
    (the padding lanes zero, scale 1) with ``first = 0``. Bad rows as in :func:`int8_rows`."""
    x = _int8_input(x, "pack_int8_blocks")
    n, d = x.shape
    shapes = int8_blocks_shape(n, d)
    out = _blocks_out(out, shapes, n, first, "pack_int8_blocks",
                      lambda: (np.full(shapes[0], np.uint32(KEY_OFFSET * 0x01010101)), np.ones(shapes[1], np.float32)))
    return out[0], out[1], _blocks_kernel(x, out[0], out[1], first)


def _blocks_out(out, shapes, n, first, name, fresh):
    """``out = (quads, scales)`` checked for rows ``first .. first + n`` of a B operand of
    ``shapes``, or ``fresh()`` (then ``first`` must be 0)."""
    if out is None:
        if first:
            raise ValueError(f"{name}: first needs an out array")
        out = fresh()
    for a, s, t, what in zip(out, shapes, (np.uint32, np.float32), ("quads", "scales")):
        _check_out(a, (1,) + s[1:], t, name, what)
    if out[0].shape[0] != out[1].shape[0] or not 0 <= first <= out[0].shape[0] * DOT_LANES - n:
        raise ValueError(f"{name}: out has no room for rows {first}..{first + n}")
    return out


def merge_ranges(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The range of the rows of two ranges together."""
    return np.array([a[0] + b[0], min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3])], np.int64)


# f32's significand: integers up to 2^24 are exact.
_EXACT_BITS = 24


def int8_dot_exact(a_range: np.ndarray, b_range: np.ndarray, d: int) -> bool:
    """Whether every dot product of a row of A with a row of B (``d`` values each, of the two
    ranges) is one f32 number that every f32 summation order reaches, BLAS's and
    ``vdpbf16ps``'s included, and :func:`int8_dot_tile` computes.

    Row a's values are ``n * 2^ea_g`` and row b's ``m * 2^eb_g`` (``|n|, |m| <= 12``). Each
    product is an integer times ``2^(ea_g + eb_g)``, so every partial sum, in any order, is an
    integer multiple of ``2^E0`` (``E0 = min(ea) + min(eb)``) of magnitude at most
    ``144 d 2^E1`` (``E1 = max(ea) + max(eb)``): when ``144 d 2^(E1 - E0) < 2^24`` every partial
    sum is an f32 number, no addition rounds, and every order gives the exact dot product.
    ``E1 - E0`` is at most the sum of the two rows' exponent spreads (for d = 128: spreads adding
    up to 9 or less). That sum also must not leave f32's normal range: ``2^E0 >= 2^-126`` (so
    flushing denormals changes nothing) and ``144 d 2^E1 < 2^128``. The kernel's own steps are
    exact under the same conditions (its group sums are integers below 2^13, its scale products
    powers of two within range). Bad rows (not fp4 values) make it False.
    """
    if a_range[0] or b_range[0]:
        return False
    if a_range[1] > a_range[2] or b_range[1] > b_range[2]:
        return True     # a side of zeros only: every product is zero
    bound = np.log2(INT8_MAX * INT8_MAX * d)
    return (bound + a_range[3] + b_range[3] < _EXACT_BITS
            and a_range[1] + b_range[1] >= _MIN_EXP
            and bound + a_range[2] + b_range[2] < 128)


@intrinsic
def int8_dot_tile(typingctx, a, a_corr, a_scale, b, b_scale, out):
    """``out[m, j] += sum_g f32(I[m, j, g]) * (a_scale[m, g] * b_scale[g, j])`` for ``m <
    DOT_ROWS``, ``j < DOT_LANES``, the groups g in order, where ``I[m, j, g] = a_corr[m, g] +
    sum_p a[m, p] . b[p, j]`` over the group's quads as byte dot products (``vpdpbusd``).

    ``a`` (uint32 ``[DOT_ROWS, d / 4]``: signed bytes), ``a_corr`` (int32 ``[DOT_ROWS, G]``)
    and ``a_scale`` (float32 ``[DOT_ROWS, G]``) as :func:`int8_rows` packs them; ``b`` (uint32
    ``[d / 4, DOT_LANES]``: unsigned bytes) and ``b_scale`` (float32 ``[G, DOT_LANES]``) one
    block of :func:`pack_int8_blocks`; ``out`` float32 ``[DOT_ROWS, DOT_LANES]``. The rows of
    each may lie apart, each row is contiguous. A group is ``d / (4 G)`` quads: 8 for those
    layouts (a 32-value block a scale), all of them for the folded ones (:func:`folded_rows`
    with :func:`folded_corrections`, :func:`pack_offset_folded_blocks`: one scale a row). The
    caller checks the shapes; G >= 1.

    No int32 overflows: the bytes are ``|n| <= 12`` and ``n + 12 <= 24``, so a group's 32
    products sum to at most 32 * 24 * 12 = 9216 in magnitude, and with the correction
    ``|12 sum(n)| <= 4608`` the group sum ``I`` is ``sum n m``, at most 4608 in magnitude
    (exact in f32); folded, ``|n| <= 96`` and ``n + 128 <= 224``, 128 values at most 2.8e6 in
    magnitude before the correction, ``I`` at most 1.2e6. The f32 products and sums are exact
    when :func:`int8_dot_exact` says so.
    """
    return types.void(a, a_corr, a_scale, b, b_scale, out), _int8_codegen(fresh=False)


@intrinsic
def int8_dot_into(typingctx, a, a_corr, a_scale, b, b_scale, out):
    """:func:`int8_dot_tile` into ``out`` instead of onto it: ``out[m, j] = sum_g ...``, the
    output's old contents never read (the tile's first term is stored: never -0, since the
    scales are positive and f32(0) is +0, so this is ``0 + sum`` bit for bit)."""
    return types.void(a, a_corr, a_scale, b, b_scale, out), _int8_codegen(fresh=True)


def quad_sums(builder, a_op, b_op, start, p0, n_quads, row0, name):
    """The loop both VNNI kernels share: for the ``DOT_ROWS`` rows of A from ``row0`` against
    the ``DOT_LANES`` keys of B, the int32 sums ``start[m]`` (a vector a row) plus the byte
    products of quads ``p0 .. p0 + n_quads`` (``vpdpbusd``, the keys' unsigned bytes against
    the queries' signed ones, broadcast); returns them, ``[row][half]`` vectors."""
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16I, [V16I, V16I, V16I]),
                                         "llvm.x86.avx512.vpdpbusd.512")
    nvec = DOT_LANES // 16
    q, entry = open_loop(builder, name)
    acc = [[builder.phi(V16I) for _ in range(nvec)] for _ in range(DOT_ROWS)]
    for m in range(DOT_ROWS):
        for v in range(nvec):
            acc[m][v].add_incoming(start[m], entry)
    p = builder.add(p0, q)
    p4 = builder.mul(p, i64(4))
    bv = [builder.load(row_pointer(builder, b_op, p, i64(64 * v), V16I), align=4) for v in range(nvec)]
    new = []
    for m in range(DOT_ROWS):
        row = builder.add(row0, i64(m))
        aq = splat(builder, builder.load(row_pointer(builder, a_op, row, p4, I32), align=4), V16I)
        # vpdpbusd's unsigned operand is its second (the keys), the signed one its third
        new.append([builder.call(dot, [acc[m][v], bv[v], aq]) for v in range(nvec)])
    body = builder.basic_block
    for m in range(DOT_ROWS):
        for v in range(nvec):
            acc[m][v].add_incoming(new[m][v], body)
    close_loop(builder, q, n_quads, name)
    return new


def _int8_codegen(fresh):
    def codegen(context, builder, signature, args):
        (a_op, c_op, s_op, b_op, t_op, o_op), arrays = row_operands(context, builder, signature, args)
        n_groups = cgutils.unpack_tuple(builder, arrays[4].shape, 2)[0]
        group_quads = builder.sdiv(cgutils.unpack_tuple(builder, arrays[3].shape, 2)[0], n_groups)
        nvec = DOT_LANES // 16
        zero = ir.Constant(V16F, [0.0] * 16)

        def load(operand, row, offset, ty):
            return builder.load(row_pointer(builder, operand, row, offset, ty), align=4)

        g, _ = open_loop(builder, "int8dot")
        g4 = builder.mul(g, i64(4))
        first = builder.icmp_signed("==", g, i64(0))
        start = [splat(builder, load(c_op, i64(m), g4, I32), V16I) for m in range(DOT_ROWS)]
        new = quad_sums(builder, a_op, b_op, start, builder.mul(g, group_quads), group_quads, i64(0),
                        "int8quads")
        sk = [load(t_op, g, i64(64 * v), V16F) for v in range(nvec)]
        for m in range(DOT_ROWS):
            sq = splat(builder, load(s_op, i64(m), g4, F32), V16F)
            for v in range(nvec):
                ptr = row_pointer(builder, o_op, i64(m), i64(64 * v), V16F)
                # f32(I) and the scale product are exact; so is their product (a power of two
                # apart), and the one rounding point, the addition, is exact when int8_dot_exact.
                term = builder.fmul(builder.sitofp(new[m][v], V16F), builder.fmul(sq, sk[v]))
                before = builder.load(ptr, align=4)
                if fresh:
                    before = builder.select(first, zero, before)
                builder.store(builder.fadd(before, term), ptr, align=4)
        close_loop(builder, g, n_groups, "int8dot")
        return context.get_dummy_value()

    return codegen


# ------------------------------------------------------------------------------ folded layouts
# For AMX's tile products (:mod:`.amx_dot`), which sum 64 values at a time across two blocks:
# each row's block scales folded into its bytes, one power of two left a row.

#: The widest spread of one row's block exponents whose folded integers stay signed bytes
#: (``12 * 2^3 = 96 <= 127``).
FOLD_SPREAD = 3
#: Values one AMX tile product takes (64 bytes): a folded row's length is a multiple of it.
AMX_K = 64



@njit(cache=True)
def _pow2(e):
    """``2^e`` as an f32, for ``-126 <= e <= 127``."""
    return np.uint32((e + 127) << 23).view(np.float32)


@njit(cache=True)
def _fold_row(row, ints, exps):
    """``row`` as folded integers in ``ints`` (``n_g * 2^(e_g - e_min)``; those past a byte, in a
    row that cannot be folded, as 0); returns ``(bad, emin, emax, scale)``, ``scale = 2^e_min`` (1 for a
    row of zeros), the group exponents and the test of every value as
    :func:`_decompose_row`'s. Branch-free over the values, so the loops vectorise: the folded
    integer is the value times ``2^-e_min``, an exact scaling."""
    bad = False
    emin, emax = _NO_EXP, -_NO_EXP
    for g in range(exps.shape[0]):
        e = _group_exponent(row[g * INT8_GROUP:(g + 1) * INT8_GROUP])
        if e != _NO_EXP:
            if e < _MIN_EXP or e > _MAX_EXP:
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
        to_ints = _pow2(-exps[g]) if exps[g] != _NO_EXP else np.float32(1.0)
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


@njit(parallel=True, cache=True)
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
    return _range_of(bad, emin, emax)


def _folded_input(x, name):
    x = _int8_input(x, name)
    if x.shape[1] % AMX_K:
        raise ValueError(f"{name}: rows must be a multiple of {AMX_K} values long, got {x.shape[1]}")
    return x


def folded_rows(x: np.ndarray, out: tuple | None = None) -> tuple:
    """fp4-valued rows ``x [n, d]`` (``d`` a multiple of ``AMX_K``) as the A operand of
    :func:`.amx_dot.amx_dot_tile`: ``(quads uint32 [n, d / 4] of signed bytes, scales float32 [n, 1],
    range)``, into the first n rows of ``out = (quads, scales)`` when given. Rows that are not
    fp4 values count as bad in the range, rows whose exponents spread wider than FOLD_SPREAD in
    its spread: :func:`foldable` says whether the products are exact."""
    x = _folded_input(x, "folded_rows")
    n, d = x.shape
    shapes = ((n, d // 4), (n, 1))
    if out is None:
        out = (np.empty(shapes[0], np.uint32), np.empty(shapes[1], np.float32))
    for a, s, t, what in zip(out, shapes, (np.uint32, np.float32), ("quads", "scales")):
        _check_out(a, s, t, "folded_rows", what)
    quads, scales = out[0][:n], out[1][:n]
    return quads, scales, _fold_kernel(x, quads.view(np.uint8).reshape(n, d // 4, 4),
                                       scales.reshape(n, 1, 1), 0, 0)


def folded_blocks_shape(n: int, d: int) -> tuple:
    """Shapes of the B operand of ``n`` rows of ``d`` values: ``(quads, scales)``."""
    quads = int8_blocks_shape(n, d)[0]
    return quads, (quads[0], 1, DOT_LANES)


def pack_folded_blocks(x: np.ndarray, out: tuple | None = None, first: int = 0) -> tuple:
    """fp4-valued rows ``x [n, d]`` as the B operand of :func:`.amx_dot.amx_dot_tile`: ``(quads uint32
    [blocks, d / 4, DOT_LANES] of signed bytes, scales float32 [blocks, 1, DOT_LANES], range)``,
    row ``first + i`` in lane ``(first + i) % DOT_LANES`` of block ``(first + i) // DOT_LANES``;
    into ``out`` when given (its other rows untouched), else fresh arrays (padding lanes zero,
    scale 1) with ``first = 0``. The range as in :func:`folded_rows`."""
    return _pack_folded(x, out, first, 0, "pack_folded_blocks")


def _pack_folded(x, out, first, offset, name):
    """:func:`pack_folded_blocks` with each byte plus ``offset`` (0, or FOLDED_KEY_OFFSET for
    :func:`pack_offset_folded_blocks`), the padding of fresh arrays bytes ``offset``."""
    x = _folded_input(x, name)
    n, d = x.shape
    out = _blocks_out(out, folded_blocks_shape(n, d), n, first, name,
                      lambda: empty_folded_blocks(n, d, offset))
    return out[0], out[1], _fold_kernel(x, out[0].view(np.uint8), out[1], first, offset)


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
    """fp4-valued rows ``x [n, d]`` folded as the B operand of :func:`int8_dot_tile`: ``(quads
    uint32 [blocks, d / 4, DOT_LANES] of unsigned bytes n + FOLDED_KEY_OFFSET, scales float32
    [blocks, 1, DOT_LANES], range)``, laid out and ranged as :func:`pack_folded_blocks`; the A
    operand is :func:`folded_rows` with :func:`folded_corrections`."""
    return _pack_folded(x, out, first, FOLDED_KEY_OFFSET, "pack_offset_folded_blocks")


@njit(parallel=True, cache=True)
def _corrections_kernel(quads, out):
    for i in prange(quads.shape[0]):
        total = 0
        for q in quads[i]:
            for k in range(4):
                total += np.int32(np.int8((q >> np.uint32(8 * k)) & np.uint32(0xFF)))
        out[i, 0] = -FOLDED_KEY_OFFSET * total


def folded_corrections(quads: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """For folded rows (the signed bytes ``quads [n, d / 4]`` of :func:`folded_rows`), int32 ``[n,
    1]``: ``-FOLDED_KEY_OFFSET`` times each row's sum, what :func:`int8_dot_tile` starts a row
    from against :func:`pack_offset_folded_blocks`' keys (into ``out`` when given)."""
    if not isinstance(quads, np.ndarray) or quads.dtype != np.uint32 or quads.ndim != 2 \
            or not quads.flags.c_contiguous:
        raise ValueError("folded_corrections: quads must be a C-contiguous uint32 [n, d / 4]")
    out = np.empty((quads.shape[0], 1), np.int32) if out is None else out
    _check_out(out, (quads.shape[0], 1), np.int32, "folded_corrections", "out")
    _corrections_kernel(quads, out)
    return out


def foldable(a_range: np.ndarray, b_range: np.ndarray) -> bool:
    """Whether rows of these two ranges were folded whole (no bad rows, every row's exponents
    within FOLD_SPREAD). With :func:`int8_dot_exact` true as well, :func:`.amx_dot.amx_dot_tile`
    gives the exact dot products."""
    return bool(not (a_range[0] or b_range[0]) and max(a_range[3], b_range[3]) <= FOLD_SPREAD)
